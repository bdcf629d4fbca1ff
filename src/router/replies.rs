//! Every answer dprank gives itself instead of forwarding the request: one
//! type, with an OpenAI-style JSON error body (the shape SGLang's own errors
//! have), so clients parse dprank's refusals like the server's.

use crate::host::Host;
use crate::metrics::{self, HostCall};

const NOT_AN_OBJECT: &str = "request body must be a JSON object (dprank routes by its fields)";

/// The longest `retry-after` dprank sends (s).
pub const MAX_RETRY_AFTER_S: u64 = 300;

/// The most of a prefill worker's answer quoted back to the client.
const DETAIL_BYTES: usize = 512;

/// The response header naming why admission refused a request.
pub const ADMISSION_HEADER: &str = "x-dprank-admission";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    /// JSON: `{"error":{"message":...,"type":...,"code":"dprank"}}`.
    pub body: String,
    /// Headers besides `content-type`.
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    fn error(status: u32, kind: &str, message: &str) -> Reply {
        let body = serde_json::json!({"error": {"message": message, "type": kind, "code": "dprank"}});
        Reply {
            status,
            body: body.to_string(),
            headers: Vec::new(),
        }
    }

    /// Admission refused the request (`reason`, a `RejectReason` name):
    /// 429 for want of capacity now, with `x-envoy-ratelimited`; 503 when
    /// it waited in vain or the filter is going away, with
    /// `x-envoy-overloaded` (either stops Envoy's retry policies from
    /// retrying it). `retry-after` says when to come back, in whole
    /// seconds (at least 1).
    pub fn admission(status: u32, reason: &str, message: &str, retry_after_ms: u64) -> Reply {
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

    /// The body is not a JSON object (closed mode, or PD mode where the
    /// bootstrap fields cannot be written).
    pub fn not_an_object() -> Reply {
        Reply::error(400, "invalid_request_error", NOT_AN_OBJECT)
    }

    /// Unreadable to dprank, yet it names a rank a lenient parser could honour.
    pub fn unreadable_rank() -> Reply {
        Reply::error(
            400,
            "invalid_request_error",
            "request body is not strict JSON (RFC 8259) and names a rank field: dprank can neither read nor neutralise it",
        )
    }

    /// A trusted client asked for a rank no fresh worker has (closed mode).
    pub fn client_rank_unavailable() -> Reply {
        Reply::error(
            400,
            "invalid_request_error",
            "no worker with fresh load data has the requested rank",
        )
    }

    /// No worker has fresh load data (closed mode).
    pub fn no_fresh_data() -> Reply {
        Reply::error(503, "service_unavailable", "no worker has fresh load data")
    }

    /// Every worker with fresh load data is out of rotation (closed mode).
    pub fn none_in_rotation() -> Reply {
        Reply::error(
            503,
            "service_unavailable",
            "every worker with fresh load data is out of rotation (failing, or unhealthy in Envoy)",
        )
    }

    /// The prefill leg failed. The client's own mistakes (a 4xx) keep their
    /// status; anything else is a 502.
    pub fn prefill_failed(endpoint: &str, status: Option<u32>, body: &[u8]) -> Reply {
        let detail = String::from_utf8_lossy(body.get(..body.len().min(DETAIL_BYTES)).unwrap_or_default());
        let (status, message) = match status {
            Some(code) => (
                if (400..=499).contains(&code) { code } else { 502 },
                format!("prefill worker {endpoint} answered HTTP {code}: {detail}"),
            ),
            None => (
                502,
                format!("prefill worker {endpoint} did not answer (timeout or reset)"),
            ),
        };
        Reply::error(status, "prefill_failed", &message)
    }

    /// Closed mode: the proxy refused to hand over the request (its headers
    /// or body), so dprank could neither route nor check it.
    pub fn host_refused() -> Reply {
        Reply::error(
            503,
            "service_unavailable",
            "the proxy could not hand the request to dprank; try again",
        )
    }

    /// The prefill leg could not even be dispatched (Envoy refused the call).
    pub fn prefill_not_sent() -> Reply {
        Reply::error(
            502,
            "prefill_failed",
            "the prefill leg could not be dispatched (is the prefill cluster defined?)",
        )
    }

    /// Answers the request with this reply. A stream that is gone, or
    /// already answered, refuses it: dropped and counted.
    pub fn send(&self, host: &dyn Host) {
        let mut headers: Vec<(&str, &str)> = vec![("content-type", "application/json")];
        headers.extend(self.headers.iter().map(|(k, v)| (*k, v.as_str())));
        if let Err(e) = host.send_response(self.status, &headers, self.body.as_bytes()) {
            host.count(&metrics::host_refused(HostCall::LocalReply), 1);
            log::debug!("local reply {} not sent: {e}", self.status);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(r: &Reply) -> serde_json::Value {
        serde_json::from_str(&r.body).unwrap()
    }

    #[test]
    fn replies_are_openai_style_json_errors() {
        let r = Reply::no_fresh_data();
        assert_eq!(r.status, 503);
        assert_eq!(json(&r)["error"]["code"], "dprank");
        assert!(json(&r)["error"]["message"].as_str().unwrap().contains("fresh"));
        for r in [
            Reply::not_an_object(),
            Reply::unreadable_rank(),
            Reply::client_rank_unavailable(),
        ] {
            assert_eq!(
                (r.status, json(&r)["error"]["type"].as_str()),
                (400, Some("invalid_request_error"))
            );
        }
    }

    #[test]
    fn admission_refusals_say_why_and_when_to_come_back() {
        let r = Reply::admission(429, "saturated", "every rank is saturated", 1200);
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
        let t = Reply::admission(503, "queue_timeout", "waited", 0);
        assert_eq!(
            t.headers[0],
            ("retry-after", "1".to_string()),
            "at least a second"
        );
        assert_eq!(t.headers[2].0, "x-envoy-overloaded");
        let far = Reply::admission(429, "saturated", "", u64::MAX);
        assert_eq!(far.headers[0].1, MAX_RETRY_AFTER_S.to_string());
    }

    #[test]
    fn prefill_failures_keep_client_errors_and_quote_the_worker() {
        let r = Reply::prefill_failed("10.0.0.1:1", Some(500), b"internal");
        assert_eq!(r.status, 502);
        assert!(r.body.contains("500") && r.body.contains("internal"));
        assert_eq!(json(&r)["error"]["type"], "prefill_failed");
        assert_eq!(Reply::prefill_failed("e", Some(413), b"").status, 413);
        let silent = Reply::prefill_failed("e", None, b"");
        assert!(silent.status == 502 && silent.body.contains("did not answer"));
        let long = Reply::prefill_failed("e", Some(500), &[b'x'; 5000]);
        assert!(long.body.len() < 700, "the worker's answer is cut");
        assert_eq!(Reply::prefill_not_sent().status, 502);
    }
}
