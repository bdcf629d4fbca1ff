//! Why admission refused a request ([`Refusal`], also the suffix of its
//! `rejected.<reason>` counter) and the answer the client gets (the table
//! in docs/overload.md, "What a client sees").

use crate::reply::Reply;

/// The longest `retry-after` dprank sends (s).
pub const MAX_RETRY_AFTER_S: u64 = 300;

/// The response header naming why admission refused a request.
pub const ADMISSION_HEADER: &str = "x-dprank-admission";

/// Why admission answered a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Reject mode: every candidate is saturated.
    Saturated,
    /// A sheddable request while every candidate is saturated.
    Sheddable,
    /// Queue mode: saturated, and the queue is full of requests of this
    /// class or higher.
    QueueFull,
    /// Queue mode: a higher class took its place in a full queue.
    Displaced,
    /// Queue mode: no room came within `queue_timeout_ms`.
    QueueTimeout,
    /// Queue mode: the filter (its configuration) went away while the
    /// request waited.
    Draining,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Saturated => "saturated",
            Refusal::Sheddable => "sheddable",
            Refusal::QueueFull => "queue_full",
            Refusal::Displaced => "displaced",
            Refusal::QueueTimeout => "queue_timeout",
            Refusal::Draining => "draining",
        }
    }

    /// The answer, coming back after `retry_after_ms`: 429 for want of
    /// capacity now, with `x-envoy-ratelimited`; 503 when it waited in vain
    /// or the filter is going away, with `x-envoy-overloaded` (either stops
    /// Envoy's retry policies from retrying it). `retry-after` says when to
    /// come back, in whole seconds (at least 1).
    pub fn reply(self, retry_after_ms: u64) -> Reply {
        let (status, message) = match self {
            Refusal::Saturated => (
                429,
                "every rank is saturated: its expected wait is past the limit",
            ),
            Refusal::Sheddable => (
                429,
                "every rank is saturated and this request's class is sheddable",
            ),
            Refusal::QueueFull => (429, "every rank is saturated and the admission queue is full"),
            Refusal::Displaced => (
                429,
                "a request of a higher class took this one's place in the admission queue",
            ),
            Refusal::QueueTimeout => (503, "no rank had room before the admission queue's time-out"),
            Refusal::Draining => (
                503,
                "the filter's configuration was replaced while the request waited",
            ),
        };
        answer(status, self.as_str(), message, retry_after_ms)
    }
}

/// An overloaded answer of `status`, naming `reason`.
fn answer(status: u32, reason: &str, message: &str, retry_after_ms: u64) -> Reply {
    let seconds = retry_after_ms.div_ceil(1000).clamp(1, MAX_RETRY_AFTER_S);
    let envoy = match status {
        429 => ("x-envoy-ratelimited", "true".to_string()),
        _ => ("x-envoy-overloaded", "true".to_string()),
    };
    let mut reply = Reply::error(status, "overloaded", message);
    reply.headers = vec![
        ("retry-after", seconds.to_string()),
        (ADMISSION_HEADER, reason.to_string()),
        envoy,
    ];
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(r: &Reply) -> serde_json::Value {
        serde_json::from_str(&r.body).unwrap()
    }

    #[test]
    fn admission_refusals_say_why_and_when_to_come_back() {
        let r = Refusal::Saturated.reply(1200);
        assert_eq!(r.status, 429);
        assert_eq!(json(&r)["error"]["type"], "overloaded");
        assert_eq!(
            r.headers,
            vec![
                ("retry-after", "2".to_string()),
                (ADMISSION_HEADER, "saturated".to_string()),
                ("x-envoy-ratelimited", "true".to_string())
            ]
        );
        let t = Refusal::QueueTimeout.reply(0);
        assert_eq!(t.status, 503);
        assert_eq!(
            t.headers[0],
            ("retry-after", "1".to_string()),
            "at least a second"
        );
        assert_eq!(t.headers[1].1, "queue_timeout");
        assert_eq!(t.headers[2].0, "x-envoy-overloaded");
        let far = Refusal::Saturated.reply(u64::MAX);
        assert_eq!(far.headers[0].1, MAX_RETRY_AFTER_S.to_string());
        for r in [Refusal::Sheddable, Refusal::QueueFull, Refusal::Displaced] {
            assert_eq!(r.reply(0).status, 429, "{r:?}");
        }
        assert_eq!(Refusal::Draining.reply(0).status, 503);
    }
}
