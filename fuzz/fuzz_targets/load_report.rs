//! `parse_load_report` on arbitrary bytes, and on load reports generated from
//! the same bytes (`arbitrary`) in the shapes of PROTOCOL.md with token and
//! rank fields of every JSON type.
//!
//! Properties, raw bytes:
//! - never panics; `Ok` only for valid JSON, with 1..=MAX_DP_SIZE ranks; every
//!   known rank's tokens are a number that appears in the report;
//!   `RankOutOfRange(r)` only for r >= MAX_DP_SIZE.
//! Properties, generated reports (`/get_load` array, single object,
//! `/v1/loads` object, or something else), checked against a model:
//! - the result is exactly: rank = `dp_rank` when it is a non-negative JSON
//!   integer, the entry's position when `dp_rank` is absent/null, entry skipped
//!   otherwise; the first rank >= MAX_DP_SIZE is an error; tokens come from
//!   the first of num_total_tokens, num_tokens, num_used_tokens holding a
//!   usable count (non-negative integer, or non-negative finite float,
//!   rounded, saturating at u64::MAX); later entries for a rank win; ranks no
//!   entry names are unknown; no entries -> NoRanks; shapes that are not a
//!   report -> NotJson.
#![no_main]

use arbitrary::{Arbitrary, Result, Unstructured};
use dprank::config::MAX_DP_SIZE;
use dprank::load::{parse_load_report, LoadError};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const TOKEN_FIELDS: [&str; 3] = ["num_total_tokens", "num_tokens", "num_used_tokens"];
const EXTRA_FIELDS: [&str; 9] = [
    "num_reqs",
    "num_waiting_reqs",
    "num_running_reqs",
    "max_total_num_tokens",
    "token_usage",
    "ts_tic",
    "rid",
    "http_worker_ipc",
    "num_pending_tokens",
];

/// A JSON value of any type, biased towards the troublesome numbers.
#[derive(Debug)]
enum Val {
    Null,
    Bool(bool),
    Small(u16),
    U64(u64),
    Neg(i64),
    Float(f64),
    /// Number literals serde_json reads as something other than a u64.
    Literal(&'static str),
    Str(String),
    Array(Vec<u8>),
    Object,
}

const LITERALS: [&str; 14] = [
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "-0",
    "0.0",
    "-0.0",
    "12.0",
    "0.5",
    "2.5",
    "1e3",
    "4096",
    "4095",
    "1.8446744073709552e19",
    "1e300",
];

impl<'a> Arbitrary<'a> for Val {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        Ok(match u.int_in_range(0..=10)? {
            0 => Val::Null,
            1 => Val::Bool(u.arbitrary()?),
            2 | 3 => Val::Small(u.int_in_range(0..=4100)?),
            4 => Val::U64(u.arbitrary()?),
            5 => Val::Neg(u.int_in_range(i64::MIN..=-1)?),
            6 => {
                let f: f64 = u.arbitrary()?;
                Val::Float(if f.is_finite() { f } else { 1.5 })
            }
            7 => Val::Literal(*u.choose(&LITERALS)?),
            8 => Val::Str(u.arbitrary()?),
            9 => Val::Array(u.arbitrary::<Vec<u8>>()?.into_iter().take(3).collect()),
            _ => Val::Object,
        })
    }
}

impl Val {
    fn json(&self) -> String {
        match self {
            Val::Null => "null".into(),
            Val::Bool(b) => b.to_string(),
            Val::Small(n) => n.to_string(),
            Val::U64(n) => n.to_string(),
            Val::Neg(n) => n.to_string(),
            Val::Float(f) => serde_json::to_string(f).expect("finite"),
            Val::Literal(s) => s.to_string(),
            Val::Str(s) => serde_json::to_string(s).expect("string"),
            Val::Array(v) => serde_json::to_string(v).expect("array"),
            Val::Object => "{\"dp_rank\":1,\"num_tokens\":2}".into(),
        }
    }
}

/// Mostly a rank of a small worker, else a value of any type.
#[derive(Debug)]
struct Rank(Val);

impl<'a> Arbitrary<'a> for Rank {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        Ok(Rank(if u.ratio(3, 4)? { Val::Small(u.int_in_range(0..=7)?) } else { u.arbitrary()? }))
    }
}

#[derive(Debug, Arbitrary)]
struct Entry {
    dp_rank: Option<Rank>,
    tokens: [Option<Val>; 3],
    extras: Vec<(u8, Val)>,
    /// Order of the members in the text.
    shuffle: u64,
}

impl Entry {
    fn json(&self) -> String {
        let mut members: Vec<(String, String)> = Vec::new();
        if let Some(Rank(v)) = &self.dp_rank {
            members.push(("dp_rank".into(), v.json()));
        }
        for (name, v) in TOKEN_FIELDS.iter().zip(&self.tokens) {
            if let Some(v) = v {
                members.push((name.to_string(), v.json()));
            }
        }
        for (i, v) in &self.extras {
            let name = EXTRA_FIELDS[*i as usize % EXTRA_FIELDS.len()];
            if !members.iter().any(|(n, _)| n == name) {
                members.push((name.to_string(), v.json()));
            }
        }
        let mut s = self.shuffle;
        for i in (1..members.len()).rev() {
            members.swap(i, (s % (i as u64 + 1)) as usize);
            s = s.rotate_left(7) ^ 0x9E37_79B9_7F4A_7C15;
        }
        let body: Vec<String> = members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
        format!("{{{}}}", body.join(","))
    }
}

#[derive(Debug, Arbitrary)]
enum Report {
    /// `/get_load`: an array of per-rank objects.
    GetLoad(Entry, Vec<Entry>),
    Empty,
    /// `/get_load` on builds that answer with one object.
    Single(Entry),
    /// `/v1/loads`.
    V1 { loads: Vec<Entry>, dp_rank_count: Val, aggregate: bool },
    /// A JSON value that is not a report.
    Other(Other),
}

#[derive(Debug, Arbitrary)]
enum Other {
    Scalar(Val),
    LoadsNotArray(Val),
    Error(String),
}

impl Report {
    fn json(&self) -> String {
        let entries = |v: &[Entry]| v.iter().map(Entry::json).collect::<Vec<_>>().join(",");
        match self {
            Report::GetLoad(first, rest) => {
                let rest = entries(rest);
                format!("[{}{}{rest}]", first.json(), if rest.is_empty() { "" } else { "," })
            }
            Report::Empty => "[]".into(),
            Report::Single(e) => e.json(),
            Report::V1 { loads, dp_rank_count, aggregate } => format!(
                "{{\"timestamp\":\"2025-01-01T00:00:00Z\",\"version\":\"0.5\",\"dp_rank_count\":{},\"loads\":[{}]{}}}",
                dp_rank_count.json(),
                entries(loads),
                if *aggregate { ",\"aggregate\":{\"total_running_reqs\":3}" } else { "" }
            ),
            Report::Other(Other::Scalar(v)) => match v {
                // An object here would be a report of its own.
                Val::Object | Val::Array(_) => "\"x\"".into(),
                v => v.json(),
            },
            Report::Other(Other::LoadsNotArray(v)) => match v {
                Val::Array(_) => "{\"loads\":null}".into(),
                v => format!("{{\"loads\":{}}}", v.json()),
            },
            Report::Other(Other::Error(s)) => {
                format!("{{\"error\":{}}}", serde_json::to_string(s).expect("string"))
            }
        }
    }
}

/// PROTOCOL.md's count: a non-negative integer, or a non-negative finite float.
fn token_count(v: &Value) -> Option<u64> {
    let n = v.as_number()?;
    if let Some(u) = n.as_u64() {
        return Some(u);
    }
    let f = n.as_f64()?;
    if f.is_finite() && f >= 0.0 && f <= 18_446_744_073_709_551_616.0 {
        Some(if f >= 18_446_744_073_709_551_615.0 { u64::MAX } else { f.round() as u64 })
    } else {
        None
    }
}

fn present<'v>(entry: &'v Value, key: &str) -> Option<&'v Value> {
    entry.get(key).filter(|v| !v.is_null())
}

/// The expected result for a generated report, read from its Value.
fn model(doc: &Value) -> std::result::Result<Vec<Option<u64>>, LoadError> {
    let not_json = || LoadError::NotJson(String::new());
    let entries: Vec<&Value> = match doc {
        Value::Array(a) => a.iter().collect(),
        Value::Object(o) => match o.get("loads") {
            Some(Value::Array(a)) => a.iter().collect(),
            Some(_) => return Err(not_json()),
            None => {
                let looks = ["dp_rank"].iter().chain(&TOKEN_FIELDS).any(|k| present(doc, k).is_some());
                if !looks {
                    return Err(not_json());
                }
                vec![doc]
            }
        },
        _ => return Err(not_json()),
    };
    if entries.is_empty() {
        return Err(LoadError::NoRanks);
    }
    let mut ranks = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let rank = match present(e, "dp_rank") {
            None => i as u64,
            Some(v) => match v.as_u64() {
                Some(r) => r,
                None => continue,
            },
        };
        if rank >= u64::from(MAX_DP_SIZE) {
            return Err(LoadError::RankOutOfRange(rank));
        }
        let rank = rank as usize;
        if ranks.len() <= rank {
            ranks.resize(rank + 1, None);
        }
        ranks[rank] = TOKEN_FIELDS.iter().find_map(|k| present(e, k).and_then(token_count));
    }
    if ranks.is_empty() {
        return Err(LoadError::NoRanks);
    }
    Ok(ranks)
}

fn numbers(v: &Value, out: &mut Vec<u64>) {
    match v {
        Value::Number(_) => out.extend(token_count(v)),
        Value::Array(a) => a.iter().for_each(|v| numbers(v, out)),
        Value::Object(o) => o.values().for_each(|v| numbers(v, out)),
        _ => {}
    }
}

fn check_raw(data: &[u8]) {
    match parse_load_report(data) {
        Ok(ranks) => {
            assert!(!ranks.is_empty() && ranks.len() <= MAX_DP_SIZE as usize, "{} ranks", ranks.len());
            let doc: Value = serde_json::from_slice(data).expect("Ok for invalid JSON");
            let mut seen = Vec::new();
            numbers(&doc, &mut seen);
            for t in ranks.iter().flatten() {
                assert!(seen.contains(t), "tokens {t} are not a number of the report");
            }
        }
        Err(LoadError::RankOutOfRange(r)) => assert!(r >= u64::from(MAX_DP_SIZE)),
        Err(LoadError::NoRanks | LoadError::NotJson(_)) => {}
    }
}

fn check_generated(data: &[u8]) {
    let u = Unstructured::new(data);
    let Ok(report) = Report::arbitrary_take_rest(u) else { return };
    let text = report.json();
    let got = parse_load_report(text.as_bytes());
    let want = match serde_json::from_str::<Value>(&text) {
        Ok(doc) => model(&doc),
        // Numbers serde_json cannot hold make the whole report unreadable.
        Err(_) => Err(LoadError::NotJson(String::new())),
    };
    if std::env::var_os("DPRANK_FUZZ_TRACE").is_some() {
        eprintln!("TRACE {text}\nTRACE => {got:?}");
    }
    let same = match (&got, &want) {
        (Err(LoadError::NotJson(_)), Err(LoadError::NotJson(_))) => true,
        (g, w) => g == w,
    };
    assert!(same, "report {text}\n got {got:?}\nwant {want:?}");
}

fuzz_target!(|data: &[u8]| {
    check_raw(data);
    check_generated(data);
});
