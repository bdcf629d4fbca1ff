//! What a routed request's rank delivered, as the gateway sees the answer
//! stream through it: the time from routing to the first response byte
//! (the rank's time to first token, at the proxy) and the mean gap between
//! the later body chunks, the last running to the stream's end (its time
//! per output token, where the server flushes a chunk per token, as SGLang
//! and vLLM do when streaming). Two clock reads and a header read per
//! streamed request; both are recorded per (worker, rank) as histograms
//! when it ends. docs/requests.md says what they mean and what they cost.

use crate::config::Config;
use crate::host::Host;
use crate::metrics;

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
    routed_at_ms: u64,
    /// Its headers showed a 2xx answer streamed as server-sent events.
    streamed: bool,
    first_byte_ms: Option<u64>,
    /// Body chunks after the first.
    later_chunks: u64,
}

impl Delivery {
    /// The request goes to `worker`'s rank `rank` (as the worker names it),
    /// routed at `routed_at_ms`.
    pub fn watch(&mut self, worker: usize, rank: u32, routed_at_ms: u64) {
        self.watched = Some(Watched {
            worker,
            rank,
            routed_at_ms,
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

    /// A chunk of the answer's body (`body_size` bytes).
    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize) {
        let Some(w) = &mut self.watched else { return };
        if !w.streamed || body_size == 0 {
            return;
        }
        if w.first_byte_ms.is_none() {
            w.first_byte_ms = Some(host.now_ms());
        } else {
            w.later_chunks += 1;
        }
    }

    /// The request is over (its stream ended, just after its last chunk):
    /// what its rank delivered is recorded, once. An answer that ended
    /// without a body byte tells nothing.
    pub fn on_done(&mut self, config: &Config, host: &dyn Host) {
        let Some(w) = self.watched.take() else { return };
        let (Some(first), Some(worker)) = (w.first_byte_ms, config.worker(w.worker)) else {
            return;
        };
        let name = worker.name.as_str();
        host.histogram(
            &metrics::delivered_ttft(name, w.rank),
            first.saturating_sub(w.routed_at_ms),
        );
        let end = host.now_ms();
        if let Some(gap) = end.saturating_sub(first).checked_div(w.later_chunks) {
            host.histogram(&metrics::delivered_chunk_gap(name, w.rank), gap);
        }
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
        d.watch(0, 5, 1_000);
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
        error.watch(0, 5, 1_000);
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
