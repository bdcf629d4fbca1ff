//! `JsonObject::parse` and `with_fields` on arbitrary bytes.
//!
//! Properties:
//! - `parse` never panics; it succeeds on every JSON object serde_json accepts,
//!   and only on input that is syntactically valid JSON with an object on top.
//! - Its fields are the top-level keys in order (escapes decoded) and each
//!   value range holds exactly that value's text (checked against an
//!   independent serde_json pass collecting `(key, &RawValue)` pairs), and the
//!   prompt sizes are those of the prompt keys' values measured on their own.
//! - `with_fields(set)` copies every input byte outside the replaced value
//!   ranges, in order, and writes the absent keys right after the opening
//!   brace: the output equals the splice rebuilt here from the pairs.
//! - The output is a JSON object whose members, as serde_json Values, are the
//!   input's with the keys of `set` set (last duplicate wins, as in
//!   serde_json; every occurrence of a set key is overwritten, so this holds
//!   on both sides), and parsing the output again gives the inserted keys
//!   first, then the input's keys.
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

/// Sizes of a prompt value as PROTOCOL/body.rs define them: every string
/// value at any depth (not object keys) adds its UTF-8 bytes and whitespace
/// words, every integer one token id. Duplicate keys all count.
#[derive(Default, Debug, PartialEq)]
struct Sizes {
    bytes: u64,
    words: u64,
    ids: u64,
}

struct SizeOf<'s>(&'s mut Sizes);

impl<'de> serde::de::DeserializeSeed<'de> for SizeOf<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for SizeOf<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("JSON")
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.bytes += v.len() as u64;
        self.0.words += v.split_whitespace().count() as u64;
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.0.ids += 1;
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.0.ids += 1;
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(SizeOf(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<IgnoredAny>()?.is_some() {
            map.next_value_seed(SizeOf(&mut *self.0))?;
        }
        Ok(())
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The splice `with_fields` must produce, built from the independent pairs.
fn expected_splice(data: &[u8], open: usize, pairs: &Pairs, set: &[(&str, &str)]) -> Vec<u8> {
    let inserted: Vec<String> = set
        .iter()
        .filter(|(k, _)| !pairs.0.iter().any(|(pk, _)| pk == k))
        .map(|(k, v)| format!("\"{k}\":{v}"))
        .collect();
    let mut out = data[..=open].to_vec();
    out.extend_from_slice(inserted.join(",").as_bytes());
    if !inserted.is_empty() && !pairs.0.is_empty() {
        out.push(b',');
    }
    let mut at = open + 1;
    for (k, raw) in &pairs.0 {
        if let Some((_, v)) = set.iter().find(|(sk, _)| sk == k) {
            let start = raw.get().as_ptr() as usize - data.as_ptr() as usize;
            out.extend_from_slice(&data[at..start]);
            out.extend_from_slice(v.as_bytes());
            at = start + raw.get().len();
        }
    }
    out.extend_from_slice(&data[at..]);
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

fn check_splice(data: &[u8], open: usize, pairs: &Pairs, input: Option<&Map<String, Value>>, obj: &JsonObject, set: &[(&str, &str)]) {
    let out = obj.with_fields(set);
    let expected = expected_splice(data, open, pairs, set);
    assert!(
        out == expected,
        "splice differs\n input: {:?}\n   set: {set:?}\n   got: {:?}\n  want: {:?}",
        String::from_utf8_lossy(data),
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&expected)
    );

    // The output is JSON, and as a Value it is the input with `set` applied.
    serde_json::from_slice::<IgnoredAny>(&out).expect("output is not JSON");
    if let Some(map) = input {
        let mut want = map.clone();
        for (k, v) in set {
            want.insert(k.to_string(), serde_json::from_str(v).expect("test value"));
        }
        let out_pairs: Pairs = serde_json::from_slice(&out).expect("output is an object");
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
        assert_eq!(&data[field.value.clone()], raw.get().as_bytes(), "value range of {key:?}");
        prev_end = field.value.end;
    }
    for (key, raw) in &pairs.0 {
        let last = pairs.0.iter().rev().find(|(k, _)| k == key).map(|(_, r)| r.get().as_bytes());
        assert_eq!(obj.raw_value(key), last);
        assert!(obj.has_any(&[key.as_str()]));
        let _ = raw;
    }
    // Prompt sizes: the values under text / prompt / messages / input_ids.
    let mut sizes = Sizes::default();
    for (key, raw) in &pairs.0 {
        if ["text", "prompt", "messages", "input_ids"].contains(&key.as_str()) {
            use serde::de::DeserializeSeed;
            let mut de = serde_json::Deserializer::from_str(raw.get());
            // Values nested deeper than serde_json's recursion limit stop both
            // this count and dprank's at the same place.
            let _ = SizeOf(&mut sizes).deserialize(&mut de);
        }
    }
    let p = obj.prompt_size(true);
    assert_eq!(Sizes { bytes: p.bytes, words: p.words, ids: p.token_ids }, sizes, "prompt size");
    assert_eq!(obj.prompt_size(false).words, 0, "words are counted only when asked");
    for how in [CostEstimate::Bytes, CostEstimate::Words, CostEstimate::One] {
        assert!(obj.estimated_tokens(how) >= 1);
    }

    // The regular router's single rank field.
    check_splice(data, open, &pairs, value.as_ref(), &obj, &[("routed_dp_rank", "3")]);

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
