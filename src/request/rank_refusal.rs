//! A worker that answers 400 to the rank value dprank wrote: the request
//! watches its answer ([`RankWatch`]), and what a refusal teaches
//! (`worker_state::rank_value::learn`) goes into the worker's state, for
//! every thread and every later request, counted and logged once. A worker
//! whose range is smaller than its last report (restarted with fewer ranks)
//! loses its top ranks at once, until its next poll.

use crate::config::Config;
use crate::host::Host;
use crate::metrics::PerWorker;
use crate::router::Chosen;
use crate::shared_data::{self, IfMissing};
use crate::worker_state::rank_value::{self, Learned};

/// The most of a 400 answer read for a rank refusal.
pub const REFUSAL_BYTES: usize = 1024;

/// A rank value written for a request: which worker, its rank index, the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub worker: usize,
    pub rank: u32,
    pub value: u32,
    /// The host it was sent to (a retry may land elsewhere: only this
    /// host's refusal says anything about the worker).
    pub endpoint: std::rc::Rc<str>,
}

/// A request's watch on the rank value written for it.
#[derive(Debug, Default)]
pub(super) struct RankWatch {
    /// The rank value written, until the answer shows it was not refused.
    written: Option<Written>,
    /// The answer is a 400: its first body chunk is read for a refusal.
    reads_refusal: bool,
}

impl RankWatch {
    /// The request goes to `chosen`: the value written for it, if any, is
    /// watched.
    pub fn watch(&mut self, chosen: &Chosen) {
        self.written = chosen.rank.zip(chosen.value).map(|(rank, value)| Written {
            worker: chosen.worker,
            rank,
            value,
            endpoint: chosen.endpoint.clone(),
        });
    }

    /// Whether a rank value written is watched (the answer's status is
    /// then to be read).
    pub fn is_watching(&self) -> bool {
        self.written.is_some()
    }

    /// The response's headers, with its `status`: only a 400 can refuse
    /// the rank value written, and only from the host it was written for
    /// (not a retry's).
    pub fn on_response_headers(&mut self, host: &dyn Host, status: Option<u32>) {
        if let Some(written) = &self.written {
            self.reads_refusal = status == Some(400)
                && host
                    .property(&["upstream", "address"])
                    .ok()
                    .flatten()
                    .is_some_and(|a| a == written.endpoint.as_bytes());
            if !self.reads_refusal {
                self.written = None;
            }
        }
    }

    /// A chunk of the response body (`body_size` bytes): the first of a
    /// 400 is read for a refusal.
    pub fn on_response_body(&mut self, config: &Config, host: &dyn Host, body_size: usize) {
        if std::mem::take(&mut self.reads_refusal) {
            if let (Some(written), Ok(body)) = (
                self.written.take(),
                host.response_body(body_size.min(REFUSAL_BYTES)),
            ) {
                rank_refused(config, host, written, &body);
            }
        }
    }
}

/// The worker answered 400 with `body` (its first bytes) to `written`: if it
/// is a rank refusal, the worker's state learns what it teaches.
fn rank_refused(config: &Config, host: &dyn Host, written: Written, body: &[u8]) {
    let Some(refusal) = rank_value::refusal(body) else {
        return;
    };
    let Some(w) = config.worker(written.worker) else {
        return;
    };
    let changed = shared_data::update_worker(config, host, written.worker, IfMissing::Skip, |state| {
        let ranks = state.ranks();
        match rank_value::learn(refusal, written.value, written.rank, state.first_rank, ranks) {
            Some(learned) if learned != state.learned => {
                state.learned = learned;
                Some(Change::Learned(learned, state.first_rank))
            }
            Some(_) => None,
            None => {
                let fewer = rank_value::fewer_ranks(refusal, ranks)?;
                state.keep_ranks(fewer);
                Some(Change::Fewer(fewer))
            }
        }
    });
    let Some(change) = changed else {
        return;
    };
    host.count(&PerWorker::RankRefused.of(&w.name), 1);
    let (learned, first_rank) = match change {
        Change::Learned(learned, first_rank) => (learned, first_rank),
        Change::Fewer(n) => {
            log::warn!(
                "{} refused rank value {}: it has {n} ranks now; its others are left out until its next poll",
                w.endpoint(),
                written.value
            );
            return;
        }
    };
    match learned {
        Learned::Numbering(n) => log::warn!(
            "{} refused rank value {} (its ranks start at {first_rank}): it reads {} rank values; writing those from now on. \
             Set \"rank_numbering\": \"{}\" on this worker to spare the first request",
            w.endpoint(),
            written.value,
            numbering_name(n),
            numbering_name(n)
        ),
        Learned::Unpinned => log::warn!(
            "{} refused rank value {} in a way neither numbering explains: no rank value is written for it until its layout changes (its own balancer picks)",
            w.endpoint(),
            written.value
        ),
        Learned::Nothing => {}
    }
}

/// What a refusal changed.
enum Change {
    Learned(Learned, u32),
    Fewer(usize),
}

fn numbering_name(n: crate::config::RankNumbering) -> &'static str {
    match n {
        crate::config::RankNumbering::Local => "local",
        crate::config::RankNumbering::Global => "global",
    }
}
