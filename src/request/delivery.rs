//! What a routed request's rank delivered, as the gateway sees the answer
//! stream through it: the time from routing to the first response byte
//! (the rank's time to first token, at the proxy) and the mean gap between
//! the later body chunks, the last running to the stream's end (its time
//! per output token, where the server flushes a chunk per token, as SGLang
//! and vLLM do when streaming). Two clock reads and a header read per
//! streamed request; both are recorded per (worker, rank) as histograms
//! when it ends, and, with SLO admission, handed to it as observations of
//! the rank ([`Observation`]; `write_delivered` writes them at the tick).
//! docs/requests.md says what they mean and what they cost.

use super::routing::{Delivered, Routing, MAX_DELIVERED};
use crate::config::Config;
use crate::host::Host;
use crate::metrics;
use crate::worker_state::slo::Observation;
use std::collections::BTreeMap;
use std::rc::Rc;

/// The watch on one request's answer.
#[derive(Debug, Default)]
pub(super) struct Delivery {
    watched: Option<Watched>,
}

#[derive(Debug)]
struct Watched {
    /// Index in `Config::all_workers`.
    worker: usize,
    /// The rank as the worker names it (its first rank plus the index).
    rank: u32,
    /// The rank's index in the worker's state.
    rank_index: usize,
    routed_at_ms: u64,
    /// SLO admission: the rank's queue when the request was routed.
    at_routing: Option<AtRouting>,
    /// Its headers showed a 2xx answer streamed as server-sent events.
    streamed: bool,
    first_byte_ms: Option<u64>,
    /// Body chunks after the first.
    later_chunks: u64,
}

/// What SLO admission predicted of the rank a request was routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AtRouting {
    /// Its expected wait, the request's own prompt in the queue (ms).
    pub predicted_wait_ms: u64,
    /// Requests on the worker's ranks, the request included, if their
    /// reports count them.
    pub in_flight: Option<u64>,
}

/// A rank's observation: the worker's index, the rank's, what was seen.
pub(super) type Seen = (usize, usize, Observation);

impl Delivery {
    /// The request goes to `worker`'s rank of index `rank_index`, which the
    /// worker names `rank`, routed at `routed_at_ms`; `at_routing` with
    /// SLO admission.
    pub fn watch(
        &mut self,
        worker: usize,
        (rank_index, rank): (usize, u32),
        routed_at_ms: u64,
        at_routing: Option<AtRouting>,
    ) {
        self.watched = Some(Watched {
            worker,
            rank,
            rank_index,
            routed_at_ms,
            at_routing,
            streamed: false,
            first_byte_ms: None,
            later_chunks: 0,
        });
    }

    /// Whether the answer's headers are to be read (`status`, and then its
    /// content type).
    pub fn wants_headers(&self) -> bool {
        self.watched.as_ref().is_some_and(|w| !w.streamed)
    }

    /// The answer's headers: only a 2xx stream of server-sent events is
    /// timed (a whole JSON answer's first byte is its last token).
    pub fn on_response_headers(&mut self, host: &dyn Host, status: Option<u32>) {
        let Some(w) = &mut self.watched else { return };
        let streamed = matches!(status, Some(200..=299))
            && host
                .response_header("content-type")
                .ok()
                .flatten()
                .is_some_and(|t| t.starts_with(b"text/event-stream"));
        if streamed {
            w.streamed = true;
        } else {
            self.watched = None;
        }
    }

    /// A chunk of the answer's body (`body_size` bytes); the first one is
    /// SLO admission's observation of the rank's first token.
    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize) -> Option<Seen> {
        let w = self.watched.as_mut()?;
        if !w.streamed || body_size == 0 {
            return None;
        }
        if w.first_byte_ms.is_some() {
            w.later_chunks += 1;
            return None;
        }
        let now = host.now_ms();
        w.first_byte_ms = Some(now);
        let at = w.at_routing?;
        let first = Observation::FirstToken {
            ttft_ms: now.saturating_sub(w.routed_at_ms),
            predicted_wait_ms: at.predicted_wait_ms,
        };
        Some((w.worker, w.rank_index, first))
    }

    /// The request is over (its stream ended, just after its last chunk):
    /// what its rank delivered is recorded, once, and is SLO admission's
    /// observation of its decode. An answer that ended without a body byte
    /// tells nothing.
    pub fn on_done(&mut self, config: &Config, host: &dyn Host) -> Option<Seen> {
        let w = self.watched.take()?;
        let (Some(first), Some(worker)) = (w.first_byte_ms, config.worker(w.worker)) else {
            return None;
        };
        let name = worker.name.as_str();
        host.histogram(
            &metrics::delivered_ttft(name, w.rank),
            first.saturating_sub(w.routed_at_ms),
        );
        let end = host.now_ms();
        let gap = end.saturating_sub(first).checked_div(w.later_chunks)?;
        host.histogram(&metrics::delivered_chunk_gap(name, w.rank), gap);
        let at = w.at_routing?;
        let decoded = Observation::Decoded {
            tpot_ms: gap,
            in_flight: at.in_flight,
        };
        Some((w.worker, w.rank_index, decoded))
    }
}

/// Keeps `seen`, by a request routed under `config`, for the next tick
/// (dropped past [`MAX_DELIVERED`]: the tick is late, and the next
/// answers will tell as much).
pub(super) fn keep(routing: &Routing, config: &Rc<Config>, seen: Option<Seen>) {
    let Some((worker, rank, observation)) = seen else {
        return;
    };
    let mut delivered = routing.delivered.borrow_mut();
    if delivered.len() < MAX_DELIVERED {
        delivered.push(Delivered {
            config: config.clone(),
            worker,
            rank,
            observation,
        });
    }
}

/// This thread's tick: what answers showed since the last one goes into
/// the workers' shared states, one write per worker.
pub(super) fn write_delivered(routing: &Routing, host: &dyn Host) {
    let delivered = std::mem::take(&mut *routing.delivered.borrow_mut());
    let mut by_worker: BTreeMap<(*const Config, usize), Vec<Delivered>> = BTreeMap::new();
    for d in delivered {
        by_worker
            .entry((Rc::as_ptr(&d.config), d.worker))
            .or_default()
            .push(d);
    }
    let now = host.now_ms();
    let mut states = routing.states.borrow_mut();
    for ((_, worker), seen) in by_worker {
        let Some(config) = seen.first().map(|d| d.config.clone()) else {
            continue;
        };
        let Some(targets) = config.admission.as_ref().and_then(|a| a.slo) else {
            continue;
        };
        states.write_as_routed(&config, host, worker, |state| {
            for d in &seen {
                state.slo.observe(d.rank, &d.observation, &targets, now);
            }
            Some(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::memory::MemoryHost;

    /// Worker 0 is named `a`.
    fn config() -> Config {
        Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1","name":"a"}]}"#).unwrap()
    }

    fn streamed(host: &MemoryHost, content_type: &str) -> Delivery {
        let mut d = Delivery::default();
        d.watch(0, (5, 5), 1_000, None);
        assert!(d.wants_headers());
        host.response_headers
            .replace(vec![("content-type".into(), content_type.into())]);
        d.on_response_headers(host, Some(200));
        d
    }

    #[test]
    fn a_streamed_answer_records_its_first_byte_and_the_mean_gap_after_it() {
        let host = MemoryHost::default();
        let mut d = streamed(&host, "text/event-stream; charset=utf-8");
        for (at, size) in [(1_250, 40), (1_280, 0), (1_290, 30), (1_330, 30), (1_365, 12)] {
            host.now.set(at);
            d.on_response_body(&host, size);
        }
        host.now.set(1_370);
        d.on_done(&config(), &host);
        assert_eq!(host.histogram_values("dprank.delivered.ttft_ms.a.rank_5"), [250]);
        assert_eq!(
            host.histogram_values("dprank.delivered.chunk_gap_ms.a.rank_5"),
            [40],
            "three chunks after the first over 120 ms to the end; an empty one is none"
        );
        d.on_done(&config(), &host);
        assert_eq!(
            host.histogram_values("dprank.delivered.ttft_ms.a.rank_5").len(),
            1,
            "once"
        );
    }

    #[test]
    fn whole_answers_errors_and_answers_without_a_body_are_not_timed() {
        let host = MemoryHost::default();
        let mut json = streamed(&host, "application/json");
        host.now.set(1_400);
        json.on_response_body(&host, 100);
        json.on_done(&config(), &host);

        let mut error = Delivery::default();
        error.watch(0, (5, 5), 1_000, None);
        error.on_response_headers(&host, Some(503));
        error.on_response_body(&host, 10);
        error.on_done(&config(), &host);

        let mut empty = streamed(&MemoryHost::default(), "text/event-stream");
        empty.on_done(&config(), &host);

        let mut one_chunk = streamed(&host, "text/event-stream");
        host.now.set(1_300);
        one_chunk.on_response_body(&host, 10);
        one_chunk.on_done(&config(), &host);
        assert_eq!(host.histogram_values("dprank.delivered.ttft_ms.a.rank_5"), [300]);
        assert!(host
            .histogram_values("dprank.delivered.chunk_gap_ms.a.rank_5")
            .is_empty());
    }
}
