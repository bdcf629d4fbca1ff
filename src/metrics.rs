//! Every counter and gauge dprank defines, named in one place. Envoy shows
//! them as `wasmcustom.<name>`; docs/requests.md ("Counters and gauges") lists what each counts.

// Counters without a worker.
/// Shared-data compare-and-swap retries ran out (another thread kept writing).
pub const SHARED_DATA_CONFLICTS: &str = "dprank.shared_data_conflicts";
/// A request was routed but its estimate could not be written.
pub const ACCOUNTING_SKIPPED: &str = "dprank.accounting_skipped";
/// The test pin header named no fresh candidate.
pub const PIN_IGNORED: &str = "dprank.pin_ignored";
/// PD mode: no prefill worker had fresh data (the prefill workers rotate).
pub const NO_FRESH_PREFILL_DATA: &str = "dprank.passthrough.no_fresh_data_prefill";
pub const MEMBERSHIP_CHANGES: &str = "dprank.membership_changes";
pub const MEMBERSHIP_FAILED: &str = "dprank.membership_failed";
/// The admin API could not tell the host health of `envoy_health`'s cluster.
pub const ENVOY_HEALTH_FAILED: &str = "dprank.envoy_health_failed";
/// A routed request had no alternate with its rank: a retry goes to the
/// cluster's fallback policy, with a rank the host it picks may lack.
pub const NO_ALTERNATE: &str = "dprank.retry.no_alternate";
/// A request's last attempt went to an alternate dprank listed.
pub const RETRIED_TO_ALTERNATE: &str = "dprank.retry.to_alternate";
/// A request's last attempt went to a host the fallback policy picked
/// (every listed host failed).
pub const RETRIED_TO_FALLBACK: &str = "dprank.retry.to_fallback";

/// Admission had no fresh data to judge a request by: admitted (fail open).
pub const ADMISSION_NO_DATA: &str = "dprank.admission.no_data";

// Gauges without a worker.
/// Bytes dprank keeps in shared data.
pub const SHARED_DATA_BYTES: &str = "dprank.shared_data_bytes";
/// Admission: candidate ranks whose expected wait is past `max_wait_ms`.
pub const ADMISSION_SATURATED_RANKS: &str = "dprank.admission.saturated_ranks";
/// Admission: requests held, over every thread of this Envoy.
pub const ADMISSION_HELD: &str = "dprank.admission.held";

// Histograms.
/// Admission: how long each held request waited (ms), whatever its end.
pub const ADMISSION_QUEUE_WAIT_MS: &str = "dprank.admission.queue_wait_ms";

/// What admission did with a request, per class (`config::Admission::classes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionEvent {
    /// Let in, at once or after waiting.
    Admitted,
    /// Held to wait for room.
    Queued,
    /// The client went away while it was held.
    ClientGone,
}

/// `dprank.admission.<event>.<class>`.
pub fn admission(event: AdmissionEvent, class: &str) -> String {
    let event = match event {
        AdmissionEvent::Admitted => "admitted",
        AdmissionEvent::Queued => "queued",
        AdmissionEvent::ClientGone => "client_gone",
    };
    format!("dprank.admission.{event}.{class}")
}

/// `dprank.admission.rejected.<reason>.<class>`: a refusal by admission.
pub fn admission_rejected(reason: &str, class: &str) -> String {
    format!("dprank.admission.rejected.{reason}.{class}")
}

/// A host call the proxy refused whose caller carried on without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCall {
    /// A local reply, on a stream gone or already answered: dropped.
    LocalReply,
    /// Resuming a held request whose stream is gone: dropped.
    ResumeRequest,
    /// Resuming a response held for PD's prefill leg: dropped.
    ResumeResponse,
    /// Acting on a held request whose context is gone: it left the queue.
    EffectiveContext,
    /// A request header set or removed: the request goes on without it.
    SetHeader,
    /// The rewritten body: the request goes on with the client's.
    ReplaceBody,
}

/// `dprank.host_refused.<call>`.
pub fn host_refused(call: HostCall) -> String {
    let call = match call {
        HostCall::LocalReply => "local_reply",
        HostCall::ResumeRequest => "resume_request",
        HostCall::ResumeResponse => "resume_response",
        HostCall::EffectiveContext => "effective_context",
        HostCall::SetHeader => "set_header",
        HostCall::ReplaceBody => "replace_body",
    };
    format!("dprank.host_refused.{call}")
}

/// A request not routed, by reason (`PassReason::as_str`).
pub fn passthrough(reason: &str) -> String {
    format!("dprank.passthrough.{reason}")
}

/// A request answered by dprank itself, by reason.
pub fn rejected(reason: &str) -> String {
    format!("dprank.rejected.{reason}")
}

/// A request routed to this (worker, rank).
pub fn routed(worker: &str, rank: u32) -> String {
    format!("dprank.routed.{worker}.rank_{rank}")
}

/// Histogram: ms from routing to the first byte of a streamed answer from
/// this (worker, rank) (its time to first token, at the gateway).
pub fn delivered_ttft(worker: &str, rank: u32) -> String {
    format!("dprank.delivered.ttft_ms.{worker}.rank_{rank}")
}

/// Histogram: a streamed answer's mean ms between body chunks after its
/// first, from this (worker, rank) (its time per output token, at the
/// gateway).
pub fn delivered_chunk_gap(worker: &str, rank: u32) -> String {
    format!("dprank.delivered.chunk_gap_ms.{worker}.rank_{rank}")
}

/// Gauge: the last polled tokens of this (worker, rank).
pub fn tokens(worker: &str, rank: usize) -> String {
    format!("dprank.tokens.{worker}.rank_{rank}")
}

/// Per-worker counters and gauges: `dprank.<kind>.<worker>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PerWorker {
    PollOk,
    PollFailed,
    /// The previous poll was still outstanding.
    PollSkipped,
    /// The report's rank count differs from the configured `dp_size`.
    DpSizeMismatch,
    PrefillOk,
    PrefillFailed,
    /// Gauge: age of the worker's snapshot.
    SnapshotAgeMs,
    /// Prefix affinity: ranks whose index lost entries because they
    /// reported far fewer cache hits than it expected.
    PrefixForgotten,
    /// A load report whose ranks are not one run S..S+N-1 was refused.
    ReportRefused,
    /// The worker's reports name its ranks from another first rank than before.
    RanksRenumbered,
    /// The worker answered 400 to a rank value, and dprank adapted: the
    /// numbering it reads, its fewer ranks, or no rank value for it.
    RankRefused,
    /// Failures passive health counted (5xx, resets, failed connections).
    Failures,
    /// Passive health took the worker out of rotation.
    Ejections,
    /// Passive health took one of the worker's ranks out of rotation.
    RankEjections,
    /// Gauge: 0 in rotation, 1 probing, 2 ejected, 3 unhealthy in Envoy.
    Health,
}

impl PerWorker {
    pub fn of(self, worker: &str) -> String {
        let kind = match self {
            PerWorker::PollOk => "poll_ok",
            PerWorker::PollFailed => "poll_failed",
            PerWorker::PollSkipped => "poll_skipped",
            PerWorker::DpSizeMismatch => "dp_size_mismatch",
            PerWorker::PrefillOk => "prefill_ok",
            PerWorker::PrefillFailed => "prefill_failed",
            PerWorker::SnapshotAgeMs => "snapshot_age_ms",
            PerWorker::PrefixForgotten => "prefix_forgotten",
            PerWorker::ReportRefused => "report_refused",
            PerWorker::RanksRenumbered => "ranks_renumbered",
            PerWorker::RankRefused => "rank_refused",
            PerWorker::Failures => "failures",
            PerWorker::Ejections => "ejections",
            PerWorker::RankEjections => "rank_ejections",
            PerWorker::Health => "health",
        };
        format!("dprank.{kind}.{worker}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_documented_pattern() {
        assert_eq!(routed("a", 3), "dprank.routed.a.rank_3");
        assert_eq!(tokens("a", 0), "dprank.tokens.a.rank_0");
        assert_eq!(passthrough("not_json"), "dprank.passthrough.not_json");
        assert_eq!(rejected("not_json"), "dprank.rejected.not_json");
        assert_eq!(PerWorker::PrefillFailed.of("p0"), "dprank.prefill_failed.p0");
        assert_eq!(PerWorker::SnapshotAgeMs.of("w"), "dprank.snapshot_age_ms.w");
        assert_eq!(PerWorker::RankEjections.of("w"), "dprank.rank_ejections.w");
        assert_eq!(PerWorker::Health.of("w"), "dprank.health.w");
        assert_eq!(
            admission(AdmissionEvent::Queued, "standard"),
            "dprank.admission.queued.standard"
        );
        assert_eq!(
            admission_rejected("saturated", "sheddable"),
            "dprank.admission.rejected.saturated.sheddable"
        );
    }
}
