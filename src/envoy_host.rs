//! The only file that calls the proxy (proxy-wasm's ABI). proxy-wasm 0.2.5's
//! `hostcalls` panic on any status they do not expect (a callout's headers
//! read after a reset answer 2, BadArgument), and a panic kills the VM, so
//! every call here goes to the raw `proxy_*` import and every status comes
//! back as a `Result` the caller handles. The one SDK function still used,
//! `dispatch_http_call`, is there because it registers the call's token with
//! the SDK's dispatcher (see `http_call`). docs/architecture.md ("The host
//! seam") says what each caller does with an error.

use crate::host::{Callout, CalloutError, CalloutResponse, HeaderMap, Host, HostError, SharedSetError};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ptr::{null, null_mut};
use std::time::Duration;

// proxy-wasm ABI 0.2.1, declared with plain integers: the SDK's declarations
// return its `Status` enum, which has no variant for several statuses Envoy
// can return (6, 9, 11, 12).
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    #[allow(clippy::too_many_arguments)]
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

// The ABI's enumerations, as far as dprank uses them.
const OK: u32 = 0;
const REQUEST_HEADERS: u32 = 0;
const RESPONSE_HEADERS: u32 = 2;
const CALL_RESPONSE_HEADERS: u32 = 6;
const REQUEST_BODY: u32 = 0;
const RESPONSE_BODY: u32 = 1;
const CALL_RESPONSE_BODY: u32 = 4;
const PLUGIN_CONFIGURATION: u32 = 7;
const STREAM_REQUEST: u32 = 0;
const STREAM_RESPONSE: u32 = 1;
const COUNTER: u32 = 0;
const GAUGE: u32 = 1;
const HISTOGRAM: u32 = 2;

fn status(code: u32) -> Result<(), HostError> {
    match code {
        OK => Ok(()),
        other => Err(HostError(other)),
    }
}

/// Takes ownership of a buffer the host wrote (allocated through the SDK's
/// `proxy_on_memory_allocate`, a `Vec<u8>` of capacity `size`, as the SDK's
/// own wrappers assume); None for a null pointer (nothing to return).
fn owned(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        return None;
    }
    // SAFETY: see above; the host hands the buffer's ownership to the caller.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// A host call that returns bytes: Ok(None) for NotFound or no bytes.
fn read_bytes(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Vec<u8>>, HostError> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match call(&mut data, &mut size) {
        OK => Ok(owned(data, size)),
        code if code == HostError::NOT_FOUND.0 => Ok(None),
        code => Err(HostError(code)),
    }
}

/// A header map as the ABI serialises it (count, then each name and value
/// size, then each name and value followed by a NUL).
fn serialize_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let size = 4 + pairs.iter().map(|(k, v)| k.len() + v.len() + 10).sum::<usize>();
    let mut bytes = Vec::with_capacity(size);
    bytes.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        bytes.extend_from_slice(&(k.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        bytes.extend_from_slice(k.as_bytes());
        bytes.push(0);
        bytes.extend_from_slice(v.as_bytes());
        bytes.push(0);
    }
    bytes
}

/// A property path as the ABI takes it: the segments joined by NULs.
fn serialize_path(path: &[&str]) -> Vec<u8> {
    path.join("\0").into_bytes()
}

thread_local! {
    /// Metric ids by name: each VM (one per thread) defines its own.
    static METRICS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
}

/// The metric's id, defined on first use; None if the host refuses it
/// (stats are best effort: a refused one is left out, nothing else changes).
fn metric_id(kind: u32, name: &str) -> Option<u32> {
    METRICS.with(|m| {
        if let Some(id) = m.borrow().get(name) {
            return Some(*id);
        }
        let mut id = 0u32;
        // SAFETY: the name is valid for the call; the host writes one u32.
        let code = unsafe { proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) };
        status(code).ok()?;
        m.borrow_mut().insert(name.to_string(), id);
        Some(id)
    })
}

/// `log` records to Envoy's log, through the raw import (the SDK's logger
/// unwraps the status). A log line the host refuses is dropped.
struct EnvoyLogger;

impl log::Log for EnvoyLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Trace => 0,
            log::Level::Debug => 1,
            log::Level::Info => 2,
            log::Level::Warn => 3,
            log::Level::Error => 4,
        };
        write_log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}

fn write_log(level: u32, message: &str) {
    // SAFETY: the message is valid for the call.
    let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
}

static LOGGER: EnvoyLogger = EnvoyLogger;

/// Sends `log` records to Envoy at `level` and up, and a panic's message
/// (there should be none) to Envoy's log at critical level.
pub fn install_logger(level: log::LevelFilter) {
    if log::set_logger(&LOGGER).is_ok() {
        std::panic::set_hook(Box::new(|info| write_log(5, &info.to_string())));
    }
    log::set_max_level(level);
}

pub struct EnvoyHost;

impl EnvoyHost {
    /// The plugin's configuration (root context, `on_configure`).
    pub fn plugin_configuration() -> Result<Vec<u8>, HostError> {
        // SAFETY: the host writes a buffer it allocated (see `owned`).
        read_bytes(|data, size| unsafe {
            proxy_get_buffer_bytes(PLUGIN_CONFIGURATION, 0, usize::MAX, data, size)
        })
        .map(Option::unwrap_or_default)
    }

    /// Sets the root context's tick period.
    pub fn set_tick_period(ms: u64) -> Result<(), HostError> {
        // SAFETY: plain integers.
        status(unsafe { proxy_set_tick_period_milliseconds(ms.min(u32::MAX as u64) as u32) })
    }

    /// A header of the callout response being delivered.
    fn callout_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        // SAFETY: the name is valid for the call; see `owned` for the answer.
        read_bytes(|data, size| unsafe {
            proxy_get_header_map_value(CALL_RESPONSE_HEADERS, name.as_ptr(), name.len(), data, size)
        })
    }
}

impl Host for EnvoyHost {
    fn now_ms(&self) -> u64 {
        let mut nanos = 0u64;
        // SAFETY: the host writes one u64.
        match unsafe { proxy_get_current_time_nanoseconds(&mut nanos) } {
            OK => nanos / 1_000_000,
            _ => 0,
        }
    }

    fn random_u64(&self) -> u64 {
        // wasi random_get; Envoy fills it from its own entropy source.
        getrandom::u64().unwrap_or_else(|_| self.now_ms().wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        let mut cas: u32 = 0;
        // SAFETY: the key is valid for the call; see `owned` for the answer.
        let code = unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
        match code {
            // An empty value reads as absent, as it does through the SDK.
            OK => Ok(owned(data, size).filter(|v| !v.is_empty()).map(|v| (v, cas))),
            code if code == HostError::NOT_FOUND.0 => Ok(None),
            code => Err(HostError(code)),
        }
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        // SAFETY: key and value are valid for the call.
        let code = unsafe {
            proxy_set_shared_data(
                key.as_ptr(),
                key.len(),
                value.as_ptr(),
                value.len(),
                cas.unwrap_or(0),
            )
        };
        match status(code) {
            Ok(()) => Ok(()),
            Err(HostError::CAS_MISMATCH) => Err(SharedSetError::CasMismatch),
            Err(e) => Err(SharedSetError::Failed(e)),
        }
    }

    fn count(&self, metric: &str, delta: u64) {
        if let Some(id) = metric_id(COUNTER, metric) {
            // SAFETY: plain integers. Stats are best effort.
            let _ = unsafe { proxy_increment_metric(id, delta.min(i64::MAX as u64) as i64) };
        }
    }

    fn gauge(&self, metric: &str, value: u64) {
        if let Some(id) = metric_id(GAUGE, metric) {
            // SAFETY: plain integers. Stats are best effort.
            let _ = unsafe { proxy_record_metric(id, value) };
        }
    }

    fn histogram(&self, metric: &str, value: u64) {
        if let Some(id) = metric_id(HISTOGRAM, metric) {
            // SAFETY: plain integers. Stats are best effort.
            let _ = unsafe { proxy_record_metric(id, value) };
        }
    }

    /// Through the SDK: its `dispatch_http_call` registers the token with
    /// the SDK's dispatcher, which otherwise panics ("invalid token_id")
    /// when the answer comes. It panics only on a status other than Ok,
    /// BadArgument and InternalFailure; Envoy's `httpCall` returns only
    /// those three (an unknown cluster, a missing `:path`, `:method` or
    /// `:authority`, or a negative timeout give BadArgument; a request the
    /// async client cannot start gives InternalFailure; a call that fails at
    /// once is answered later, never inside the call), and InvalidMemoryAccess
    /// only for pointers outside the VM's memory, which a Rust slice is not.
    fn http_call(&self, call: &Callout) -> Result<u32, HostError> {
        let timeout = Duration::from_millis(call.timeout_ms);
        proxy_wasm::hostcalls::dispatch_http_call(
            call.cluster,
            call.headers.to_vec(),
            call.body,
            vec![],
            timeout,
        )
        .map_err(|s| HostError(s as u32))
    }

    fn callout_response(&self, headers: usize, body_size: usize) -> Result<CalloutResponse, CalloutError> {
        // Envoy delivers a call that failed (reset, refused, cut short, over
        // the buffer limit) with no headers; reading them would be refused.
        if headers == 0 {
            return Err(CalloutError::NoResponse);
        }
        let status = self
            .callout_header(":status")
            .map_err(|e| CalloutError::Unreadable("headers", e))?
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok())
            .ok_or(CalloutError::NoStatus)?;
        let body = match body_size {
            0 => Vec::new(),
            // SAFETY: see `owned`.
            size => read_bytes(|data, got| unsafe {
                proxy_get_buffer_bytes(CALL_RESPONSE_BODY, 0, size, data, got)
            })
            .map_err(|e| CalloutError::Unreadable("body", e))?
            .unwrap_or_default(),
        };
        Ok(CalloutResponse { status, body })
    }

    fn request_headers(&self) -> Result<HeaderMap, HostError> {
        // SAFETY: see `owned`.
        let bytes =
            read_bytes(|data, size| unsafe { proxy_get_header_map_pairs(REQUEST_HEADERS, data, size) })?;
        Ok(bytes.map(HeaderMap::from_serialized).unwrap_or_default())
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        // SAFETY: name and value are valid for the call.
        status(unsafe {
            proxy_replace_header_map_value(
                REQUEST_HEADERS,
                name.as_ptr(),
                name.len(),
                value.as_ptr(),
                value.len(),
            )
        })
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        // SAFETY: the name is valid for the call.
        status(unsafe { proxy_remove_header_map_value(REQUEST_HEADERS, name.as_ptr(), name.len()) })
    }

    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        // SAFETY: see `owned`.
        read_bytes(|data, got| unsafe { proxy_get_buffer_bytes(REQUEST_BODY, 0, size, data, got) })
            .map(Option::unwrap_or_default)
    }

    fn replace_request_body(&self, old_size: usize, body: &[u8]) -> Result<(), HostError> {
        // SAFETY: the body is valid for the call.
        status(unsafe { proxy_set_buffer_bytes(REQUEST_BODY, 0, old_size, body.as_ptr(), body.len()) })
    }

    fn send_response(
        &self,
        status_code: u32,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(), HostError> {
        let headers = serialize_pairs(headers);
        // SAFETY: every buffer is valid for the call; no details, no gRPC status.
        status(unsafe {
            proxy_send_local_response(
                status_code,
                null(),
                0,
                body.as_ptr(),
                body.len(),
                headers.as_ptr(),
                headers.len(),
                -1,
            )
        })
    }

    fn resume_response(&self) -> Result<(), HostError> {
        // SAFETY: a plain integer.
        status(unsafe { proxy_continue_stream(STREAM_RESPONSE) })
    }

    fn response_status(&self) -> Result<Option<u32>, HostError> {
        let bytes = self.response_header(":status")?;
        Ok(bytes.and_then(|s| std::str::from_utf8(&s).ok()?.parse().ok()))
    }

    fn response_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        // SAFETY: the name is valid for the call; see `owned`.
        read_bytes(|data, size| unsafe {
            proxy_get_header_map_value(RESPONSE_HEADERS, name.as_ptr(), name.len(), data, size)
        })
    }

    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        // SAFETY: see `owned`.
        read_bytes(|data, got| unsafe { proxy_get_buffer_bytes(RESPONSE_BODY, 0, size, data, got) })
            .map(Option::unwrap_or_default)
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        // SAFETY: a plain integer.
        status(unsafe { proxy_set_effective_context(context_id) })
    }

    fn resume_request(&self) -> Result<(), HostError> {
        // SAFETY: a plain integer.
        status(unsafe { proxy_continue_stream(STREAM_REQUEST) })
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        let path = serialize_path(path);
        // SAFETY: the path is valid for the call; see `owned`.
        read_bytes(|data, size| unsafe { proxy_get_property(path.as_ptr(), path.len(), data, size) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_serialise_as_the_abi_says() {
        let bytes = serialize_pairs(&[("a", "bc"), ("", "")]);
        let mut want = vec![2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        want.extend_from_slice(b"a\0bc\0\0\0");
        assert_eq!(bytes, want);
        // The request's own parser reads them back.
        let map = HeaderMap::from_serialized(serialize_pairs(&[("x-a", "1"), ("x-b", "two")]));
        assert_eq!(map.get("x-b"), Some("two"));
    }

    /// proxy-wasm 0.2.5's host calls that panic on a status they do not
    /// expect: the `hostcalls` functions, and the trait methods with a
    /// default body that call them.
    const SDK_HOST_CALLS: &[&str] = &[
        "add_http_request_header",
        "add_http_response_header",
        "call_foreign_function",
        "cancel_grpc_call",
        "close_downstream",
        "close_upstream",
        "dequeue_shared_queue",
        "dispatch_grpc_call",
        "dispatch_http_call",
        "done",
        "enqueue_shared_queue",
        "get_current_time",
        "get_http_call_response_body",
        "get_http_call_response_header",
        "get_http_call_response_headers",
        "get_http_request_body",
        "get_http_request_header",
        "get_http_request_headers",
        "get_http_response_body",
        "get_http_response_header",
        "get_http_response_headers",
        "get_plugin_configuration",
        "get_property",
        "get_shared_data",
        "get_vm_configuration",
        "register_shared_queue",
        "remove_http_request_header",
        "remove_http_response_header",
        "reset_http_request",
        "reset_http_response",
        "resume_http_request",
        "resume_http_response",
        "send_http_response",
        "set_http_request_body",
        "set_http_request_header",
        "set_http_request_headers",
        "set_http_response_body",
        "set_http_response_header",
        "set_property",
        "set_shared_data",
        "set_tick_period",
    ];

    fn sources(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path.display().to_string(), text));
            }
        }
    }

    /// Nothing outside this file calls the proxy through the SDK: a check
    /// on the source, so that a new call cannot slip past review.
    #[test]
    fn only_this_file_calls_the_proxy() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&root, &mut files);
        assert!(files.len() > 20, "read the sources");
        let mut found = Vec::new();
        for (path, text) in &files {
            let this_file = path.ends_with("envoy_host.rs");
            let contexts = path.ends_with("filter.rs") || path.ends_with("lib.rs");
            // A file's own unit tests (this one's name what they look for).
            let code_part = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or_default();
            for (n, line) in code_part.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default();
                let mut bad = code.contains("hostcalls") && !this_file;
                if let Some(at) = code.find("proxy_wasm::") {
                    let rest = &code[at + "proxy_wasm::".len()..];
                    let allowed = if this_file {
                        rest.starts_with("hostcalls::dispatch_http_call")
                    } else {
                        contexts
                            && ["traits::", "types::", "main!", "set_root_context"]
                                .iter()
                                .any(|p| rest.starts_with(p))
                    };
                    bad |= !allowed;
                }
                if contexts {
                    bad |= SDK_HOST_CALLS.iter().any(|m| code.contains(&format!(".{m}(")));
                }
                if bad {
                    found.push(format!("{path}:{}: {}", n + 1, line.trim()));
                }
            }
        }
        assert!(
            found.is_empty(),
            "SDK host calls outside envoy_host.rs:\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn property_paths_are_joined_by_nuls() {
        assert_eq!(serialize_path(&["response", "code"]), b"response\0code");
        assert_eq!(serialize_path(&[]), b"");
    }
}
