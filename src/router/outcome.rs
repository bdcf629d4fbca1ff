//! What becomes of a request the router does not route: passed through
//! untouched (a [`PassReason`], counted as `passthrough.<reason>`), or
//! answered by dprank itself (a [`RejectReason`] with its [`Reply`],
//! counted as `rejected.<reason>`). The two are apart so that closed mode
//! refuses what open mode passes under the same name. Admission's refusals
//! are its own (`admission::Refusal`), counted the same way.

use super::Decision;
use crate::body::BodyError;
use crate::config::{Config, FailMode};
use crate::host::Host;
use crate::metrics;
use crate::reply::Reply;

/// Why a request went through untouched (also the suffix of its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    Method,
    Path,
    EmptyBody,
    Encoded,
    NotJson,
    NotObject,
    NoFreshData,
    /// A trusted client asked for a rank no fresh worker has.
    ClientRankUnavailable,
    /// Workers have fresh data, but none is in rotation (ejected by passive
    /// health, or unhealthy in Envoy).
    NoneInRotation,
    /// The proxy refused to hand over the request's headers or body.
    HostRefused,
}

impl PassReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PassReason::Method => "method",
            PassReason::Path => "path",
            PassReason::EmptyBody => "empty_body",
            PassReason::Encoded => "content_encoding",
            PassReason::NotJson => "not_json",
            PassReason::NotObject => "not_object",
            PassReason::NoFreshData => "no_fresh_data",
            PassReason::ClientRankUnavailable => "client_rank_unavailable",
            PassReason::NoneInRotation => "none_in_rotation",
            PassReason::HostRefused => "host_refused",
        }
    }

    /// What `fail_mode: closed` answers instead of passing the request on.
    fn refused_when_closed(self) -> Option<RejectReason> {
        match self {
            PassReason::NotJson => Some(RejectReason::NotJson),
            PassReason::NotObject => Some(RejectReason::NotObject),
            PassReason::ClientRankUnavailable => Some(RejectReason::ClientRankUnavailable),
            PassReason::NoFreshData => Some(RejectReason::NoFreshData),
            PassReason::NoneInRotation => Some(RejectReason::NoneInRotation),
            PassReason::HostRefused => Some(RejectReason::HostRefused),
            PassReason::Method | PassReason::Path | PassReason::EmptyBody | PassReason::Encoded => None,
        }
    }
}

impl From<BodyError> for PassReason {
    fn from(e: BodyError) -> PassReason {
        match e {
            BodyError::NotJson => PassReason::NotJson,
            BodyError::NotObject => PassReason::NotObject,
        }
    }
}

/// Why dprank answered a request itself (also the suffix of its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Not JSON to dprank, yet it names a rank a lenient server parser could
    /// honour: refused in every mode.
    UnreadableRank,
    NotJson,
    NotObject,
    ClientRankUnavailable,
    NoFreshData,
    NoneInRotation,
    /// Closed mode: the proxy refused to hand over the request's headers or body.
    HostRefused,
}

impl RejectReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::UnreadableRank => "unreadable_rank",
            RejectReason::NotJson => "not_json",
            RejectReason::NotObject => "not_object",
            RejectReason::ClientRankUnavailable => "client_rank_unavailable",
            RejectReason::NoFreshData => "no_fresh_data",
            RejectReason::NoneInRotation => "none_in_rotation",
            RejectReason::HostRefused => "host_refused",
        }
    }

    /// The answer the client gets.
    pub fn reply(self) -> Reply {
        match self {
            RejectReason::UnreadableRank => Reply::unreadable_rank(),
            RejectReason::NotJson | RejectReason::NotObject => Reply::not_an_object(),
            RejectReason::ClientRankUnavailable => Reply::client_rank_unavailable(),
            RejectReason::NoFreshData => Reply::no_fresh_data(),
            RejectReason::NoneInRotation => Reply::none_in_rotation(),
            RejectReason::HostRefused => Reply::host_refused(),
        }
    }
}

impl From<BodyError> for RejectReason {
    fn from(e: BodyError) -> RejectReason {
        match e {
            BodyError::NotJson => RejectReason::NotJson,
            BodyError::NotObject => RejectReason::NotObject,
        }
    }
}

/// Counts a request that is not routed for a reason seen before its body.
pub fn pass_early(host: &dyn Host, reason: PassReason) {
    host.count(&metrics::passthrough(reason.as_str()), 1);
}

/// Counts a pass-through and lets the request go on, with `body` (the
/// client's with its rank fields neutralised) if given.
pub(super) fn pass(host: &dyn Host, reason: PassReason, body: Option<Vec<u8>>) -> Decision {
    pass_early(host, reason);
    Decision::PassThrough { reason, body }
}

/// Counts a refusal and answers it with `reply`.
pub(super) fn reject(host: &dyn Host, reason: RejectReason, reply: Reply) -> Decision {
    host.count(&metrics::rejected(reason.as_str()), 1);
    Decision::Reject { reason, reply }
}

/// A request that cannot be routed: passed through, or, in closed mode,
/// refused when its reason has a refusal.
pub fn pass_or_reject(
    config: &Config,
    host: &dyn Host,
    reason: PassReason,
    body: Option<Vec<u8>>,
) -> Decision {
    match reason
        .refused_when_closed()
        .filter(|_| config.fail_mode == FailMode::Closed)
    {
        Some(refusal) => reject(host, refusal, refusal.reply()),
        None => pass(host, reason, body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::shared_data::testing::config;

    #[test]
    fn closed_mode_refuses_what_open_mode_passes_under_the_same_name() {
        let (open, closed) = (config(""), config(r#","fail_mode":"closed""#));
        let h = FakeHost::default();
        let passed = pass_or_reject(&open, &h, PassReason::NoneInRotation, Some(b"{}".to_vec()));
        assert_eq!(
            passed,
            Decision::PassThrough {
                reason: PassReason::NoneInRotation,
                body: Some(b"{}".to_vec())
            }
        );
        assert_eq!(h.counter("dprank.passthrough.none_in_rotation"), 1);
        let Decision::Reject { reason, reply } =
            pass_or_reject(&closed, &h, PassReason::NoneInRotation, None)
        else {
            panic!("closed mode refuses")
        };
        assert_eq!((reason, reply.status), (RejectReason::NoneInRotation, 503));
        assert_eq!(h.counter("dprank.rejected.none_in_rotation"), 1);
        for early in [
            PassReason::Method,
            PassReason::Path,
            PassReason::EmptyBody,
            PassReason::Encoded,
        ] {
            assert!(matches!(
                pass_or_reject(&closed, &h, early, None),
                Decision::PassThrough { .. }
            ));
        }
    }

    #[test]
    fn every_refusal_of_closed_mode_keeps_its_pass_through_name() {
        for reason in [
            PassReason::NotJson,
            PassReason::NotObject,
            PassReason::ClientRankUnavailable,
            PassReason::NoFreshData,
            PassReason::NoneInRotation,
            PassReason::HostRefused,
        ] {
            let refusal = reason.refused_when_closed().unwrap();
            assert_eq!(refusal.as_str(), reason.as_str());
            assert!(refusal.reply().status >= 400);
        }
        assert_eq!(RejectReason::UnreadableRank.reply(), Reply::unreadable_rank());
    }
}
