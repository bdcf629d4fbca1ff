//! End-of-request accounting, collected: what a routed request owes the
//! shared states ([`Owed`]: its estimates and the prompt it queued) and
//! where it went (for passive health and retry counts). Each debt is paid
//! once, at the first of the moments that settle it: the first response
//! byte (the prefill is over), the prefill leg's answer (PD), or the
//! request's end, which pays the rest and reports how it went.

use crate::config::Config;
use crate::health_updates::{self, SentTo};
use crate::host::Host;
use crate::router::Chosen;
use crate::shared_data::cache::StateCache;
use crate::worker_state::{PrefillTicket, Ticket};
use std::rc::Rc;

/// What a request gives back, and where it went.
#[derive(Debug, Default)]
pub(super) struct Owed {
    /// The estimate on the routed (or PD decode) rank, given back at the end.
    estimate: Option<Ticket>,
    /// PD: the estimate on the prefill rank, given back when the prefill
    /// leg answers (or at the end).
    prefill_leg_estimate: Option<Ticket>,
    /// The prompt queued on its rank (prefix affinity, admission), taken
    /// back when its prefill is over.
    queued_prefill: Option<PrefillTicket>,
    /// Where the request was sent, for passive health and retry stats.
    sent_to: Option<SentTo>,
}

impl Owed {
    /// Routed: the estimate on its rank and the prompt queued there.
    pub fn routed(&mut self, estimate: Option<Ticket>, queued_prefill: Option<PrefillTicket>) {
        self.estimate = estimate;
        self.queued_prefill = queued_prefill;
    }

    /// PD: the decode leg's estimate, the prefill leg's, and the prompt
    /// queued on the prefill rank.
    pub fn routed_pd(
        &mut self,
        decode_estimate: Option<Ticket>,
        prefill_estimate: Option<Ticket>,
        queued_prefill: Option<PrefillTicket>,
    ) {
        self.estimate = decode_estimate;
        self.prefill_leg_estimate = prefill_estimate;
        self.queued_prefill = queued_prefill;
    }

    /// Remembers where the request went (`to` first, then its alternates)
    /// and when, if its end can tell something.
    pub fn sent_to<'c>(
        &mut self,
        config: &Config,
        to: impl Iterator<Item = &'c Chosen>,
        rank: Option<u32>,
        clean: bool,
        at_ms: u64,
    ) {
        if config.passive_health.is_some() || config.retry_alternates > 0 {
            self.sent_to = Some(SentTo {
                hosts: addresses(config, to),
                rank,
                routed_at_ms: at_ms,
                health_was_clean: clean,
            });
        }
    }

    /// Remembers a request the cluster's fallback policy sends: its answer
    /// still tells about the host it picks.
    pub fn sent_to_fallback(&mut self, config: &Config, host: &dyn Host) {
        if config.passive_health.is_some() {
            self.sent_to(config, std::iter::empty(), None, false, host.now_ms());
        }
    }

    /// When the request was routed (0: it was not).
    pub fn routed_at_ms(&self) -> u64 {
        self.sent_to.as_ref().map_or(0, |w| w.routed_at_ms)
    }

    /// Its first response byte came (streamed): its prefill is over, and
    /// its queued prompt leaves its rank, once.
    pub fn first_byte(&mut self, config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache) {
        if let Some(queued) = self.queued_prefill.take() {
            cache.prefill_started(config, host, &queued);
        }
    }

    /// PD: the prefill leg answered (or failed): its estimate goes back,
    /// with the prompt it queued in the same write.
    pub fn prefill_leg_answered(&mut self, config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache) {
        if let Some(estimate) = self.prefill_leg_estimate.take() {
            let queued = self.queued_prefill.take();
            cache.release(config, host, &estimate, queued.as_ref());
        }
    }

    /// The request is over (completed, reset or refused): every estimate
    /// goes back (a prompt still queued, when no body came, in the same
    /// write as its worker's estimate), and how it went counts for its
    /// workers' health.
    pub fn settle(&mut self, config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache) {
        let mut queued = self.queued_prefill.take();
        for estimate in [self.estimate.take(), self.prefill_leg_estimate.take()]
            .into_iter()
            .flatten()
        {
            let with = queued.take_if(|q| q.worker == estimate.worker);
            cache.release(config, host, &estimate, with.as_ref());
        }
        if let Some(queued) = queued {
            cache.prefill_started(config, host, &queued);
        }
        if let Some(sent_to) = self.sent_to.take() {
            health_updates::request_ended(config, host, &sent_to);
        }
    }
}

/// The hosts chosen workers are sent to (a rank port, where the worker has
/// one per rank): what Envoy's `upstream.address` names.
fn addresses<'a>(config: &Config, chosen: impl Iterator<Item = &'a Chosen>) -> Vec<std::net::SocketAddr> {
    chosen
        .filter_map(|c| {
            let w = config.worker(c.worker)?;
            Some(c.rank.map_or(w.address, |r| w.rank_address(r)))
        })
        .collect()
}
