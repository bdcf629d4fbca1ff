//! Overload protection's settings (`admission`, docs/overload.md): the
//! block as users write it, its defaults and its validation. Off unless the
//! block is present.

use crate::headers::is_lowercase_header_name;
use serde::{Deserialize, Serialize};

/// A rank whose expected wait is above this is saturated (ms).
pub const DEFAULT_MAX_WAIT_MS: u64 = 1000;
/// The rate a rank's waiting prompt tokens are taken to start at until its
/// polls have shown how fast its queue really drains (tokens per second).
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 10_000.0;
pub const DEFAULT_MAX_QUEUED: u32 = 256;
pub const DEFAULT_QUEUE_TIMEOUT_MS: u64 = 10_000;
pub const DEFAULT_PRIORITY_HEADER: &str = "x-dprank-priority";
/// The Inference Extension's names for its criticality bands, highest first.
pub const DEFAULT_CLASSES: [&str; 3] = ["critical", "standard", "sheddable"];
pub const DEFAULT_CLASS: &str = "standard";
pub const DEFAULT_SHEDDABLE_CLASS: &str = "sheddable";
/// Most held requests allowed (bounds the shared record and memory).
pub const MAX_MAX_QUEUED: u32 = 100_000;
/// Most classes (they are counted per class in shared data).
pub const MAX_CLASSES: usize = 8;
/// Most `max_requests_per_rank` accepted.
pub const MAX_REQUESTS_PER_RANK: u64 = 1_000_000;
/// Longest `max_wait_ms` and `queue_timeout_ms` accepted (10 minutes).
pub const MAX_WAIT_LIMIT_MS: u64 = 600_000;

/// Longest `slo.tpot_ms` accepted (ms).
pub const MAX_TPOT_TARGET_MS: u64 = 60_000;

/// SLO admission's targets (`admission.slo`), for the default class: what
/// each rank's limits are learned against (`worker_state/slo.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SloTargets {
    /// Time to first token (ms).
    pub ttft_ms: u64,
    /// Time per output token: the mean gap between streamed chunks (ms).
    pub tpot_ms: u64,
}

/// What happens to a request when every candidate rank is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenSaturatedJson {
    Reject,
    Queue,
}

/// The `admission` block as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionJson {
    #[serde(default)]
    pub max_wait_ms: Option<u64>,
    /// The default class's targets: limits learned per rank from the
    /// answers (`max_wait_ms` and `max_requests_per_rank` become caps).
    #[serde(default)]
    pub slo: Option<SloTargets>,
    #[serde(default)]
    pub when_saturated: Option<WhenSaturatedJson>,
    #[serde(default)]
    pub max_queued: Option<u32>,
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
    #[serde(default)]
    pub prefill_tokens_per_s: Option<f64>,
    #[serde(default)]
    pub learn_drain_rate: Option<bool>,
    #[serde(default)]
    pub max_kv_usage: Option<f64>,
    #[serde(default)]
    pub max_requests_per_rank: Option<u64>,
    #[serde(default)]
    pub priority_header: Option<String>,
    #[serde(default)]
    pub classes: Option<Vec<String>>,
    #[serde(default)]
    pub default_class: Option<String>,
    /// A class name, or null for none.
    #[serde(default, deserialize_with = "explicit_null")]
    pub sheddable_class: Option<Option<String>>,
    #[serde(default)]
    pub tenant_header: Option<String>,
    /// Per class name, its own `max_wait_ms`.
    #[serde(default)]
    pub class_max_wait_ms: Option<std::collections::BTreeMap<String, u64>>,
    /// Per class name, its own `max_requests_per_rank`.
    #[serde(default)]
    pub class_max_requests_per_rank: Option<std::collections::BTreeMap<String, u64>>,
    /// Per class name, the `priority` its routed requests carry to the
    /// server (SGLang's priority scheduling).
    #[serde(default)]
    pub server_priority: Option<std::collections::BTreeMap<String, i64>>,
}

/// Tells `"key": null` (Some(None)) from a missing key (None).
fn explicit_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// When every candidate is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenSaturated {
    /// Answer 429 at once.
    Reject,
    /// Hold the request in the filter until a rank has room, at most
    /// `timeout_ms`, with at most `max_queued` held over every thread.
    Queue { max_queued: u32, timeout_ms: u64 },
}

/// Overload protection (`admission`): which requests are let in when the
/// ranks' queues are long, and what the others get.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Admission {
    pub max_wait_ms: u64,
    /// SLO admission's targets for the default class (None: limits as set).
    pub slo: Option<SloTargets>,
    pub when_saturated: WhenSaturated,
    /// Tokens per second a rank's queue drains at before any is learned.
    pub prefill_tokens_per_s: f64,
    /// Learn each rank's drain rate from its polls.
    pub learn_drain_rate: bool,
    /// A rank reporting this share of its KV in use or more is saturated.
    pub max_kv_usage: Option<f64>,
    /// A rank with this many requests on it (running as reported, waiting,
    /// routed since) is saturated for the highest class; see
    /// `class_max_requests`.
    pub max_requests_per_rank: Option<u64>,
    pub priority_header: String,
    /// Highest first.
    pub classes: Vec<String>,
    /// Index in `classes` of requests without a known class.
    pub default_class: usize,
    /// Index of the class refused at once when saturated (the lowest).
    pub sheddable_class: Option<usize>,
    /// Round robin across the tenants this header names, within a class.
    pub tenant_header: Option<String>,
    /// Per class, the expected wait past which it finds a rank saturated:
    /// `max_wait_ms` for the default class and below, twice as much per
    /// class above it, unless `class_max_wait_ms` says otherwise.
    pub class_max_wait_ms: Vec<u64>,
    /// Per class, the requests on a rank at which it finds the rank full:
    /// `max_requests_per_rank` for the highest class, a quarter of it less
    /// per class below down to a quarter (room kept for the classes
    /// above), unless
    /// `class_max_requests_per_rank` says otherwise; None: no such limit.
    pub class_max_requests: Vec<Option<u64>>,
    /// Per class, the `priority` its routed requests carry to the server;
    /// None: dprank leaves the server's priority alone.
    pub server_priority: Option<Vec<Option<i64>>>,
}

impl Admission {
    /// The class of a request whose priority header holds `value` (exact
    /// name; anything else is the default class).
    pub fn class_of(&self, value: Option<&str>) -> usize {
        value
            .and_then(|v| self.classes.iter().position(|c| c == v.trim()))
            .unwrap_or(self.default_class)
    }

    /// The expected wait past which a request of `class` finds a rank saturated.
    pub fn max_wait_ms_of(&self, class: usize) -> u64 {
        self.class_max_wait_ms
            .get(class)
            .copied()
            .unwrap_or(self.max_wait_ms)
    }

    /// The requests on a rank at which a request of `class` finds it full.
    pub fn max_requests_of(&self, class: usize) -> Option<u64> {
        self.class_max_requests.get(class).copied().flatten()
    }

    /// What a routed request of `class` tells the server as its priority:
    /// None when `server_priority` is not set (dprank leaves it alone),
    /// Some(None) when the class has no value there (the client's own is
    /// removed: with `server_priority` set, the gateway decides).
    pub fn server_priority_of(&self, class: usize) -> Option<Option<i64>> {
        self.server_priority
            .as_ref()
            .map(|values| values.get(class).copied().flatten())
    }

    /// The name of `class` ("" if there is no such class).
    pub fn class_name(&self, class: usize) -> &str {
        self.classes.get(class).map_or("", String::as_str)
    }

    pub fn is_sheddable(&self, class: usize) -> bool {
        self.sheddable_class == Some(class)
    }

    pub fn queues(&self) -> bool {
        matches!(self.when_saturated, WhenSaturated::Queue { .. })
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> super::ConfigError {
    super::ConfigError::Invalid {
        key: format!("admission.{field}"),
        reason: reason.into(),
    }
}

/// Validates the `admission` block; `taken` are header names other keys
/// already use (route, pin, rank headers), which the priority and tenant
/// headers must not be.
pub fn settings(
    json: Option<AdmissionJson>,
    taken: &[&str],
) -> Result<Option<Admission>, super::ConfigError> {
    let Some(json) = json else {
        return Ok(None);
    };
    if let Some(slo) = &json.slo {
        one_to_for("slo.ttft_ms", slo.ttft_ms, MAX_WAIT_LIMIT_MS)?;
        one_to_for("slo.tpot_ms", slo.tpot_ms, MAX_TPOT_TARGET_MS)?;
    }
    // With targets, an unset wait cap is the TTFT target: a rank whose
    // queue alone would take longer cannot meet it.
    let max_wait_ms = json
        .max_wait_ms
        .unwrap_or(json.slo.map_or(DEFAULT_MAX_WAIT_MS, |s| s.ttft_ms));
    one_to_for("max_wait_ms", max_wait_ms, MAX_WAIT_LIMIT_MS)?;
    let when_saturated = when_saturated(&json)?;
    let rate = json.prefill_tokens_per_s.unwrap_or(DEFAULT_PREFILL_TOKENS_PER_S);
    if !(rate.is_finite() && (1.0..=1e9).contains(&rate)) {
        return Err(invalid(
            "prefill_tokens_per_s",
            format!("must be a number in 1..=1e9, got {rate}"),
        ));
    }
    if let Some(kv) = json.max_kv_usage {
        if !(kv.is_finite() && kv > 0.0 && kv <= 1.0) {
            return Err(invalid(
                "max_kv_usage",
                format!("must be above 0 and at most 1, got {kv}"),
            ));
        }
    }
    if let Some(n) = json.max_requests_per_rank {
        one_to_for("max_requests_per_rank", n, MAX_REQUESTS_PER_RANK)?;
    }
    let priority_header = header(
        "priority_header",
        json.priority_header
            .clone()
            .unwrap_or_else(|| DEFAULT_PRIORITY_HEADER.to_string()),
        taken,
    )?;
    let tenant_header = match json.tenant_header.clone() {
        Some(h) => {
            let h = header("tenant_header", h, taken)?;
            if h == priority_header {
                return Err(invalid("tenant_header", "must differ from priority_header"));
            }
            Some(h)
        }
        None => None,
    };
    let (classes, default_class, sheddable_class) = classes(&json)?;
    let class_max_wait_ms = class_waits(&json, &classes, default_class, max_wait_ms)?;
    let class_max_requests = class_requests(&json, &classes)?;
    let server_priority = server_priority(&json, &classes)?;
    Ok(Some(Admission {
        max_wait_ms,
        slo: json.slo,
        when_saturated,
        prefill_tokens_per_s: rate,
        learn_drain_rate: json.learn_drain_rate.unwrap_or(true),
        max_kv_usage: json.max_kv_usage,
        max_requests_per_rank: json.max_requests_per_rank,
        priority_header,
        classes,
        default_class,
        sheddable_class,
        tenant_header,
        class_max_wait_ms,
        class_max_requests,
        server_priority,
    }))
}

/// Most `server_priority` magnitude accepted (a 32-bit integer: what
/// every server reads without surprise).
pub const MAX_SERVER_PRIORITY: i64 = i32::MAX as i64;

/// Each class's server priority, by `server_priority`'s names.
fn server_priority(
    json: &AdmissionJson,
    classes: &[String],
) -> Result<Option<Vec<Option<i64>>>, super::ConfigError> {
    let Some(map) = json.server_priority.as_ref() else {
        return Ok(None);
    };
    let within = |value: i64| {
        if value.unsigned_abs() <= MAX_SERVER_PRIORITY as u64 {
            Ok(())
        } else {
            Err(format!("must be within ±{MAX_SERVER_PRIORITY}, got {value}"))
        }
    };
    let mut values = vec![None; classes.len()];
    for (c, value) in class_overrides("server_priority", Some(map), classes, within)? {
        values[c] = Some(value);
    }
    Ok(Some(values))
}

/// Each class's request limit: `max_requests_per_rank` for the highest,
/// a quarter of it less per class below, down to a quarter (at least 1), or as
/// `class_max_requests_per_rank` names it.
fn class_requests(json: &AdmissionJson, classes: &[String]) -> Result<Vec<Option<u64>>, super::ConfigError> {
    let mut limits: Vec<Option<u64>> = (0..classes.len())
        .map(|c| {
            json.max_requests_per_rank.map(|max| {
                let kept = max.saturating_mul(c.min(3) as u64) / 4;
                max.saturating_sub(kept).max(1)
            })
        })
        .collect();
    let overrides = json.class_max_requests_per_rank.as_ref();
    for (c, n) in class_overrides(
        "class_max_requests_per_rank",
        overrides,
        classes,
        one_to(MAX_REQUESTS_PER_RANK),
    )? {
        limits[c] = Some(n);
    }
    Ok(limits)
}

/// Each class's wait limit: `max_wait_ms` from the default class down,
/// doubled per class above it (capped), or as `class_max_wait_ms` names it.
fn class_waits(
    json: &AdmissionJson,
    classes: &[String],
    default_class: usize,
    max_wait_ms: u64,
) -> Result<Vec<u64>, super::ConfigError> {
    let mut waits: Vec<u64> = (0..classes.len())
        .map(|c| {
            let above = default_class.saturating_sub(c) as u32;
            max_wait_ms
                .saturating_mul(1u64 << above.min(16))
                .min(MAX_WAIT_LIMIT_MS)
        })
        .collect();
    let overrides = json.class_max_wait_ms.as_ref();
    for (c, ms) in class_overrides("class_max_wait_ms", overrides, classes, one_to(MAX_WAIT_LIMIT_MS))? {
        waits[c] = ms;
    }
    Ok(waits)
}

/// A per-class map as written (`class_max_wait_ms`,
/// `class_max_requests_per_rank`, `server_priority`): each entry's class
/// index and value, every name one of `classes` and every value one
/// `check` accepts (else its reason).
fn class_overrides<T: Copy>(
    key: &str,
    overrides: Option<&std::collections::BTreeMap<String, T>>,
    classes: &[String],
    check: impl Fn(T) -> Result<(), String>,
) -> Result<Vec<(usize, T)>, super::ConfigError> {
    overrides
        .into_iter()
        .flatten()
        .map(|(name, value)| {
            let Some(c) = classes.iter().position(|c| c == name) else {
                return Err(invalid(
                    key,
                    format!("`{name}` is not one of `classes` {classes:?}"),
                ));
            };
            check(*value).map_err(|reason| invalid(key, format!("`{name}`: {reason}")))?;
            Ok((c, *value))
        })
        .collect()
}

/// `class_overrides`' check of a value in 1..=`max`.
/// `value` of `admission.<key>` is within 1..=`max`, else the error naming it.
fn one_to_for(key: &str, value: u64, max: u64) -> Result<(), super::ConfigError> {
    one_to(max)(value).map_err(|reason| invalid(key, reason))
}

fn one_to(max: u64) -> impl Fn(u64) -> Result<(), String> {
    move |value| {
        if (1..=max).contains(&value) {
            Ok(())
        } else {
            Err(format!("must be 1..={max}, got {value}"))
        }
    }
}

fn when_saturated(json: &AdmissionJson) -> Result<WhenSaturated, super::ConfigError> {
    match json.when_saturated.unwrap_or(WhenSaturatedJson::Reject) {
        WhenSaturatedJson::Reject => {
            for (key, set) in [
                ("max_queued", json.max_queued.is_some()),
                ("queue_timeout_ms", json.queue_timeout_ms.is_some()),
            ] {
                if set {
                    return Err(invalid(key, "applies to when_saturated: queue only"));
                }
            }
            Ok(WhenSaturated::Reject)
        }
        WhenSaturatedJson::Queue => {
            let max_queued = json.max_queued.unwrap_or(DEFAULT_MAX_QUEUED);
            one_to_for("max_queued", max_queued.into(), MAX_MAX_QUEUED.into())?;
            let timeout_ms = json.queue_timeout_ms.unwrap_or(DEFAULT_QUEUE_TIMEOUT_MS);
            one_to_for("queue_timeout_ms", timeout_ms, MAX_WAIT_LIMIT_MS)?;
            Ok(WhenSaturated::Queue {
                max_queued,
                timeout_ms,
            })
        }
    }
}

fn header(key: &str, name: String, taken: &[&str]) -> Result<String, super::ConfigError> {
    if !is_lowercase_header_name(&name) {
        return Err(invalid(key, format!("`{name}` is not a lowercase header name")));
    }
    if taken.contains(&name.as_str()) {
        return Err(invalid(
            key,
            format!("`{name}` is a header dprank sets or removes itself"),
        ));
    }
    Ok(name)
}

type Classes = (Vec<String>, usize, Option<usize>);

/// The classes (highest first), the default's index and the sheddable's.
fn classes(json: &AdmissionJson) -> Result<Classes, super::ConfigError> {
    let custom = json.classes.is_some();
    let classes = json
        .classes
        .clone()
        .unwrap_or_else(|| DEFAULT_CLASSES.map(str::to_string).to_vec());
    if classes.is_empty() || classes.len() > MAX_CLASSES {
        return Err(invalid(
            "classes",
            format!("list 1..={MAX_CLASSES} class names, highest first"),
        ));
    }
    for (i, c) in classes.iter().enumerate() {
        let plain = !c.is_empty()
            && c.len() <= 64
            && c.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !plain {
            return Err(invalid(
                "classes",
                format!("`{c}` may only hold letters, digits, '-' and '_' (at most 64; it names stats)"),
            ));
        }
        if classes[..i].contains(c) {
            return Err(invalid("classes", format!("`{c}` is listed twice")));
        }
    }
    let find = |key: &str, name: &str| {
        classes
            .iter()
            .position(|c| c == name)
            .ok_or_else(|| invalid(key, format!("`{name}` is not one of `classes` {classes:?}")))
    };
    let default_class = match &json.default_class {
        Some(name) => find("default_class", name)?,
        None if custom => {
            return Err(invalid(
                "default_class",
                "required with custom `classes`: the class of requests without a known one",
            ))
        }
        None => find("default_class", DEFAULT_CLASS)?,
    };
    let sheddable_class = match &json.sheddable_class {
        Some(Some(name)) => Some(find("sheddable_class", name)?),
        Some(None) => None,
        None if custom => None,
        None => Some(find("sheddable_class", DEFAULT_SHEDDABLE_CLASS)?),
    };
    if let Some(s) = sheddable_class {
        if s + 1 != classes.len() {
            return Err(invalid(
                "sheddable_class",
                "must be the last (lowest) of `classes`",
            ));
        }
        if s == default_class {
            return Err(invalid(
                "sheddable_class",
                "must differ from default_class (requests without a class would all be shed)",
            ));
        }
    }
    Ok((classes, default_class, sheddable_class))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn with(admission: &str) -> Result<Config, String> {
        Config::from_json(
            format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}],"admission":{admission}}}"#).as_bytes(),
        )
        .map_err(|e| e.to_string())
    }

    /// The `"admission": {...}` block of the first JSON example after
    /// `heading` in `doc`.
    fn documented_block(doc: &str, heading: &str) -> String {
        let from = doc.find(heading).expect("heading");
        let rest = &doc[from..];
        let start = rest.find("```json\n").expect("a JSON example") + "```json\n".len();
        let end = rest[start..].find("```").expect("its end");
        let block = rest[start..start + end].trim();
        block
            .strip_prefix("\"admission\":")
            .expect("an admission block")
            .trim()
            .to_string()
    }

    #[test]
    fn the_recommended_setting_in_the_docs_is_valid() {
        for (doc, heading) in [
            (include_str!("../../docs/overload.md"), "## Recommended setting"),
            (include_str!("../../README.md"), "## Overload"),
        ] {
            let block = documented_block(doc, heading);
            let settings = with(&block).unwrap_or_else(|e| panic!("{heading}: {e}"));
            let admission = settings.admission.expect("on");
            assert!(!admission.queues(), "{heading}: reject mode");
            assert!(admission.learn_drain_rate);
        }
    }

    #[test]
    fn off_unless_the_block_is_present_and_defaults_documented() {
        let off = Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}]}"#).unwrap();
        assert!(off.admission.is_none());
        let on = with("{}").unwrap().admission.unwrap();
        assert_eq!(on.max_wait_ms, super::DEFAULT_MAX_WAIT_MS);
        assert_eq!(on.when_saturated, super::WhenSaturated::Reject);
        assert_eq!(on.classes, ["critical", "standard", "sheddable"]);
        assert_eq!((on.default_class, on.sheddable_class), (1, Some(2)));
        assert_eq!(on.priority_header, "x-dprank-priority");
        assert!(on.learn_drain_rate && on.tenant_header.is_none() && on.max_kv_usage.is_none());
        assert!(on.max_requests_per_rank.is_none());
        let capped = with(r#"{"max_requests_per_rank":48}"#)
            .unwrap()
            .admission
            .unwrap();
        assert_eq!(capped.max_requests_per_rank, Some(48));
        assert_eq!(
            capped.class_max_requests,
            [Some(48), Some(36), Some(24)],
            "a quarter less per class below the highest"
        );
        assert_eq!(on.class_max_requests, [None, None, None]);
        let own = with(r#"{"max_requests_per_rank":48,"class_max_requests_per_rank":{"standard":48}}"#)
            .unwrap()
            .admission
            .unwrap();
        assert_eq!(own.max_requests_of(1), Some(48));
        assert_eq!(own.max_requests_of(5), None, "no such class");
        assert_eq!(on.class_of(Some("critical")), 0);
        assert_eq!(on.class_of(Some(" sheddable ")), 2);
        assert_eq!(on.class_of(Some("urgent")), 1, "unknown: the default");
        assert_eq!(on.class_of(None), 1);
        assert_eq!(
            (0..3).map(|c| on.max_wait_ms_of(c)).collect::<Vec<_>>(),
            [2000, 1000, 1000],
            "twice as long above the default class"
        );
        let own = with(r#"{"class_max_wait_ms":{"critical":5000,"sheddable":200}}"#)
            .unwrap()
            .admission
            .unwrap();
        assert_eq!(own.class_max_wait_ms, [5000, 1000, 200]);
        let queue = with(r#"{"when_saturated":"queue"}"#).unwrap().admission.unwrap();
        assert_eq!(
            queue.when_saturated,
            super::WhenSaturated::Queue {
                max_queued: 256,
                timeout_ms: 10_000
            }
        );
        assert!(queue.queues());
    }

    #[test]
    fn server_priority_is_per_class_and_off_by_default() {
        let off = with("{}").unwrap().admission.unwrap();
        assert_eq!(off.server_priority_of(0), None, "dprank leaves it alone");
        let on = with(r#"{"server_priority":{"critical":1,"sheddable":-1}}"#)
            .unwrap()
            .admission
            .unwrap();
        assert_eq!(on.server_priority_of(0), Some(Some(1)));
        assert_eq!(
            on.server_priority_of(1),
            Some(None),
            "no value: the client's is removed"
        );
        assert_eq!(on.server_priority_of(2), Some(Some(-1)));
        assert_eq!(on.server_priority_of(7), Some(None), "no such class");
    }

    #[test]
    fn custom_classes_need_a_default_and_shed_only_the_last() {
        let c = with(r#"{"classes":["hi","lo"],"default_class":"lo"}"#)
            .unwrap()
            .admission
            .unwrap();
        assert_eq!((c.default_class, c.sheddable_class), (1, None));
        let shed = with(r#"{"classes":["hi","mid","lo"],"default_class":"mid","sheddable_class":"lo"}"#)
            .unwrap()
            .admission
            .unwrap();
        assert!(shed.is_sheddable(2) && !shed.is_sheddable(1));
        let none = with(r#"{"sheddable_class":null}"#).unwrap().admission.unwrap();
        assert_eq!(none.sheddable_class, None);
    }

    #[test]
    fn bad_settings_name_their_key() {
        let cases = [
            (r#"{"max_wait_ms":0}"#, "admission.max_wait_ms"),
            (r#"{"max_queued":5}"#, "admission.max_queued"),
            (r#"{"queue_timeout_ms":5}"#, "admission.queue_timeout_ms"),
            (
                r#"{"when_saturated":"queue","max_queued":0}"#,
                "admission.max_queued",
            ),
            (
                r#"{"when_saturated":"queue","queue_timeout_ms":0}"#,
                "admission.queue_timeout_ms",
            ),
            (r#"{"prefill_tokens_per_s":0}"#, "admission.prefill_tokens_per_s"),
            (r#"{"max_kv_usage":1.5}"#, "admission.max_kv_usage"),
            (
                r#"{"max_requests_per_rank":0}"#,
                "admission.max_requests_per_rank",
            ),
            (r#"{"priority_header":"X-P"}"#, "admission.priority_header"),
            (
                r#"{"priority_header":"x-dprank-endpoint"}"#,
                "admission.priority_header",
            ),
            (
                r#"{"priority_header":"x-data-parallel-rank"}"#,
                "admission.priority_header",
            ),
            (
                r#"{"tenant_header":"x-dprank-priority"}"#,
                "admission.tenant_header",
            ),
            (r#"{"classes":[]}"#, "admission.classes"),
            (
                r#"{"classes":["a","a"],"default_class":"a"}"#,
                "admission.classes",
            ),
            (
                r#"{"classes":["a b"],"default_class":"a b"}"#,
                "admission.classes",
            ),
            (r#"{"classes":["a","b"]}"#, "admission.default_class"),
            (r#"{"default_class":"nope"}"#, "admission.default_class"),
            (r#"{"sheddable_class":"standard"}"#, "admission.sheddable_class"),
            (
                r#"{"classes":["a","b"],"default_class":"b","sheddable_class":"b"}"#,
                "admission.sheddable_class",
            ),
            (
                r#"{"class_max_wait_ms":{"vip":5}}"#,
                "admission.class_max_wait_ms",
            ),
            (
                r#"{"class_max_wait_ms":{"critical":0}}"#,
                "admission.class_max_wait_ms",
            ),
            (
                r#"{"class_max_requests_per_rank":{"vip":5}}"#,
                "admission.class_max_requests_per_rank",
            ),
            (
                r#"{"class_max_requests_per_rank":{"critical":0}}"#,
                "admission.class_max_requests_per_rank",
            ),
            (r#"{"server_priority":{"vip":1}}"#, "admission.server_priority"),
            (
                r#"{"server_priority":{"critical":4294967296}}"#,
                "admission.server_priority",
            ),
            (r#"{"server_priority":{"critical":1.5}}"#, "expected i64"),
            (r#"{"max_wait":5}"#, "unknown field"),
        ];
        for (block, key) in cases {
            let err = with(block).unwrap_err();
            assert!(err.contains(key), "{block}: {err}");
        }
    }
}
