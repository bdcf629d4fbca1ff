//! Bugs the fuzzers found that are not fixed yet (see fuzz/RESULTS.md).
//!
//! By default nothing is skipped: the reproducers in fuzz/regressions/<target>
//! fail the run until the bug is fixed. With `DPRANK_FUZZ_SKIP_KNOWN=1` the
//! targets step around these bugs so a long run can look for other ones.
//! Delete an entry when its bug is fixed.
#![allow(dead_code)]

use dprank::config::Config;
use std::sync::OnceLock;

fn skipping() -> bool {
    static SKIP: OnceLock<bool> = OnceLock::new();
    *SKIP.get_or_init(|| std::env::var("DPRANK_FUZZ_SKIP_KNOWN").is_ok_and(|v| v == "1"))
}

/// config-1: `3 * poll_interval_ms` (the default stale limit) overflows for
/// poll_interval_ms > u64::MAX / 3: a panic with overflow checks, a wrapped
/// (wrong) stale limit and a spurious `stale_after_ms` error without.
pub fn skip_config_input(bytes: &[u8]) -> bool {
    skipping()
        && serde_json::from_slice::<serde_json::Value>(bytes)
            .ok()
            .and_then(|v| v.get("poll_interval_ms").and_then(|v| v.as_u64()))
            .is_some_and(|ms| ms > u64::MAX / 3)
}

/// config-2: rank field names holding U+0000..U+001F are accepted; spliced
/// raw into a body (JSON forbids them unescaped) they make it invalid JSON.
pub fn skip_unsplicable_field_name(name: &str) -> bool {
    skipping() && name.chars().any(|c| c < ' ')
}

/// config-3: with `workers_from_cluster`, the PD-only keys are accepted and
/// ignored (with `workers` they are refused).
pub fn skip_pd_keys_in_discovery(c: &Config) -> bool {
    skipping() && c.discovery.is_some()
}

thread_local! {
    static TRUNCATED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Per input: forget what the last one noted.
pub fn reset() {
    TRUNCATED.with(|t| t.set(false));
}

/// state-1: a snapshot with fewer ranks truncates (or drops) a pending bucket
/// of a later poll; once a later snapshot grows the ranks back, a new request
/// lands in a bucket with the same sequence, and releasing the first ticket
/// subtracts the new request's estimate (buckets are matched by sequence only).
pub fn note_truncated_estimate() {
    TRUNCATED.with(|t| t.set(true));
}

pub fn skip_truncated_estimates() -> bool {
    skipping() && TRUNCATED.with(|t| t.get())
}
