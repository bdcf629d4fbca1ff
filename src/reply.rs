//! Every answer dprank gives itself instead of forwarding the request: one
//! type, with an OpenAI-style JSON error body (the shape SGLang's own errors
//! have), so clients parse dprank's refusals like the server's. Routing's
//! answers are built here, admission's in `admission/refusal.rs`.

use crate::host::Host;
use crate::metrics::{self, HostCall};

const NOT_AN_OBJECT: &str = "request body must be a JSON object (dprank routes by its fields)";

/// The most of a prefill worker's answer quoted back to the client.
const DETAIL_BYTES: usize = 512;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u32,
    /// JSON: `{"error":{"message":...,"type":...,"code":"dprank"}}`.
    pub body: String,
    /// Headers besides `content-type`.
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    /// An answer of `status` with an error of type `kind` (admission's
    /// answers are built in `admission/refusal.rs`).
    pub(crate) fn error(status: u32, kind: &str, message: &str) -> Reply {
        let body = serde_json::json!({"error": {"message": message, "type": kind, "code": "dprank"}});
        Reply {
            status,
            body: body.to_string(),
            headers: Vec::new(),
        }
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
