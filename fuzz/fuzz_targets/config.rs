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
//!   the input, except for a missing worker list, a default worker name, and
//!   a PD field name whose default clashes with a given one.
//! - what is given is taken as written (intervals, rank field, headers), the
//!   default stale limit is 3 x the poll interval, and PD-only keys are
//!   refused outside PD mode;
//! - header mode (`rank_transport: header`) is never accepted with PD or
//!   `keep_client_rank`; it reads the body exactly when prefix affinity is
//!   on, `cost_estimate: words` only then and `cost_without_length` never
//!   then; its rank headers are lowercase, distinct and none of the filter's
//!   own; and every rank or bootstrap header servers read, the route, pin
//!   and rank headers among them, is removed from clients;
//! - gateways, retry alternates and the picker are taken as written
//!   (`pick_choices` only with `pick: headroom`); prefix affinity is on by
//!   default in body mode and with `engine: vllm`, in SGLang's header mode
//!   only when asked for, its tuning keys refused without it; passive
//!   health is on unless `enabled: false`;
//! - `engine: vllm` is accepted only in header mode with
//!   `x-data-parallel-rank` among the rank headers, never with PD, a
//!   `rank_field`, `naming`, `keep_client_rank: true` or `load_endpoint`;
//!   `served_model_name` only with it.
#![no_main]

use arbitrary::{Result, Unstructured};
use dprank::body::JsonObject;
use dprank::config::{
    Config, ConfigError, CostEstimate, Engine, Pick, StateReads, Transport, MAX_DP_SIZE, MIN_POLL_INTERVAL_MS,
};
use dprank::headers::CLIENT_RANK_HEADERS;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fn is_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_metric_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The rank field can be written into a body by `with_fields`.
fn splices(name: &str) -> bool {
    let Ok(empty) = JsonObject::parse(b"{}") else {
        return false;
    };
    let out = empty.with_fields(&[(name, "1")]);
    matches!(serde_json::from_slice::<Value>(&out), Ok(Value::Object(m)) if m.get(name) == Some(&json!(1)))
}

fn check_accepted(c: &Config) {
    assert!(c.discovery().is_some() || !c.routed().is_empty(), "no workers");
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
    assert!(
        c.routed().iter().all(|w| w.bootstrap_port.is_none()),
        "bootstrap port on a routed worker"
    );
    assert!(c.poll_interval_ms >= MIN_POLL_INTERVAL_MS);
    assert!(c.poll_timeout_ms >= 1 && c.poll_timeout_ms <= c.poll_interval_ms);
    assert!(c.stale_after_ms >= c.poll_interval_ms);
    assert!(
        is_header_name(&c.route_header),
        "route_header {:?}",
        c.route_header
    );
    if let Some(pin) = &c.pin_header {
        assert!(
            is_header_name(pin) && *pin != c.route_header,
            "pin_header {pin:?}"
        );
    }
    assert!(!c.paths.is_empty());
    for p in &c.paths {
        assert!(p.starts_with('/') && !p.contains('?'), "path {p:?}");
    }
    assert!(!c.poll_cluster.is_empty());
    assert!(is_metric_name(&c.state_key), "state_key {:?}", c.state_key);
    if let Some(d) = c.discovery() {
        assert!(!d.cluster.is_empty() && !d.admin_cluster.is_empty());
        assert!(c.pd().is_none());
    }
    let mut names: Vec<&str> = c.rank_field_names();
    if let Some(p) = c.pd() {
        assert!(!p.cluster.is_empty() && p.timeout_ms > 0);
        names.extend(
            p.prefill_body_fields
                .iter()
                .chain(&p.decode_body_fields)
                .map(|(n, _)| n.as_str()),
        );
        let d: Vec<&str> = p.decode_body_fields.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            d.len() == 2 && d[0] != d[1],
            "decode body sets one field twice: {d:?}"
        );
    }
    for name in names {
        assert!(
            splices(name),
            "accepted rank field name {name:?} does not splice into valid JSON"
        );
    }
    let removed = |name: &str| c.removed_headers.iter().any(|r| r == name);
    assert!(removed(&c.route_header) && c.pin_header.as_deref().is_none_or(removed));
    assert!(
        CLIENT_RANK_HEADERS.iter().all(|h| removed(h)),
        "{:?}",
        c.removed_headers
    );
    if let Transport::Header(h) = &c.transport {
        assert!(c.pd().is_none() && !c.keep_client_rank);
        assert_eq!(
            h.reads_body,
            c.prefix.is_some(),
            "the body is read for prefix affinity only"
        );
        assert!(h.reads_body || c.cost_estimate != CostEstimate::Words);
        assert!(!h.rank_headers.is_empty() && h.cost_without_length >= 1);
        for (i, name) in h.rank_headers.iter().enumerate() {
            assert!(is_header_name(name) && removed(name), "rank header {name:?}");
            assert!(
                *name != c.route_header
                    && c.pin_header.as_ref() != Some(name)
                    && !h.rank_headers[..i].contains(name)
            );
        }
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
        assert!(
            missing_list || pd_field,
            "error names `{key}`, absent from the input"
        );
        return;
    };
    let mut rest = &key[root_end..];
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').expect("unclosed [");
            let i: usize = r[..end].parse().expect("index");
            at = at
                .get(i)
                .unwrap_or_else(|| panic!("error key `{key}`: no element {i}"));
            rest = &r[end + 1..];
        } else if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['[', '.']).unwrap_or(r.len());
            let member = &r[..end];
            match at.get(member) {
                Some(v) => at = v,
                // A default stat name (from the address) can clash with a given one.
                None if member == "name" && end == r.len() => return,
                None => panic!("error key `{key}`: no member {member}"),
            }
            rest = &r[end..];
        } else {
            panic!("error key `{key}` is not a path");
        }
    }
}

fn check(bytes: &[u8], what: &str) {
    let result = Config::from_json(bytes);
    if std::env::var_os("DPRANK_FUZZ_TRACE").is_some() {
        let outcome = match &result {
            Ok(_) => "ok".to_string(),
            Err(ConfigError::Invalid { key, .. }) => format!("invalid {key}"),
            Err(ConfigError::Json(e)) => format!("json {e}"),
        };
        eprintln!("TRACE {what} {} => {outcome}", String::from_utf8_lossy(bytes));
    }
    match result {
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

/// Draws values for a generated configuration: from the valid ones, or (when
/// `wild`, now and then) from the wrong and borderline ones or anything at all.
struct Gen<'u, 'a> {
    u: &'u mut Unstructured<'a>,
    wild: bool,
    /// Workers so far: good addresses and names are unique.
    count: u32,
}

impl<'a> Gen<'_, 'a> {
    fn bad(&mut self) -> Result<bool> {
        Ok(self.wild && self.u.ratio(1, 6)?)
    }

    fn pick(
        &mut self,
        good: &[Value],
        bad: &[Value],
        any: fn(&mut Unstructured<'a>) -> Result<Value>,
    ) -> Result<Value> {
        if self.bad()? {
            let i = self.u.int_in_range(0..=bad.len())?;
            return match bad.get(i) {
                Some(v) => Ok(v.clone()),
                None => any(self.u),
            };
        }
        Ok(self.u.choose(good)?.clone())
    }

    fn text(&mut self, good: &[&str], bad: &[&str]) -> Result<Value> {
        let good: Vec<Value> = good.iter().map(|s| json!(s)).collect();
        let bad: Vec<Value> = bad
            .iter()
            .map(|s| json!(s))
            .chain([Value::Null, json!(1)])
            .collect();
        self.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<String>()?)))
    }

    fn flag(&mut self) -> Result<Value> {
        self.pick(
            &[json!(true), json!(false)],
            &[json!("true"), Value::Null],
            |_| Ok(json!(0)),
        )
    }

    fn number(&mut self, good: &[u64], bad: &[u64]) -> Result<Value> {
        let good: Vec<Value> = good.iter().map(|n| json!(n)).collect();
        let bad: Vec<Value> = bad
            .iter()
            .map(|n| json!(n))
            .chain([json!(-1), json!("2"), json!(1.5), Value::Null])
            .collect();
        self.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<u64>()?)))
    }

    fn maybe(&mut self, f: impl FnOnce(&mut Self) -> Result<Value>) -> Result<Option<Value>> {
        Ok(if self.u.ratio(1, 3)? { Some(f(self)?) } else { None })
    }

    fn ms(&mut self) -> Result<Value> {
        let good = [
            json!(100),
            json!(250),
            json!(500),
            json!(999),
            json!(1000),
            json!(1001),
            json!(3000),
            json!(600000),
        ];
        let bad = [
            json!(0),
            json!(1),
            json!(99),
            json!(u64::MAX / 3),
            json!(u64::MAX / 3 + 1),
            json!(u64::MAX),
            json!(-1),
            json!("1000"),
            json!(1.5),
            Value::Null,
        ];
        self.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<u64>()?)))
    }

    fn worker(&mut self, prefill: bool) -> Result<Value> {
        let mut w = Map::new();
        self.count += 1;
        let n = self.count;
        if !(self.bad()? && self.u.ratio(1, 5)?) {
            let good = [
                json!(format!("10.0.0.{n}:8000")),
                json!(format!("127.0.0.1:{}", 30000 + n)),
                json!(format!("[fd00::{n}]:8000")),
            ];
            let bad: Vec<Value> = BAD_ADDRESSES
                .iter()
                .map(|a| json!(a))
                .chain([json!("127.0.0.1:30001"), Value::Null])
                .collect();
            let address = self.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<String>()?)))?;
            w.insert("address".into(), address);
        }
        if let Some(v) = self.maybe(|g| {
            let good = [json!(1), json!(2), json!(8), json!(MAX_DP_SIZE)];
            let bad = [
                json!(0),
                json!(MAX_DP_SIZE + 1),
                json!(u32::MAX),
                json!(u64::MAX),
                json!(-1),
                json!("8"),
                Value::Null,
            ];
            g.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<u32>()?)))
        })? {
            w.insert("dp_size".into(), v);
        }
        if let Some(v) = self.maybe(|g| {
            let good = [json!(format!("w{n}")), json!(format!("Worker-{n}_a"))];
            let bad: Vec<Value> = BAD_NAMES
                .iter()
                .map(|a| json!(a))
                .chain([Value::Null, json!(1)])
                .collect();
            g.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<String>()?)))
        })? {
            w.insert("name".into(), v);
        }
        let port = if prefill { self.u.ratio(1, 2)? } else { self.bad()? };
        if port {
            let good = [json!(8998), json!(8999), json!(0), json!(65535), Value::Null];
            let bad = [json!(65536), json!(-1), json!("8998")];
            let v = self.pick(&good, &bad, |u| Ok(json!(u.arbitrary::<u16>()?)))?;
            w.insert("bootstrap_port".into(), v);
        }
        if self.bad()? && self.u.ratio(1, 10)? {
            w.insert("weight".into(), json!(1));
        }
        Ok(Value::Object(w))
    }

    fn workers(&mut self, prefill: bool) -> Result<Value> {
        let n = if self.bad()? {
            self.u.int_in_range(0..=5)?
        } else {
            self.u.int_in_range(1..=3)?
        };
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(self.worker(prefill)?);
        }
        Ok(Value::Array(v))
    }
}

/// Route headers, then pin headers.
const HEADERS: [&str; 6] = [
    "x-dprank-endpoint",
    "x-pick",
    "x-route-1",
    "x-pin",
    "x-dprank-pin",
    "x_1",
];
const BAD_HEADERS: [&str; 4] = ["X-Pick", "x pin", "", "x-pin\n"];
const FIELDS: [&str; 8] = [
    "routed_dp_rank",
    "data_parallel_rank",
    "decode_dp_rank",
    "disagg_prefill_dp_rank",
    "my_rank",
    "\u{7f}",
    "\u{e9}t\u{e9}",
    "a b",
];
const BAD_FIELDS: [&str; 7] = ["", "a\"b", "a\\b", "a\nb", "\u{1}", "routed_dp_rank\t", "\u{0}"];
const BAD_NAMES: [&str; 5] = ["a.b", "", "a b", "w1", "127_0_0_1_30001"];
const BAD_ADDRESSES: [&str; 5] = [
    "sglang:30000",
    "127.0.0.1",
    "",
    "1.2.3.4:99999",
    "127.0.0.1:30001 ",
];

fn generate(u: &mut Unstructured) -> Result<Map<String, Value>> {
    let wild = u.ratio(1, 2)?;
    let mut g = Gen { u, wild, count: 0 };
    let mut c = Map::new();
    // The pools: regular, PD, cluster discovery, or a mix of them.
    let mode = if g.bad()? {
        g.u.int_in_range(3..=5)?
    } else {
        g.u.int_in_range(0..=2)?
    };
    if mode == 0 || mode == 3 || mode == 5 && g.u.arbitrary()? {
        c.insert("workers".into(), g.workers(false)?);
    }
    if mode == 1 || mode == 4 || mode == 5 && g.u.arbitrary()? {
        c.insert("prefill_workers".into(), g.workers(true)?);
        if !(g.bad()? && g.u.ratio(1, 3)?) {
            c.insert("decode_workers".into(), g.workers(false)?);
        }
    }
    if mode == 2 || mode >= 3 && g.u.arbitrary()? {
        let mut d = Map::new();
        if !(g.bad()? && g.u.ratio(1, 5)?) {
            d.insert("cluster".into(), g.text(&["sglang", "sglang_decode"], &[""])?);
        }
        if let Some(v) = g.maybe(|g| g.text(&["dprank_admin", "admin"], &[""]))? {
            d.insert("admin_cluster".into(), v);
        }
        c.insert("workers_from_cluster".into(), Value::Object(d));
    }
    if let Some(v) = g.maybe(|g| g.text(&["sglang", "vllm", "vllm"], &["tgi", "VLLM"]))? {
        c.insert("engine".into(), v);
    }
    if g.u.ratio(1, 5)? {
        let v = g.text(&["Qwen/Qwen3-8B", "m"], &[""])?;
        c.insert("served_model_name".into(), v);
    }
    // Keys of the other modes: refused, so only now and then.
    let pd = c.contains_key("prefill_workers");
    let pd_keys = [
        "prefill_timeout_ms",
        "prefill_cluster",
        "prefill_rank_field",
        "decode_rank_field",
        "decode_prefill_rank_field",
    ];
    let key_fits = |g: &mut Gen, key: &str| -> Result<bool> {
        let fits = if pd_keys.contains(&key) {
            pd
        } else {
            !(pd && key == "rank_field")
        };
        Ok(fits || g.bad()?)
    };
    for key in [
        "poll_interval_ms",
        "poll_timeout_ms",
        "stale_after_ms",
        "prefill_timeout_ms",
        "state_refresh_ms",
    ] {
        if key_fits(&mut g, key)? {
            if let Some(v) = g.maybe(|g| g.ms())? {
                c.insert(key.into(), v);
            }
        }
    }
    for key in [
        "rank_field",
        "prefill_rank_field",
        "decode_rank_field",
        "decode_prefill_rank_field",
    ] {
        if key_fits(&mut g, key)? {
            if let Some(v) = g.maybe(|g| g.text(&FIELDS, &BAD_FIELDS))? {
                c.insert(key.into(), v);
            }
        }
    }
    if let Some(v) = g.maybe(|g| g.text(&HEADERS[..3], &BAD_HEADERS))? {
        c.insert("route_header".into(), v);
    }
    if let Some(v) = g.maybe(|g| {
        g.text(
            &HEADERS[3..],
            &[&BAD_HEADERS[..], &["x-dprank-endpoint"]].concat(),
        )
    })? {
        c.insert("pin_header".into(), v);
    }
    for (key, good, bad) in [
        ("poll_cluster", &["dprank_poll", "polls"][..], &[""][..]),
        ("prefill_cluster", &["dprank_prefill", "pc"][..], &[""][..]),
        ("state_key", &["dprank", "fleet_a", "A-1"][..], &["a.b", ""][..]),
        (
            "load_endpoint",
            &["auto", "v1_loads", "get_load"][..],
            &["metrics", "Auto"][..],
        ),
        ("naming", &["current", "legacy"][..], &["old"][..]),
        ("cost_estimate", &["bytes", "words", "one"][..], &["tokens"][..]),
        ("fail_mode", &["open", "closed"][..], &["half"][..]),
        (
            "rank_transport",
            &["body", "header", "header"][..],
            &["headers", "Body"][..],
        ),
    ] {
        if key_fits(&mut g, key)? {
            if let Some(v) = g.maybe(|g| g.text(good, bad))? {
                c.insert(key.into(), v);
            }
        }
    }
    for key in ["keep_client_rank", "poll_loads"] {
        if let Some(v) = g.maybe(|g| g.flag())? {
            c.insert(key.into(), v);
        }
    }
    if let Some(v) = g.maybe(|g| {
        let n = if g.bad()? {
            g.u.int_in_range(0..=3)?
        } else {
            g.u.int_in_range(1..=3)?
        };
        let mut paths = Vec::new();
        for _ in 0..n {
            paths.push(g.text(
                &["/generate", "/v1/completions", "/v1/chat/completions", "/"],
                &["generate", "/x?y", ""],
            )?);
        }
        Ok(Value::Array(paths))
    })? {
        c.insert("paths".into(), v);
    }
    // Header mode's keys, refused in body mode: mostly with it.
    let header_mode = c.get("rank_transport") == Some(&json!("header"));
    if header_mode || g.bad()? {
        if let Some(v) = g.maybe(|g| {
            let n = if g.bad()? {
                g.u.int_in_range(0..=3)?
            } else {
                g.u.int_in_range(1..=2)?
            };
            let mut names = Vec::new();
            for _ in 0..n {
                names.push(g.text(
                    &["x-data-parallel-rank", "x-override-routed-dp-rank", "x-rank"],
                    &[&BAD_HEADERS[..], &HEADERS[..]].concat(),
                )?);
            }
            Ok(Value::Array(names))
        })? {
            c.insert("rank_headers".into(), v);
        }
        if let Some(v) = g.maybe(|g| g.ms())? {
            c.insert("cost_without_length".into(), v);
        }
    }
    // Numbers with a range: gateways, retry alternates, pick choices.
    for (key, good, bad) in [
        ("gateways", &[1, 2, 4, 8, 1024][..], &[0, 1025][..]),
        ("retry_alternates", &[0, 1, 2, 16][..], &[17][..]),
        ("pick_choices", &[2, 4, 16][..], &[0, 1, 17][..]),
    ] {
        if let Some(v) = g.maybe(|g| g.number(good, bad))? {
            c.insert(key.into(), v);
        }
    }
    if let Some(v) = g.maybe(|g| g.text(&["least_cost", "headroom"], &["Headroom", "random"]))? {
        c.insert("pick".into(), v);
    }
    if let Some(v) = g.maybe(|g| {
        g.text(
            &["auto", "every_worker", "change_log"],
            &["ChangeLog", "sometimes"],
        )
    })? {
        c.insert("state_reads".into(), v);
    }
    // Prefix affinity and its tuning keys (refused when affinity is off).
    if let Some(v) = g.maybe(|g| g.flag())? {
        c.insert("prefix_affinity".into(), v);
    }
    for (key, good, bad) in [
        (
            "prefix_block_bytes",
            &[64, 512, 4096][..],
            &[0, 1, u64::from(u32::MAX) + 1][..],
        ),
        (
            "prefix_capacity_tokens",
            &[1, 10_000, 400_000][..],
            &[0, u64::MAX][..],
        ),
        ("prefix_ttl_ms", &[1000, 600_000][..], &[0, u64::MAX][..]),
        (
            "prefix_private_after_ms",
            &[1000, 5000][..],
            &[0, 999, u64::MAX][..],
        ),
    ] {
        if g.u.ratio(1, 6)? {
            let v = g.number(good, bad)?;
            c.insert(key.into(), v);
        }
    }
    for key in [
        "prefix_uncached_weight",
        "prefix_load_weight",
        "prefix_wait_weight",
        "prefix_kv_weight",
        "prefix_private_weight",
    ] {
        if g.u.ratio(1, 8)? {
            let v = g.pick(
                &[json!(0.0), json!(1), json!(4.5)],
                &[json!(-1.0), json!(1e300), json!("1")],
                |u| Ok(json!(u.arbitrary::<f64>()?)),
            )?;
            c.insert(key.into(), v);
        }
    }
    if g.u.ratio(1, 8)? {
        let v = g.text(&["max", "polled"], &["Max", "sum"])?;
        c.insert("prefix_queue".into(), v);
    }
    if let Some(v) = g.maybe(|g| {
        let mut h = Map::new();
        if let Some(v) = g.maybe(|g| g.flag())? {
            h.insert("enabled".into(), v);
        }
        if let Some(v) = g.maybe(|g| g.number(&[1, 3, 1000], &[0, 1001]))? {
            h.insert("consecutive_failures".into(), v);
        }
        if let Some(v) = g.maybe(|g| g.ms())? {
            h.insert("cooldown_ms".into(), v);
        }
        if let Some(v) = g.maybe(|g| g.ms())? {
            h.insert("max_cooldown_ms".into(), v);
        }
        if let Some(v) = g.maybe(|g| {
            g.pick(
                &[json!(0.05), json!(1.0)],
                &[json!(0.0), json!(1.5), json!(-0.1)],
                |u| Ok(json!(u.arbitrary::<f64>()?)),
            )
        })? {
            h.insert("probe_share".into(), v);
        }
        Ok(Value::Object(h))
    })? {
        c.insert("passive_health".into(), v);
    }
    if g.bad()? && g.u.ratio(1, 10)? {
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
        None => assert_eq!(
            c.stale_after_ms,
            c.poll_interval_ms.saturating_mul(3),
            "default stale limit"
        ),
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
    let header_only = ["rank_headers", "cost_without_length"];
    if let Transport::Header(h) = &c.transport {
        if let Some(v) = num("cost_without_length") {
            assert!(
                !h.reads_body,
                "cost_without_length accepted under prefix affinity"
            );
            assert_eq!(h.cost_without_length, v);
        }
        if let Some(list) = given.get("rank_headers").and_then(Value::as_array) {
            let names: Vec<&str> = list.iter().filter_map(Value::as_str).collect();
            assert_eq!(h.rank_headers, names);
        }
    } else {
        assert_ne!(txt("rank_transport"), Some("header"));
        for k in header_only {
            assert!(
                given.get(k).is_none_or(Value::is_null),
                "`{k}` accepted in body mode"
            );
        }
    }
    assert_eq!(c.state_refresh_ms, num("state_refresh_ms").unwrap_or(0));
    assert!(
        c.state_refresh_ms <= c.poll_interval_ms,
        "state refresh beyond the poll interval"
    );
    let reads = match c.state_reads {
        StateReads::Auto => "auto",
        StateReads::EveryWorker => "every_worker",
        StateReads::ChangeLog => "change_log",
    };
    assert_eq!(txt("state_reads").unwrap_or("auto"), reads);
    assert!(
        !(c.state_reads == StateReads::ChangeLog && c.state_refresh_ms > 0),
        "state_refresh_ms accepted with the change log"
    );
    // Scale-out and retries: taken as written.
    assert_eq!(u64::from(c.gateways), num("gateways").unwrap_or(1));
    if let Some(v) = num("retry_alternates") {
        assert_eq!(u64::from(c.retry_alternates), v);
    }
    match c.pick {
        Pick::LeastCost => {
            assert_ne!(txt("pick"), Some("headroom"));
            assert!(
                given.get("pick_choices").is_none_or(Value::is_null),
                "`pick_choices` accepted without headroom"
            );
        }
        Pick::Headroom { choices } => {
            assert_eq!(txt("pick"), Some("headroom"));
            assert_eq!(u64::from(choices), num("pick_choices").unwrap_or(2));
        }
    }
    // The engine: vLLM only with its header, never with a body rank field.
    let vllm = txt("engine") == Some("vllm");
    assert_eq!(c.engine.is_vllm(), vllm);
    match &c.engine {
        Engine::Sglang => assert!(given.get("served_model_name").is_none_or(Value::is_null)),
        Engine::Vllm { served_model_name } => {
            assert_eq!(served_model_name.as_deref(), txt("served_model_name"));
            let Transport::Header(h) = &c.transport else {
                panic!("engine vllm accepted without header mode");
            };
            assert!(h.rank_headers.iter().any(|r| r == "x-data-parallel-rank"));
            assert!(c.pd().is_none());
            for key in ["rank_field", "naming", "load_endpoint"] {
                assert!(
                    given.get(key).is_none_or(Value::is_null),
                    "`{key}` accepted with engine vllm"
                );
            }
            assert_ne!(given.get("keep_client_rank"), Some(&json!(true)));
        }
    }
    // Prefix affinity: on by default in body mode and for vLLM, in SGLang's
    // header mode only when asked for; its tuning keys only with it, taken
    // as written.
    let header = matches!(c.transport, Transport::Header(_));
    let affinity = given.get("prefix_affinity").and_then(Value::as_bool);
    match &c.prefix {
        None => {
            assert!(
                (header && !vllm) || affinity == Some(false),
                "affinity off without asking"
            );
            let tuning = given
                .keys()
                .filter(|k| k.starts_with("prefix_") && *k != "prefix_affinity");
            for k in tuning {
                assert!(
                    given.get(k).is_none_or(Value::is_null),
                    "`{k}` accepted with affinity off"
                );
            }
        }
        Some(p) => {
            assert!(
                !header || vllm || affinity == Some(true),
                "affinity on in header mode without asking"
            );
            assert_ne!(affinity, Some(false));
            if let Some(v) = num("prefix_block_bytes") {
                assert_eq!(u64::from(p.block_bytes), v);
            }
            if let Some(v) = num("prefix_ttl_ms") {
                assert_eq!(p.ttl_ms, v);
            }
            if let Some(v) = num("prefix_capacity_tokens") {
                assert_eq!(p.capacity_tokens, Some(v));
            }
            if let Some(v) = given.get("prefix_uncached_weight").and_then(Value::as_f64) {
                assert_eq!(p.uncached_weight, v);
            }
        }
    }
    // Passive health: on unless `enabled: false`; its numbers as written.
    let health = given.get("passive_health");
    let field = |k: &str| health.and_then(|h| h.get(k));
    match &c.passive_health {
        None => assert_eq!(field("enabled"), Some(&json!(false))),
        Some(h) => {
            assert_ne!(field("enabled"), Some(&json!(false)));
            if let Some(v) = field("consecutive_failures").and_then(Value::as_u64) {
                assert_eq!(u64::from(h.consecutive_failures), v);
            }
            if let Some(v) = field("cooldown_ms").and_then(Value::as_u64) {
                assert_eq!(h.cooldown_ms, v);
            }
            assert!(h.probe_share > 0.0 && h.probe_share <= 1.0 && h.cooldown_ms <= h.max_cooldown_ms);
        }
    }
    let pd_only = [
        "prefill_cluster",
        "prefill_timeout_ms",
        "prefill_rank_field",
        "decode_rank_field",
        "decode_prefill_rank_field",
    ];
    if c.pd().is_none() {
        for k in pd_only {
            assert!(
                given.get(k).is_none_or(Value::is_null),
                "`{k}` accepted outside PD mode"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data, "raw");

    let mut u = Unstructured::new(data);
    let Ok(given) = generate(&mut u) else { return };
    check(&serde_json::to_vec(&given).expect("config JSON"), "generated");
});
