//! The surface of the proxy that dprank's logic needs. `envoy_host.rs`
//! implements it with proxy-wasm host calls (the only file that makes them);
//! tests and offline evaluators implement it in memory (`memory`). Each
//! method is one host call, so counting calls on the in-memory host counts
//! them in Envoy too.

pub use crate::headers::HeaderMap;

/// A host call the proxy refused, by the proxy-wasm status it returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostError(pub u32);

impl HostError {
    pub const NOT_FOUND: HostError = HostError(1);
    pub const BAD_ARGUMENT: HostError = HostError(2);
    pub const CAS_MISMATCH: HostError = HostError(8);
    pub const INTERNAL_FAILURE: HostError = HostError(10);

    /// The status's name in the proxy-wasm ABI.
    pub fn name(self) -> &'static str {
        match self.0 {
            0 => "Ok",
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            5 => "BadExpression",
            6 => "InvalidMemoryAccess",
            7 => "Empty",
            8 => "CasMismatch",
            9 => "ResultMismatch",
            10 => "InternalFailure",
            11 => "BrokenConnection",
            12 => "Unimplemented",
            _ => "unknown status",
        }
    }
}

impl std::fmt::Display for HostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the proxy answered {} ({})", self.name(), self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedSetError {
    /// Someone else wrote the key since we read it.
    CasMismatch,
    /// The host refused for another reason.
    Failed(HostError),
}

/// A callout's answer, read whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutResponse {
    pub status: u32,
    pub body: Vec<u8>,
}

/// Why a callout brought no answer to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalloutError {
    /// The call ended without an answer: the connection was refused or
    /// reset, the answer was cut short, or it went past Envoy's buffer limit.
    NoResponse,
    /// The answer has no `:status` that is a number.
    NoStatus,
    /// The proxy refused to hand over part of the answer.
    Unreadable(&'static str, HostError),
}

impl std::fmt::Display for CalloutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CalloutError::NoResponse => {
                write!(
                    f,
                    "no answer (connection refused or reset, answer cut short or too large)"
                )
            }
            CalloutError::NoStatus => write!(f, "an answer without a status"),
            CalloutError::Unreadable(part, e) => write!(f, "the answer's {part} could not be read: {e}"),
        }
    }
}

/// An HTTP call dispatched through one of Envoy's clusters.
#[derive(Debug, Clone, Copy)]
pub struct Callout<'a> {
    pub cluster: &'a str,
    /// Pseudo-headers (`:method`, `:path`, `:authority`) included.
    pub headers: &'a [(&'a str, &'a str)],
    pub body: Option<&'a [u8]>,
    pub timeout_ms: u64,
}

pub trait Host {
    // Time and randomness.
    /// Wall-clock time, ms since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// A random number (bootstrap rooms).
    fn random_u64(&self) -> u64;

    // Shared data (one map per VM id, visible from every thread).
    /// Value and compare-and-swap token of a shared-data key, if present.
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError>;
    /// Writes a shared-data key; with `cas`, only if nobody wrote it since.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError>;

    // Stats (names in `metrics.rs`): best effort, a stat the host refuses is left out.
    /// Adds to a counter stat.
    fn count(&self, metric: &str, delta: u64);
    /// Sets a gauge stat.
    fn gauge(&self, metric: &str, value: u64);
    /// Records a value in a histogram stat.
    fn histogram(&self, metric: &str, value: u64);

    // HTTP callouts.
    /// Dispatches an HTTP call; returns the call's token. BadArgument: no
    /// such cluster (or a header missing).
    fn http_call(&self, call: &Callout) -> Result<u32, HostError>;
    /// In a callout-response callback: the answer, as the callback's counts
    /// of `headers` and body bytes announce it.
    fn callout_response(&self, headers: usize, body_size: usize) -> Result<CalloutResponse, CalloutError>;

    // The current request (HTTP context callbacks only).
    /// Every request header in one call.
    fn request_headers(&self) -> Result<HeaderMap, HostError>;
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError>;
    fn remove_request_header(&self, name: &str) -> Result<(), HostError>;
    /// The first `size` bytes of the buffered request body.
    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError>;
    /// Replaces the first `old_size` bytes of the request body.
    fn replace_request_body(&self, old_size: usize, body: &[u8]) -> Result<(), HostError>;
    /// Answers the request locally instead of forwarding it (or its
    /// response); refused for a stream that is gone or already answered.
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError>;
    /// Lets a paused response continue.
    fn resume_response(&self) -> Result<(), HostError>;
    /// In a response callback: the response's status (None: none yet).
    fn response_status(&self) -> Result<Option<u32>, HostError>;
    /// In a response callback: a response header's value (lowercase name).
    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    /// In a response-body callback: the first `size` bytes of the body chunk.
    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError>;

    // Held requests (admission): another request of this thread.
    /// Makes the request (or root) `context_id` the one later calls act on;
    /// refused if there is no such context (a request that ended).
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError>;
    /// Lets the effective request, paused, continue to the upstream
    /// (Envoy does so once the current callback returns).
    fn resume_request(&self) -> Result<(), HostError>;

    // Properties (Envoy's attributes).
    /// A property of the current request as Envoy serialises it (strings as
    /// is, integers as 8 little-endian bytes), e.g. `["response", "code"]`.
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError>;
}

#[cfg(test)]
pub mod fake;
pub mod memory;
