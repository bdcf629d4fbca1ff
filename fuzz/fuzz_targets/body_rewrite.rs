//! `JsonObject::parse` and `with_fields` on arbitrary bytes.
//!
//! The oracles are serde_json's own readings of the same bytes, never a
//! re-implementation of body.rs:
//! - `parse` never panics; it succeeds exactly on the inputs serde_json reads
//!   as a JSON object;
//! - its fields are serde_json's top-level members in order (escapes
//!   decoded), each value range holding the text serde_json's `RawValue`
//!   points at; `raw_value` is the last duplicate's;
//! - prompt sizes equal those read from `serde_json::Value`s of the prompt
//!   keys: every string's UTF-8 bytes and whitespace-separated words, every
//!   integer one token id;
//! - `with_fields(set)` gives a JSON object whose members, as Values, are the
//!   input's with `set` applied (last duplicate wins on both sides);
//! - every other byte is kept: cutting the values of the keys in `set` out of
//!   the input and out of the output (where serde_json says they are) leaves
//!   the same bytes, except the absent keys written right after the opening
//!   brace.
//!
//! Two sets are spliced into every input that parses: the single rank field
//! the regular router writes, and a PD-like set (string, array and null
//! values) that also overwrites one of the input's own keys.
#![no_main]

use dprank::body::JsonObject;
use dprank::config::CostEstimate;
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;

/// The top-level members of a JSON object, in order, duplicates kept.
struct Pairs<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Pairs<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Pairs<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut pairs = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    pairs.push((k, map.next_value::<&'de RawValue>()?));
                }
                Ok(Pairs(pairs))
            }
        }
        d.deserialize_map(V)
    }
}

/// Sizes of the prompt values read from serde_json Values.
#[derive(Default, Debug, PartialEq)]
struct Sizes {
    bytes: u64,
    words: u64,
    ids: u64,
}

fn add_sizes(v: &Value, sizes: &mut Sizes) {
    match v {
        Value::String(s) => {
            sizes.bytes += s.len() as u64;
            sizes.words += s.split_whitespace().count() as u64;
        }
        Value::Number(n) if n.is_i64() || n.is_u64() => sizes.ids += 1,
        Value::Array(a) => a.iter().for_each(|v| add_sizes(v, sizes)),
        Value::Object(o) => o.values().for_each(|v| add_sizes(v, sizes)),
        _ => {}
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// `bytes` with the values of the top-level keys in `cut` removed, at the
/// places serde_json's `RawValue`s point at.
fn skeleton(bytes: &[u8], pairs: &Pairs, cut: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    for (k, raw) in &pairs.0 {
        if cut.contains(&k.as_str()) {
            let start = raw.get().as_ptr() as usize - bytes.as_ptr() as usize;
            out.extend_from_slice(&bytes[at..start]);
            at = start + raw.get().len();
        }
    }
    out.extend_from_slice(&bytes[at..]);
    out
}

/// The object as serde_json Values, last duplicate winning; None when a
/// value does not fit a Value (a number out of f64 range).
///
/// The top level is built here rather than read as one Value: with serde_json's
/// raw_value feature, `{"$serde_json::private::RawValue":"1"}` reads as the
/// number 1 (serde_json's own marker key), though it is an object.
fn value_map(pairs: &Pairs) -> Option<Map<String, Value>> {
    let mut map = Map::new();
    for (k, raw) in &pairs.0 {
        map.insert(k.clone(), serde_json::from_str(raw.get()).ok()?);
    }
    Some(map)
}

fn check_splice(
    data: &[u8],
    open: usize,
    pairs: &Pairs,
    input: Option<&Map<String, Value>>,
    obj: &JsonObject,
    set: &[(&str, &str)],
) {
    let out = obj.with_fields(set);
    let out_pairs: Pairs = serde_json::from_slice(&out).expect("output is a JSON object");
    let keys: Vec<&str> = set.iter().map(|(k, _)| *k).collect();
    // Every other byte kept: the absent keys go right after the brace.
    let inserted: Vec<String> = set
        .iter()
        .filter(|(k, _)| !pairs.0.iter().any(|(pk, _)| pk == k))
        .map(|(k, _)| format!("\"{k}\":"))
        .collect();
    let before = skeleton(data, pairs, &keys);
    let mut want = before[..=open].to_vec();
    want.extend_from_slice(inserted.join(",").as_bytes());
    if !inserted.is_empty() && !pairs.0.is_empty() {
        want.push(b',');
    }
    want.extend_from_slice(&before[open + 1..]);
    let after = skeleton(&out, &out_pairs, &keys);
    assert!(
        after == want,
        "bytes outside the set values differ\n input: {:?}\n   set: {set:?}\n   got: {:?}",
        String::from_utf8_lossy(data),
        String::from_utf8_lossy(&out),
    );

    // The output is JSON, and as a Value it is the input with `set` applied.
    serde_json::from_slice::<IgnoredAny>(&out).expect("output is not JSON");
    if let Some(map) = input {
        let mut want = map.clone();
        for (k, v) in set {
            want.insert(k.to_string(), serde_json::from_str(v).expect("test value"));
        }
        let got = value_map(&out_pairs).expect("output values");
        assert_eq!(got, want, "output Value != input Value + fields");
    }

    // Parsing the output again: inserted keys first, then the input's keys,
    // each with the value that was set or the one the client sent.
    let again = JsonObject::parse(&out).expect("output parses as a JsonObject");
    let mut want: Vec<(String, Vec<u8>)> = set
        .iter()
        .filter(|(k, _)| !pairs.0.iter().any(|(pk, _)| pk == k))
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect();
    for (k, raw) in &pairs.0 {
        let v = match set.iter().find(|(sk, _)| sk == k) {
            Some((_, v)) => v.as_bytes().to_vec(),
            None => raw.get().as_bytes().to_vec(),
        };
        want.push((k.clone(), v));
    }
    let got: Vec<(String, Vec<u8>)> = again
        .fields
        .iter()
        .map(|f| (f.key.to_string(), out[f.value.clone()].to_vec()))
        .collect();
    assert_eq!(got, want, "re-parsed output fields");
    for (k, v) in set {
        assert_eq!(again.raw_value(k), Some(v.as_bytes()));
    }
}

fuzz_target!(|data: &[u8]| {
    let parsed = JsonObject::parse(data);
    // The independent pass: the members of a JSON object, or an error.
    let pairs = serde_json::from_slice::<Pairs>(data);

    let obj = match parsed {
        Ok(obj) => obj,
        Err(_) => {
            assert!(
                pairs.is_err(),
                "serde_json reads a JSON object but parse failed: {:?}",
                String::from_utf8_lossy(data)
            );
            return;
        }
    };

    // Only valid JSON objects parse.
    serde_json::from_slice::<IgnoredAny>(data).expect("parse accepted invalid JSON");
    let pairs = pairs.expect("parse accepted something other than an object");
    let value = value_map(&pairs);
    let open = data.iter().position(|b| !is_ws(*b)).expect("empty input parsed");
    assert_eq!(data[open], b'{');

    // Fields and value ranges against the independent pass.
    assert_eq!(obj.fields.len(), pairs.0.len());
    let mut prev_end = open + 1;
    for (field, (key, raw)) in obj.fields.iter().zip(&pairs.0) {
        assert_eq!(field.key.as_ref(), key.as_str());
        assert!(field.value.start >= prev_end && field.value.end <= data.len());
        assert_eq!(
            &data[field.value.clone()],
            raw.get().as_bytes(),
            "value range of {key:?}"
        );
        prev_end = field.value.end;
    }
    for (key, raw) in &pairs.0 {
        let last = pairs
            .0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, r)| r.get().as_bytes());
        assert_eq!(obj.raw_value(key), last);
        assert!(obj.has_any(&[key.as_str()]));
        let _ = raw;
    }
    // Prompt sizes: the Values under text / prompt / messages / input_ids
    // (when serde_json can hold them all: a value nested beyond its depth
    // limit stops body.rs's count early and is not compared).
    // A Value keeps one of duplicate keys in nested objects where body.rs
    // counts them all: the Values give a lower bound for the body as sent,
    // and the exact sizes of the same prompts written again from the Values.
    let prompts: Option<Vec<(&str, Value)>> = pairs
        .0
        .iter()
        .filter(|(k, _)| ["text", "prompt", "messages", "input_ids"].contains(&k.as_str()))
        // serde_json's RawValue marker key reads as a number in a Value.
        .map(|(k, raw)| {
            let v = serde_json::from_str(raw.get())
                .ok()
                .filter(|_| !raw.get().contains("$serde_json"));
            v.map(|v| (k.as_str(), v))
        })
        .collect();
    let p = obj.prompt_size(true);
    if let Some(prompts) = prompts {
        let mut want = Sizes::default();
        prompts.iter().for_each(|(_, v)| add_sizes(v, &mut want));
        assert!(
            p.bytes >= want.bytes && p.words >= want.words && p.token_ids >= want.ids,
            "prompt size below the Values'"
        );
        let members: Vec<String> = prompts
            .iter()
            .map(|(k, v)| format!("{}:{v}", Value::from(*k)))
            .collect();
        let rebuilt = format!("{{{}}}", members.join(","));
        if let Ok(again) = JsonObject::parse(rebuilt.as_bytes()) {
            let q = again.prompt_size(true);
            assert_eq!(
                Sizes {
                    bytes: q.bytes,
                    words: q.words,
                    ids: q.token_ids
                },
                want,
                "prompt size of {rebuilt}"
            );
        }
    }
    assert_eq!(
        obj.prompt_size(false).words,
        0,
        "words are counted only when asked"
    );
    for how in [CostEstimate::Bytes, CostEstimate::Words, CostEstimate::One] {
        assert!(obj.estimated_tokens(how) >= 1);
    }

    // The regular router's single rank field.
    check_splice(
        data,
        open,
        &pairs,
        value.as_ref(),
        &obj,
        &[("routed_dp_rank", "3")],
    );

    // A PD-like set that also overwrites one of the client's keys.
    let mut set: Vec<(&str, &str)> = vec![
        ("routed_dp_rank", "0"),
        ("bootstrap_host", "\"10.0.0.1\""),
        ("bootstrap_port", "null"),
        ("bootstrap_room", "[9223372036854775807,0]"),
        ("disagg_prefill_dp_rank", "12"),
        ("note", "\"a \\\"quoted\\\" \\u00e9 \\n value\""),
    ];
    if let Some((k, _)) = pairs.0.get(data.len() % pairs.0.len().max(1)) {
        if !set.iter().any(|(sk, _)| sk == k) {
            set.push((k.as_str(), "{\"replaced\":[true,-1.5e-3]}"));
        }
    }
    check_splice(data, open, &pairs, value.as_ref(), &obj, &set);
});
