//! The surface of the proxy that dprank's logic needs. `envoy_host.rs`
//! implements it with proxy-wasm host calls (the only file that makes them);
//! tests and offline evaluators implement it in memory (`memory`). Each
//! method is one host call, so counting calls on the in-memory host counts
//! them in Envoy too.

pub use crate::headers::HeaderMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedSetError {
    /// Someone else wrote the key since we read it.
    CasMismatch,
    /// The host refused for another reason.
    Failed,
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
    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes a shared-data key; with `cas`, only if nobody wrote it since.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError>;

    // Stats (names in `metrics.rs`).
    /// Adds to a counter stat.
    fn count(&self, metric: &str, delta: u64);
    /// Sets a gauge stat.
    fn gauge(&self, metric: &str, value: u64);
    /// Records a value in a histogram stat.
    fn histogram(&self, metric: &str, value: u64);

    // HTTP callouts.
    /// Dispatches an HTTP call; returns the call's token.
    fn http_call(&self, call: &Callout) -> Result<u32, String>;
    /// In a callout-response callback: the response's status (None: no response).
    fn callout_status(&self) -> Option<u32>;
    /// In a callout-response callback: the first `size` bytes of the response body.
    fn callout_body(&self, size: usize) -> Vec<u8>;

    // The current request (HTTP context callbacks only).
    /// Every request header in one call (empty when the host has none to give).
    fn request_headers(&self) -> HeaderMap;
    fn set_request_header(&self, name: &str, value: &str);
    fn remove_request_header(&self, name: &str);
    /// The first `size` bytes of the buffered request body.
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Replaces the first `old_size` bytes of the request body; false if refused.
    fn replace_request_body(&self, old_size: usize, body: &[u8]) -> bool;
    /// Answers the request locally instead of forwarding it (or its response).
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Lets a paused response continue.
    fn resume_response(&self);

    // Held requests (admission): another request of this thread.
    /// Makes the request (or root) `context_id` the one later calls act on;
    /// false if there is no such context (a request that ended).
    fn set_effective_context(&self, context_id: u32) -> bool;
    /// Lets the effective request, paused, continue to the upstream
    /// (Envoy does so once the current callback returns).
    fn resume_request(&self) -> bool;

    // Properties (Envoy's attributes).
    /// A property of the current request as Envoy serialises it (strings as
    /// is, integers as 8 little-endian bytes), e.g. `["response", "code"]`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
}

#[cfg(test)]
pub mod fake;
pub mod memory;
