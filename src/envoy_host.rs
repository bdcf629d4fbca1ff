//! The only file that calls proxy-wasm host functions. Every call returns a
//! Result or an Option here: the SDK's trait defaults panic on unexpected
//! statuses, and a panic kills the VM for its thread.

use crate::host::{Callout, HeaderMap, Host, SharedSetError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};

#[link(wasm_import_module = "env")]
extern "C" {
    /// The ABI call behind the SDK's `get_map`, declared with plain integers:
    /// the SDK's wrapper panics on a status it does not expect and turns
    /// every header into two owned strings (`request_headers` below).
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
}

thread_local! {
    /// Metric ids by name: each VM (one per thread) defines its own.
    static METRICS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
}

fn metric_id(kind: MetricType, name: &str) -> Option<u32> {
    METRICS.with(|m| {
        if let Some(id) = m.borrow().get(name) {
            return Some(*id);
        }
        let id = hostcalls::define_metric(kind, name).ok()?;
        m.borrow_mut().insert(name.to_string(), id);
        Some(id)
    })
}

pub struct EnvoyHost;

impl EnvoyHost {
    /// The plugin's configuration (root context, `on_configure`).
    pub fn plugin_configuration() -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
    }

    /// Sets the root context's tick period; false if refused.
    pub fn set_tick_period(ms: u64) -> bool {
        hostcalls::set_tick_period(Duration::from_millis(ms)).is_ok()
    }
}

impl Host for EnvoyHost {
    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    fn random_u64(&self) -> u64 {
        // wasi random_get; Envoy fills it from its own entropy source.
        getrandom::u64().unwrap_or_else(|_| self.now_ms().wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), cas)) => Some((value, cas.unwrap_or(0))),
            _ => None,
        }
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SharedSetError::CasMismatch),
            Err(_) => Err(SharedSetError::Failed),
        }
    }

    fn count(&self, metric: &str, delta: u64) {
        if let Some(id) = metric_id(MetricType::Counter, metric) {
            let _ = hostcalls::increment_metric(id, delta as i64);
        }
    }

    fn gauge(&self, metric: &str, value: u64) {
        if let Some(id) = metric_id(MetricType::Gauge, metric) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn histogram(&self, metric: &str, value: u64) {
        if let Some(id) = metric_id(MetricType::Histogram, metric) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn http_call(&self, call: &Callout) -> Result<u32, String> {
        let timeout = Duration::from_millis(call.timeout_ms);
        hostcalls::dispatch_http_call(call.cluster, call.headers.to_vec(), call.body, vec![], timeout)
            .map_err(|s| format!("dispatch refused ({s:?}): is the cluster defined?"))
    }

    fn callout_status(&self) -> Option<u32> {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse().ok())
    }

    fn callout_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn request_headers(&self) -> HeaderMap {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: the host writes a buffer it allocated through the SDK's
        // `proxy_on_memory_allocate` (a Vec of exactly `size` bytes, as the
        // SDK's own `get_map` assumes) and hands its ownership to us.
        let status =
            unsafe { proxy_get_header_map_pairs(MapType::HttpRequestHeaders as u32, &mut data, &mut size) };
        if status != Status::Ok as u32 || data.is_null() {
            return HeaderMap::default();
        }
        // SAFETY: see above; the Vec frees the buffer when the map is dropped.
        HeaderMap::from_serialized(unsafe { Vec::from_raw_parts(data, size, size) })
    }

    fn set_request_header(&self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }

    fn remove_request_header(&self, name: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, None);
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
    }

    fn replace_request_body(&self, old_size: usize, body: &[u8]) -> bool {
        hostcalls::set_buffer(BufferType::HttpRequestBody, 0, old_size, body).is_ok()
    }

    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        let _ = hostcalls::send_http_response(status, headers.to_vec(), Some(body));
    }

    fn resume_response(&self) {
        let _ = hostcalls::resume_http_response();
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        hostcalls::set_effective_context(context_id).is_ok()
    }

    fn resume_request(&self) -> bool {
        hostcalls::resume_http_request().is_ok()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
}
