//! Stage `admission`: whether a request is let in at all, decided after
//! `refresh` (on the fleet as the request sees it, and the clock) and
//! before anything is chosen, on every path (body mode, header mode, PD).
//! Today it admits everything; overload protection lands here. Its outcome
//! will gain a third kind, holding the request in a bounded queue until
//! room appears, beside admitting it and refusing it with a reply (a 429):
//! a refusal is a `RejectReason` of its own, counted `rejected.<reason>`.

use super::outcome::RejectReason;
use super::replies::Reply;
use super::snapshot::Snapshot;

/// What admission decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Go on and choose.
    Admit,
    /// Answered by dprank with this reply.
    #[allow(dead_code, reason = "no rule refuses yet: overload protection will")]
    Reject(RejectReason, Reply),
}

/// Stage `admission`: every request is admitted for now. `snapshot` holds
/// what a real rule reads: each pool's states and loads as refreshed, the
/// health record and the clock (the request's priority class, from its
/// headers, is to be added as an argument).
pub(crate) fn admit(snapshot: &Snapshot) -> Admission {
    let _ = snapshot;
    Admission::Admit
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::snapshot::refresh;
    use crate::shared_data::cache::StateCache;
    use crate::shared_data::testing::fleet;

    #[test]
    fn every_request_is_admitted_without_a_host_call() {
        let (c, h) = fleet("");
        let mut cache = StateCache::default();
        let snapshot = refresh(&c, &h, &mut cache, 0);
        let calls = h.total_host_calls();
        assert_eq!(admit(&snapshot), Admission::Admit);
        assert_eq!(h.total_host_calls(), calls);
    }
}
