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
            prefill_started(config, host, cache, &queued);
        }
    }

    /// PD: the prefill leg answered (or failed): its estimate goes back,
    /// with the prompt it queued in the same write.
    pub fn prefill_leg_answered(&mut self, config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache) {
        if let Some(estimate) = self.prefill_leg_estimate.take() {
            let queued = self.queued_prefill.take();
            release(config, host, cache, &estimate, queued.as_ref());
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
            release(config, host, cache, &estimate, with.as_ref());
        }
        if let Some(queued) = queued {
            prefill_started(config, host, cache, &queued);
        }
        if let Some(sent_to) = self.sent_to.take() {
            health_updates::request_ended(config, host, &sent_to);
        }
    }
}

/// Gives back a routed request's estimate when its stream ends (and its
/// queued prompt, in the same write, when no response byte came first);
/// `config` is the one it was routed with. No call when a snapshot has
/// counted it since and nothing else is to go.
fn release(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    estimate: &Ticket,
    queued: Option<&PrefillTicket>,
) {
    if queued.is_none() && cache.counted_by_snapshot(config, estimate) {
        // A snapshot counted the request: nothing is left to give back.
        return;
    }
    cache.write_as_routed(config, host, estimate.worker, |state| {
        let released = state.release(estimate);
        match queued {
            Some(queued) => {
                state.prefill_started(queued);
                Some(())
            }
            None => released.then_some(()),
        }
    });
}

/// A routed request's prefill is over (its first response byte came, the
/// prefill leg answered, or it ended): its queued prompt leaves its rank.
fn prefill_started(config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache, queued: &PrefillTicket) {
    cache.write_as_routed(config, host, queued.worker, |state| {
        state.prefill_started(queued);
        Some(())
    });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QueueMeasure;
    use crate::router::{route, Decision, Input, RouteArgs};
    use crate::shared_data::read_worker_states;
    use crate::shared_data::testing::fleet;

    #[test]
    fn an_ended_request_gives_its_estimate_and_its_queued_prompt_back() {
        let (c, h) = fleet("");
        let mut cache = StateCache::default();
        let body = br#"{"text":"a long prompt indeed, long"}"#;
        let Ok(Decision::Route(r)) = route(&c, &h, &mut cache, Input::Body(body), &RouteArgs::default())
        else {
            panic!("routed")
        };
        let state = || read_worker_states(&c, &h)[1].clone().unwrap();
        let queued = |rank: u32| {
            state()
                .prefill
                .queued(rank as usize, QueueMeasure::Local)
                .requests
        };
        let rank = r
            .queued_prefill
            .map(|q| q.rank)
            .expect("prefix affinity queues its prompt");
        assert!(state().pending_total() > 0);
        assert_eq!(queued(rank), 1);
        let mut owed = Owed::default();
        owed.routed(r.estimate, r.queued_prefill);
        owed.settle(&c, &h, &mut cache);
        assert_eq!((state().pending_total(), queued(rank)), (0, 0));
        owed.settle(&c, &h, &mut cache);
        assert_eq!(state().pending_total(), 0, "paid once");
    }
}
