//! `Config::from_json` on arbitrary bytes, and on near-valid configurations
//! generated from the same bytes (`arbitrary`): every key, with values drawn
//! from pools of valid, borderline and wrong ones (limits, wrong types,
//! header names, JSON-hostile field names, duplicate workers, PD and cluster
//! discovery mixed with regular mode).
//!
//! Properties, both inputs:
//! - never panics;
//! - an accepted config keeps its documented invariants: workers present
//!   (unless taken from a cluster), unique addresses and stat names, dp_size
//!   1..=MAX_DP_SIZE, bootstrap ports on prefill workers only, the poll
//!   interval/timeout/stale limits, lowercase header names that differ,
//!   paths starting with '/' without a query, non-empty clusters;
//! - every rank field name it accepts can be spliced into a body: the JSON
//!   `with_fields` writes with it parses, and holds that key;
//! - an error names the key at fault: its path (`workers[1].name`) exists in
//!   the input, except for a missing worker list.
//! - what is given is taken as written (intervals, rank field, headers), the
//!   default stale limit is 3 x the poll interval, and PD-only keys are
//!   refused outside PD mode.
#![no_main]

mod known;

use arbitrary::{Result, Unstructured};
use dprank::body::JsonObject;
use dprank::config::{Config, ConfigError, MAX_DP_SIZE, MIN_POLL_INTERVAL_MS};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fn is_header_name(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_metric_name(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The rank field can be written into a body by `with_fields`.
fn splices(name: &str) -> bool {
    let Ok(empty) = JsonObject::parse(b"{}") else { return false };
    let out = empty.with_fields(&[(name, "1")]);
    matches!(serde_json::from_slice::<Value>(&out), Ok(Value::Object(m)) if m.get(name) == Some(&json!(1)))
}

fn check_accepted(c: &Config) {
    assert!(c.discovery.is_some() || !c.workers.is_empty(), "no workers");
    let all: Vec<_> = c.all_workers().collect();
    for (i, w) in all.iter().enumerate() {
        assert!(is_metric_name(&w.name), "worker name {:?}", w.name);
        if let Some(dp) = w.dp_size {
            assert!((1..=MAX_DP_SIZE).contains(&dp), "dp_size {dp}");
        }
        for o in &all[..i] {
            assert_ne!(o.address, w.address, "address twice");
            assert_ne!(o.name, w.name, "name twice");
        }
    }
    assert!(c.workers.iter().all(|w| w.bootstrap_port.is_none()), "bootstrap port on a routed worker");
    assert!(c.poll_interval_ms >= MIN_POLL_INTERVAL_MS);
    assert!(c.poll_timeout_ms >= 1 && c.poll_timeout_ms <= c.poll_interval_ms);
    assert!(c.stale_after_ms >= c.poll_interval_ms);
    assert!(is_header_name(&c.route_header), "route_header {:?}", c.route_header);
    if let Some(pin) = &c.pin_header {
        assert!(is_header_name(pin) && *pin != c.route_header, "pin_header {pin:?}");
    }
    assert!(!c.paths.is_empty());
    for p in &c.paths {
        assert!(p.starts_with('/') && !p.contains('?'), "path {p:?}");
    }
    assert!(!c.poll_cluster.is_empty());
    assert!(is_metric_name(&c.state_key), "state_key {:?}", c.state_key);
    if let Some(d) = &c.discovery {
        assert!(!d.cluster.is_empty() && !d.admin_cluster.is_empty());
        assert!(c.prefill.is_none());
    }
    let mut names: Vec<&str> = c.rank_field_names();
    if let Some(p) = &c.prefill {
        assert!(!p.cluster.is_empty() && p.timeout_ms > 0);
        names.extend(p.prefill_body_fields.iter().chain(&p.decode_body_fields).map(|(n, _)| n.as_str()));
        let d: Vec<&str> = p.decode_body_fields.iter().map(|(n, _)| n.as_str()).collect();
        assert!(d.len() == 2 && d[0] != d[1], "decode body sets one field twice: {d:?}");
    }
    for name in names {
        if known::skip_unsplicable_field_name(name) {
            continue;
        }
        assert!(splices(name), "accepted rank field name {name:?} does not splice into valid JSON");
    }
}

/// An error's key path (`workers[1].name`) must lead to something in the input.
fn check_error_key(input: &Value, key: &str) {
    let root_end = key.find(['[', '.']).unwrap_or(key.len());
    let root = &key[..root_end];
    let Some(mut at) = input.get(root) else {
        let missing_list = ["workers", "prefill_workers", "decode_workers"].contains(&root);
        // The PD field defaults can clash with a given name.
        let pd_field = root.ends_with("_rank_field");
        assert!(missing_list || pd_field, "error names `{key}`, absent from the input");
        return;
    };
    let mut rest = &key[root_end..];
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').expect("unclosed [");
            let i: usize = r[..end].parse().expect("index");
            at = at.get(i).unwrap_or_else(|| panic!("error key `{key}`: no element {i}"));
            rest = &r[end + 1..];
        } else if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['[', '.']).unwrap_or(r.len());
            at = at.get(&r[..end]).unwrap_or_else(|| panic!("error key `{key}`: no member {}", &r[..end]));
            rest = &r[end..];
        } else {
            panic!("error key `{key}` is not a path");
        }
    }
}

fn check(bytes: &[u8]) {
    if known::skip_config_input(bytes) {
        return;
    }
    match Config::from_json(bytes) {
        Ok(c) => {
            check_accepted(&c);
            if let Ok(Value::Object(given)) = serde_json::from_slice(bytes) {
                check_taken_as_written(&given, &c);
            }
        }
        Err(ConfigError::Invalid { key, .. }) => {
            let input: Value = serde_json::from_slice(bytes).expect("Invalid for a non-JSON input");
            check_error_key(&input, &key);
        }
        Err(ConfigError::Json(_)) => {}
    }
}

// ---- Generated configurations ----

fn pick<'a, T: Clone>(u: &mut Unstructured<'a>, pool: &[T], other: impl FnOnce(&mut Unstructured<'a>) -> Result<T>) -> Result<T> {
    let i = u.int_in_range(0..=pool.len())?;
    match pool.get(i) {
        Some(v) => Ok(v.clone()),
        None => other(u),
    }
}

fn maybe<'a>(u: &mut Unstructured<'a>, f: impl FnOnce(&mut Unstructured<'a>) -> Result<Value>) -> Result<Option<Value>> {
    Ok(if u.ratio(1, 3)? { Some(f(u)?) } else { None })
}

fn ms(u: &mut Unstructured) -> Result<Value> {
    let pool = [
        json!(0), json!(1), json!(99), json!(100), json!(250), json!(500), json!(999), json!(1000),
        json!(1001), json!(3000), json!(600000), json!(u64::MAX / 3), json!(u64::MAX / 3 + 1),
        json!(u64::MAX), json!(-1), json!("1000"), json!(1.5), Value::Null,
    ];
    pick(u, &pool, |u| Ok(json!(u.arbitrary::<u64>()?)))
}

fn text(u: &mut Unstructured, pool: &[&str]) -> Result<Value> {
    let pool: Vec<Value> = pool.iter().map(|s| json!(s)).chain([Value::Null, json!(1)]).collect();
    pick(u, &pool, |u| Ok(json!(u.arbitrary::<String>()?)))
}

const HEADERS: [&str; 8] = ["x-dprank-endpoint", "x-pick", "x-pin", "X-Pick", "x pin", "", "x-dprank-pin", "x_1"];
const FIELDS: [&str; 13] = [
    "routed_dp_rank", "data_parallel_rank", "decode_dp_rank", "disagg_prefill_dp_rank", "my_rank",
    "", "a\"b", "a\\b", "a\nb", "\u{1}", "\u{7f}", "\u{e9}t\u{e9}", "a b",
];
const NAMES: [&str; 7] = ["a", "b", "w-0", "p_1", "a.b", "", "127_0_0_1_30001"];
const ADDRESSES: [&str; 12] = [
    "127.0.0.1:30001", "127.0.0.1:30002", "127.0.0.1:30003", "10.0.0.1:8000", "[::1]:8000",
    "[fe80::1]:1", "0.0.0.0:0", "sglang:30000", "127.0.0.1", "", "1.2.3.4:99999", "127.0.0.1:30001 ",
];

fn worker(u: &mut Unstructured) -> Result<Value> {
    let mut w = Map::new();
    if !u.ratio(1, 20)? {
        w.insert("address".into(), text(u, &ADDRESSES)?);
    }
    if let Some(v) = maybe(u, |u| {
        let pool = [json!(1), json!(8), json!(0), json!(MAX_DP_SIZE), json!(MAX_DP_SIZE + 1), json!(u32::MAX), json!(u64::MAX), json!(-1), json!("8"), Value::Null];
        pick(u, &pool, |u| Ok(json!(u.arbitrary::<u32>()?)))
    })? {
        w.insert("dp_size".into(), v);
    }
    if let Some(v) = maybe(u, |u| text(u, &NAMES))? {
        w.insert("name".into(), v);
    }
    if let Some(v) = maybe(u, |u| {
        let pool = [json!(8998), json!(0), json!(65535), json!(65536), Value::Null, json!("8998")];
        pick(u, &pool, |u| Ok(json!(u.arbitrary::<u16>()?)))
    })? {
        w.insert("bootstrap_port".into(), v);
    }
    if u.ratio(1, 30)? {
        w.insert("weight".into(), json!(1));
    }
    Ok(Value::Object(w))
}

fn workers(u: &mut Unstructured) -> Result<Value> {
    let n = u.int_in_range(0..=4)?;
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(worker(u)?);
    }
    Ok(Value::Array(v))
}

fn generate(u: &mut Unstructured) -> Result<Map<String, Value>> {
    let mut c = Map::new();
    // The pools: regular, PD, cluster discovery, or a mix of them.
    let mode = u.int_in_range(0..=5)?;
    if mode == 0 || mode == 3 || mode == 5 && u.arbitrary()? {
        c.insert("workers".into(), workers(u)?);
    }
    if mode == 1 || mode == 4 || mode == 5 && u.arbitrary()? {
        c.insert("prefill_workers".into(), workers(u)?);
        if !u.ratio(1, 10)? {
            c.insert("decode_workers".into(), workers(u)?);
        }
    }
    if mode == 2 || mode >= 3 && u.arbitrary()? {
        let mut d = Map::new();
        if !u.ratio(1, 20)? {
            d.insert("cluster".into(), text(u, &["sglang", ""])?);
        }
        if let Some(v) = maybe(u, |u| text(u, &["dprank_admin", "admin", ""]))? {
            d.insert("admin_cluster".into(), v);
        }
        c.insert("workers_from_cluster".into(), Value::Object(d));
    }
    for key in ["poll_interval_ms", "poll_timeout_ms", "stale_after_ms", "prefill_timeout_ms"] {
        if let Some(v) = maybe(u, ms)? {
            c.insert(key.into(), v);
        }
    }
    for key in ["rank_field", "prefill_rank_field", "decode_rank_field", "decode_prefill_rank_field"] {
        if let Some(v) = maybe(u, |u| text(u, &FIELDS))? {
            c.insert(key.into(), v);
        }
    }
    for key in ["route_header", "pin_header"] {
        if let Some(v) = maybe(u, |u| text(u, &HEADERS))? {
            c.insert(key.into(), v);
        }
    }
    for (key, pool) in [
        ("poll_cluster", &["dprank_poll", ""][..]),
        ("prefill_cluster", &["dprank_prefill", ""][..]),
        ("state_key", &["dprank", "fleet_a", "a.b", ""][..]),
        ("load_endpoint", &["auto", "v1_loads", "get_load", "metrics"][..]),
        ("naming", &["current", "legacy", "old"][..]),
        ("cost_estimate", &["bytes", "words", "one", "tokens"][..]),
        ("fail_mode", &["open", "closed", "half"][..]),
    ] {
        if let Some(v) = maybe(u, |u| text(u, pool))? {
            c.insert(key.into(), v);
        }
    }
    for key in ["keep_client_rank", "poll_loads"] {
        if let Some(v) = maybe(u, |u| pick(u, &[json!(true), json!(false), json!("true"), Value::Null], |_| Ok(json!(0))))? {
            c.insert(key.into(), v);
        }
    }
    if let Some(v) = maybe(u, |u| {
        let pool = ["/generate", "/v1/completions", "/v1/chat/completions", "generate", "/x?y", "/", ""];
        let n = u.int_in_range(0..=3)?;
        let mut paths = Vec::new();
        for _ in 0..n {
            paths.push(text(u, &pool)?);
        }
        Ok(Value::Array(paths))
    })? {
        c.insert("paths".into(), v);
    }
    if u.ratio(1, 30)? {
        c.insert("poll_intervall_ms".into(), json!(1000));
    }
    Ok(c)
}

/// What a generated configuration says must show in the accepted Config.
fn check_taken_as_written(given: &Map<String, Value>, c: &Config) {
    let num = |k: &str| given.get(k).and_then(Value::as_u64);
    let txt = |k: &str| given.get(k).and_then(Value::as_str);
    if let Some(v) = num("poll_interval_ms") {
        assert_eq!(c.poll_interval_ms, v);
    }
    if let Some(v) = num("poll_timeout_ms") {
        assert_eq!(c.poll_timeout_ms, v);
    }
    match num("stale_after_ms") {
        Some(v) => assert_eq!(c.stale_after_ms, v),
        None => assert_eq!(c.stale_after_ms, c.poll_interval_ms.saturating_mul(3), "default stale limit"),
    }
    if let Some(v) = txt("rank_field") {
        assert_eq!(c.rank_field, v);
    }
    if let Some(v) = txt("route_header") {
        assert_eq!(c.route_header, v);
    }
    if let Some(v) = txt("pin_header") {
        assert_eq!(c.pin_header.as_deref(), Some(v));
    }
    let pd_only = ["prefill_cluster", "prefill_timeout_ms", "prefill_rank_field", "decode_rank_field", "decode_prefill_rank_field"];
    if c.prefill.is_none() && !known::skip_pd_keys_in_discovery(c) {
        for k in pd_only {
            assert!(given.get(k).is_none_or(Value::is_null), "`{k}` accepted outside PD mode");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);

    let mut u = Unstructured::new(data);
    let Ok(given) = generate(&mut u) else { return };
    check(&serde_json::to_vec(&given).expect("config JSON"));
});
