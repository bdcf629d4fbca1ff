//! An in-memory host: Envoy's shared-data semantics (cas bumps on every
//! write), a request with headers and a body, recorded stats, callouts and
//! local replies, and a count of every host call by kind. Unit tests use it
//! (as `fake::FakeHost`), and so do offline evaluators that run dprank's
//! request lifecycle and poller without Envoy. Several hosts made with one
//! [`SharedData`] stand for the VMs (threads) of one Envoy: they see each
//! other's shared data and nothing else, also from different OS threads.

use super::*;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Every key's value and cas, and the next cas to hand out.
#[derive(Debug, Default)]
struct Values {
    map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    /// Successful writes per key, for tests (a cas no longer counts them).
    writes: HashMap<String, u32>,
}

/// Shared data of one VM id.
#[derive(Debug, Clone, Default)]
pub struct SharedData(Arc<Mutex<Values>>);

impl SharedData {
    fn values(&self) -> MutexGuard<'_, Values> {
        // A thread that panicked holding the lock left the map whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Value and cas of a key; an empty value reads as absent, as it does
    /// through the proxy-wasm SDK in Envoy.
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.values()
            .map
            .get(key)
            .filter(|(value, _)| !value.is_empty())
            .cloned()
    }

    /// Writes a key, only if its cas is still `cas` when one other than 0 is
    /// given and the key exists, as Envoy does (proxy-wasm-cpp-host
    /// `SharedData::set`): a missing key is written whatever the cas, and
    /// every write takes the next cas of one counter over all keys, so a
    /// write's new cas cannot be guessed from the old one.
    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        let mut values = self.values();
        let current = values.map.get(key).map(|(_, c)| *c);
        if let (Some(current), Some(cas)) = (current, cas.filter(|&c| c != 0)) {
            if cas != current {
                return Err(SharedSetError::CasMismatch);
            }
        }
        values.next_cas = values.next_cas.wrapping_add(1).max(1);
        let next = values.next_cas;
        values.map.insert(key.to_string(), (value.to_vec(), next));
        *values.writes.entry(key.to_string()).or_default() += 1;
        Ok(())
    }

    /// How many times a key was written.
    pub fn writes(&self, key: &str) -> u32 {
        self.values().writes.get(key).copied().unwrap_or(0)
    }

    /// Every key, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.values().map.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Bytes of every value.
    pub fn bytes(&self) -> u64 {
        self.values().map.values().map(|(b, _)| b.len() as u64).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.values().map.is_empty()
    }
}

/// A dispatched call: cluster, headers, token.
pub type Call = (String, Vec<(String, String)>, u32);

/// A local reply: status, headers, body.
pub type Reply = (u32, Vec<(String, String)>, Vec<u8>);

/// A request context other than the effective one: its headers and body.
#[derive(Debug, Default)]
struct Parked {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

#[derive(Default)]
pub struct MemoryHost {
    pub now: Cell<u64>,
    pub shared: SharedData,
    pub counters: RefCell<HashMap<String, u64>>,
    pub gauges: RefCell<HashMap<String, u64>>,
    pub calls: RefCell<Vec<Call>>,
    pub next_token: Cell<u32>,
    /// Writes that fail with CasMismatch before succeeding (simulates another thread).
    pub conflicts: Cell<usize>,
    pub random: Cell<u64>,
    /// Bodies of dispatched calls, in order.
    pub bodies: RefCell<Vec<Option<Vec<u8>>>>,
    /// Every callout is refused (as Envoy does for an undefined cluster).
    pub refuse_calls: Cell<bool>,
    /// The current request's headers, lowercase names, in order.
    pub request_headers: RefCell<Vec<(String, String)>>,
    pub request_body: RefCell<Vec<u8>>,
    /// The callout response being delivered: status (None: no response) and body.
    pub callout: RefCell<(Option<u32>, Vec<u8>)>,
    /// Host calls that fail, by `Host` method name, with the status the
    /// proxy would return (a stream gone, a callout's headers after a reset).
    pub refusals: RefCell<HashMap<&'static str, HostError>>,
    pub replies: RefCell<Vec<Reply>>,
    /// How often a paused response was resumed.
    pub resumed: Cell<u32>,
    /// The response being delivered: its status and body chunk.
    pub response: RefCell<(Option<u32>, Vec<u8>)>,
    /// The response's headers (other than `:status`), lowercase names.
    pub response_headers: RefCell<Vec<(String, String)>>,
    /// Properties by dotted path (`response.code`), as Envoy serialises them.
    pub properties: RefCell<HashMap<String, Vec<u8>>>,
    /// Histogram values recorded, by name.
    pub histograms: RefCell<HashMap<String, Vec<u64>>>,
    /// The effective context: the request `request_headers` and
    /// `request_body` belong to (0 until `start_request_as`).
    pub context: Cell<u32>,
    /// The context of each entry of `replies`, in order.
    pub reply_contexts: RefCell<Vec<u32>>,
    /// Contexts resumed by `resume_request`, in order.
    pub resumed_contexts: RefCell<Vec<u32>>,
    /// Other live contexts (`start_request_as`), keyed by id.
    parked: RefCell<HashMap<u32, Parked>>,
    /// Host calls made, by `Host` method name.
    host_calls: RefCell<HashMap<&'static str, u64>>,
}

impl MemoryHost {
    /// A host sharing `shared` with others (another thread of the same Envoy).
    pub fn with_shared(shared: SharedData) -> MemoryHost {
        MemoryHost {
            shared,
            ..MemoryHost::default()
        }
    }

    pub fn counter(&self, name: &str) -> u64 {
        self.counters.borrow().get(name).copied().unwrap_or(0)
    }
    pub fn gauge_value(&self, name: &str) -> Option<u64> {
        self.gauges.borrow().get(name).copied()
    }
    /// Host calls of one kind (a `Host` method name) made so far.
    pub fn host_calls(&self, kind: &str) -> u64 {
        self.host_calls.borrow().get(kind).copied().unwrap_or(0)
    }
    /// Every host call made so far.
    pub fn total_host_calls(&self) -> u64 {
        self.host_calls.borrow().values().sum()
    }
    /// A request header as the upstream would see it now.
    pub fn header(&self, name: &str) -> Option<String> {
        self.request_headers
            .borrow()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
    /// Starts a new request with these headers and body.
    pub fn start_request(&self, headers: &[(&str, &str)], body: &[u8]) {
        *self.request_headers.borrow_mut() = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        *self.request_body.borrow_mut() = body.to_vec();
    }
    /// Starts request context `id` (effective from now) with these headers
    /// and body; the previous effective context is kept for
    /// `set_effective_context`.
    pub fn start_request_as(&self, id: u32, headers: &[(&str, &str)], body: &[u8]) {
        self.park();
        self.context.set(id);
        self.start_request(headers, body);
    }
    /// Request context `id` is over: `set_effective_context` fails for it.
    pub fn end_context(&self, id: u32) {
        self.parked.borrow_mut().remove(&id);
        if self.context.get() == id {
            self.request_headers.borrow_mut().clear();
            self.request_body.borrow_mut().clear();
            self.context.set(0);
        }
    }
    /// Keeps the effective context's request aside.
    fn park(&self) {
        let id = self.context.get();
        if id != 0 {
            let parked = Parked {
                headers: std::mem::take(&mut *self.request_headers.borrow_mut()),
                body: std::mem::take(&mut *self.request_body.borrow_mut()),
            };
            self.parked.borrow_mut().insert(id, parked);
        }
    }
    /// Values recorded in a histogram.
    pub fn histogram_values(&self, name: &str) -> Vec<u64> {
        self.histograms.borrow().get(name).cloned().unwrap_or_default()
    }
    /// Sets the properties Envoy has when a request ends: status, code
    /// details, the last attempt's host and the number of attempts.
    pub fn finish_request(&self, code: u64, details: &str, upstream: Option<&str>, attempts: u64) {
        let mut p = self.properties.borrow_mut();
        p.clear();
        p.insert("response.code".into(), code.to_le_bytes().to_vec());
        p.insert("response.code_details".into(), details.as_bytes().to_vec());
        if let Some(u) = upstream {
            p.insert("upstream.address".into(), u.as_bytes().to_vec());
        }
        p.insert(
            "upstream.request_attempt_count".into(),
            attempts.to_le_bytes().to_vec(),
        );
    }
    /// Makes every later call of `kind` (a `Host` method name) fail with `error`.
    pub fn refuse(&self, kind: &'static str, error: HostError) {
        self.refusals.borrow_mut().insert(kind, error);
    }
    /// Counts a host call of `kind`; the error it is set to fail with, if any.
    fn record(&self, kind: &'static str) -> Result<(), HostError> {
        *self.host_calls.borrow_mut().entry(kind).or_default() += 1;
        match self.refusals.borrow().get(kind) {
            Some(e) => Err(*e),
            None => Ok(()),
        }
    }
}

impl Host for MemoryHost {
    fn now_ms(&self) -> u64 {
        let _ = self.record("now_ms");
        self.now.get()
    }
    fn random_u64(&self) -> u64 {
        let _ = self.record("random_u64");
        let n = self.random.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.random.set(n);
        n
    }
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.record("shared_get")?;
        Ok(self.shared.get(key))
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        self.record("shared_set").map_err(SharedSetError::Failed)?;
        if self.conflicts.get() > 0 {
            self.conflicts.set(self.conflicts.get() - 1);
            return Err(SharedSetError::CasMismatch);
        }
        self.shared.set(key, value, cas)
    }
    fn count(&self, metric: &str, delta: u64) {
        let _ = self.record("count");
        *self.counters.borrow_mut().entry(metric.to_string()).or_default() += delta;
    }
    fn gauge(&self, metric: &str, value: u64) {
        let _ = self.record("gauge");
        self.gauges.borrow_mut().insert(metric.to_string(), value);
    }
    fn histogram(&self, metric: &str, value: u64) {
        let _ = self.record("histogram");
        self.histograms
            .borrow_mut()
            .entry(metric.to_string())
            .or_default()
            .push(value);
    }
    fn http_call(&self, call: &Callout) -> Result<u32, HostError> {
        self.record("http_call")?;
        if self.refuse_calls.get() {
            return Err(HostError::BAD_ARGUMENT);
        }
        self.bodies.borrow_mut().push(call.body.map(|b| b.to_vec()));
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        let headers = call
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.calls
            .borrow_mut()
            .push((call.cluster.to_string(), headers, token));
        Ok(token)
    }
    fn callout_response(&self, headers: usize, body_size: usize) -> Result<CalloutResponse, CalloutError> {
        self.record("callout_response")
            .map_err(|e| CalloutError::Unreadable("headers", e))?;
        let (status, body) = &*self.callout.borrow();
        let status = match (headers, status) {
            (0, _) | (_, None) => return Err(CalloutError::NoResponse),
            (_, Some(status)) => *status,
        };
        let body = body.get(..body_size.min(body.len())).unwrap_or_default().to_vec();
        Ok(CalloutResponse { status, body })
    }
    fn request_headers(&self) -> Result<HeaderMap, HostError> {
        self.record("request_headers")?;
        Ok(HeaderMap::from_pairs(&self.request_headers.borrow()))
    }
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        self.record("set_request_header")?;
        let mut headers = self.request_headers.borrow_mut();
        headers.retain(|(k, _)| k != name);
        headers.push((name.to_string(), value.to_string()));
        Ok(())
    }
    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        self.record("remove_request_header")?;
        self.request_headers.borrow_mut().retain(|(k, _)| k != name);
        Ok(())
    }
    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.record("request_body")?;
        let body = self.request_body.borrow();
        Ok(body.get(..size.min(body.len())).unwrap_or_default().to_vec())
    }
    fn replace_request_body(&self, old_size: usize, body: &[u8]) -> Result<(), HostError> {
        self.record("replace_request_body")?;
        let mut current = self.request_body.borrow_mut();
        let at = old_size.min(current.len());
        let rest = current.split_off(at);
        *current = [body, &rest].concat();
        Ok(())
    }
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostError> {
        self.record("send_response")?;
        let headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.replies.borrow_mut().push((status, headers, body.to_vec()));
        self.reply_contexts.borrow_mut().push(self.context.get());
        Ok(())
    }
    fn resume_response(&self) -> Result<(), HostError> {
        self.record("resume_response")?;
        self.resumed.set(self.resumed.get() + 1);
        Ok(())
    }
    fn response_status(&self) -> Result<Option<u32>, HostError> {
        self.record("response_status")?;
        Ok(self.response.borrow().0)
    }
    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.record("response_header")?;
        Ok(self
            .response_headers
            .borrow()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_bytes().to_vec()))
    }
    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.record("response_body")?;
        let body = &self.response.borrow().1;
        Ok(body.get(..size.min(body.len())).unwrap_or_default().to_vec())
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        self.record("set_effective_context")?;
        if context_id == self.context.get() {
            return Ok(());
        }
        if context_id == 0 {
            // The root context: no request.
            self.park();
            self.context.set(0);
            return Ok(());
        }
        let Some(next) = self.parked.borrow_mut().remove(&context_id) else {
            return Err(HostError::BAD_ARGUMENT);
        };
        self.park();
        self.context.set(context_id);
        *self.request_headers.borrow_mut() = next.headers;
        *self.request_body.borrow_mut() = next.body;
        Ok(())
    }
    fn resume_request(&self) -> Result<(), HostError> {
        self.record("resume_request")?;
        self.resumed_contexts.borrow_mut().push(self.context.get());
        Ok(())
    }
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        self.record("property")?;
        Ok(self.properties.borrow().get(&path.join(".")).cloned())
    }
}
