//! The small surface of the proxy the routing logic needs. `envoy_host.rs`
//! implements it with proxy-wasm host calls; tests implement it in memory.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedSetError {
    /// Someone else wrote the key since we read it.
    CasMismatch,
    /// The host refused for another reason.
    Failed,
}

pub trait Host {
    /// Wall-clock time, ms since the Unix epoch.
    fn now_ms(&self) -> u64;
    /// Value and compare-and-swap token of a shared-data key, if present.
    fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes a shared-data key; with `cas`, only if nobody wrote it since.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError>;
    /// Adds to a counter stat.
    fn count(&self, metric: &str, delta: u64);
    /// Sets a gauge stat.
    fn gauge(&self, metric: &str, value: u64);
    /// Dispatches an HTTP call through `cluster`; returns the call's token.
    fn http_call(
        &self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        timeout_ms: u64,
    ) -> Result<u32, String>;
    /// A random number (bootstrap rooms).
    fn random_u64(&self) -> u64;
}

/// How many times a read-modify-write on shared data is retried when another
/// thread wrote in between.
pub const CAS_ATTEMPTS: usize = 16;

/// Read-modify-write of one shared key under compare-and-swap. `update` gets
/// the current bytes (None when absent) and returns the new bytes and a
/// result, or None to write nothing. Returns None when nothing was written.
pub fn shared_update<R>(
    host: &dyn Host,
    key: &str,
    mut update: impl FnMut(Option<&[u8]>) -> Option<(Vec<u8>, R)>,
) -> Option<R> {
    for _ in 0..CAS_ATTEMPTS {
        let current = host.shared_get(key);
        let (bytes, result) = update(current.as_ref().map(|(v, _)| v.as_slice()))?;
        match host.shared_set(key, &bytes, current.map(|(_, cas)| cas)) {
            Ok(()) => return Some(result),
            Err(SharedSetError::CasMismatch) => continue,
            Err(SharedSetError::Failed) => return None,
        }
    }
    host.count("dprank.shared_data_conflicts", 1);
    None
}

#[cfg(test)]
pub mod fake {
    //! An in-memory host with Envoy's shared-data semantics (cas bumps on every write).
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    /// A dispatched call: cluster, headers, token.
    pub type Call = (String, Vec<(String, String)>, u32);

    #[derive(Default)]
    pub struct FakeHost {
        pub now: Cell<u64>,
        pub shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        pub counters: RefCell<HashMap<String, u64>>,
        pub gauges: RefCell<HashMap<String, u64>>,
        pub calls: RefCell<Vec<Call>>,
        pub next_token: Cell<u32>,
        /// Writes that fail with CasMismatch before succeeding (simulates another thread).
        pub conflicts: Cell<usize>,
        pub random: Cell<u64>,
        /// Bodies of dispatched calls, in order.
        pub bodies: RefCell<Vec<Option<Vec<u8>>>>,
    }

    impl FakeHost {
        pub fn counter(&self, name: &str) -> u64 {
            self.counters.borrow().get(name).copied().unwrap_or(0)
        }
        pub fn gauge_value(&self, name: &str) -> Option<u64> {
            self.gauges.borrow().get(name).copied()
        }
    }

    impl Host for FakeHost {
        fn now_ms(&self) -> u64 {
            self.now.get()
        }
        fn shared_get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.shared.borrow().get(key).cloned()
        }
        fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
            if self.conflicts.get() > 0 {
                self.conflicts.set(self.conflicts.get() - 1);
                return Err(SharedSetError::CasMismatch);
            }
            let mut shared = self.shared.borrow_mut();
            let current = shared.get(key).map(|(_, c)| *c).unwrap_or(0);
            if let Some(cas) = cas {
                if cas != current {
                    return Err(SharedSetError::CasMismatch);
                }
            }
            shared.insert(key.to_string(), (value.to_vec(), current + 1));
            Ok(())
        }
        fn count(&self, metric: &str, delta: u64) {
            *self.counters.borrow_mut().entry(metric.to_string()).or_default() += delta;
        }
        fn gauge(&self, metric: &str, value: u64) {
            self.gauges.borrow_mut().insert(metric.to_string(), value);
        }
        fn random_u64(&self) -> u64 {
            let n = self.random.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
            self.random.set(n);
            n
        }
        fn http_call(
            &self,
            cluster: &str,
            headers: &[(&str, &str)],
            body: Option<&[u8]>,
            _timeout_ms: u64,
        ) -> Result<u32, String> {
            self.bodies.borrow_mut().push(body.map(|b| b.to_vec()));
            let token = self.next_token.get() + 1;
            self.next_token.set(token);
            let headers = headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            self.calls
                .borrow_mut()
                .push((cluster.to_string(), headers, token));
            Ok(token)
        }
    }
}
