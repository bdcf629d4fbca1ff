//! Request bodies: find the top-level fields of a JSON object without building
//! a tree, estimate the prompt's token cost, and splice fields in so that every
//! other byte of the client's body stays as it was sent.

use crate::config::CostEstimate;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

/// Top-level keys whose values hold the prompt, per SGLang endpoint:
/// `/generate` (`text`, `input_ids`), completions (`prompt`), chat (`messages`).
const PROMPT_KEYS: [&str; 4] = ["text", "prompt", "messages", "input_ids"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyError {
    /// Not valid JSON (or not UTF-8, or trailing garbage).
    NotJson,
    /// Valid JSON, but not an object.
    NotObject,
}

impl BodyError {
    pub fn reason(self) -> &'static str {
        match self {
            BodyError::NotJson => "not_json",
            BodyError::NotObject => "not_object",
        }
    }
}

/// Sizes of the prompt-bearing values, the inputs of the cost estimate.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PromptSize {
    pub bytes: u64,
    pub words: u64,
    pub token_ids: u64,
}

impl PromptSize {
    /// Estimated tokens this request adds to a rank; at least 1.
    pub fn estimate(&self, how: CostEstimate) -> u64 {
        let text_tokens = match how {
            CostEstimate::Bytes => self.bytes.div_ceil(4),
            CostEstimate::Words => (self.words * 13).div_ceil(10),
            CostEstimate::One => return 1,
        };
        (text_tokens + self.token_ids).max(1)
    }
}

/// A top-level field of the body: its key and the byte range of its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field<'a> {
    pub key: Cow<'a, str>,
    pub value: Range<usize>,
}

#[derive(Debug)]
pub struct JsonObject<'a> {
    body: &'a [u8],
    /// Offset of the opening `{`.
    open: usize,
    pub fields: Vec<Field<'a>>,
}

impl<'a> JsonObject<'a> {
    pub fn parse(body: &'a [u8]) -> Result<JsonObject<'a>, BodyError> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let result = de.deserialize_any(ObjectVisitor { body });
        let parsed = match result {
            Ok(Some(parsed)) => parsed,
            Ok(None) => return Err(BodyError::NotObject),
            Err(_) => return Err(BodyError::NotJson),
        };
        de.end().map_err(|_| BodyError::NotJson)?;
        let open = body.iter().position(|b| *b == b'{').ok_or(BodyError::NotObject)?;
        Ok(JsonObject {
            body,
            open,
            fields: parsed,
        })
    }

    /// Sizes of the prompt-bearing values. Counting words reads every prompt
    /// character, so it is done only when asked.
    pub fn prompt_size(&self, count_words: bool) -> PromptSize {
        let mut size = PromptSize::default();
        for field in self
            .fields
            .iter()
            .filter(|f| PROMPT_KEYS.contains(&f.key.as_ref()))
        {
            let Some(text) = self
                .body
                .get(field.value.clone())
                .and_then(|raw| std::str::from_utf8(raw).ok())
            else {
                continue;
            };
            // Values nested beyond serde_json's recursion limit, lone
            // surrogates or numbers beyond f64 stop the count early: the
            // estimate is then low, for prompts SGLang rejects anyway.
            let _ = SizeSeed {
                size: &mut size,
                count_words,
            }
            .deserialize(&mut serde_json::Deserializer::from_str(text));
        }
        size
    }

    /// Tokens this request is estimated to add to its rank.
    pub fn estimated_tokens(&self, how: CostEstimate) -> u64 {
        match how {
            CostEstimate::One => 1,
            CostEstimate::Bytes => self.prompt_size(false).estimate(how),
            CostEstimate::Words => self.prompt_size(true).estimate(how),
        }
    }

    /// The raw JSON text of the last value under `key` (JSON parsers keep the last duplicate).
    pub fn raw_value(&self, key: &str) -> Option<&'a [u8]> {
        let body: &'a [u8] = self.body;
        self.fields
            .iter()
            .rev()
            .find(|f| f.key == key)
            .and_then(|f| body.get(f.value.clone()))
    }

    /// Whether any of `keys` is present at the top level.
    pub fn has_any(&self, keys: &[&str]) -> bool {
        self.fields.iter().any(|f| keys.contains(&f.key.as_ref()))
    }

    /// The body with each `(key, json_value)` set: every existing occurrence of
    /// the key gets the new value in place; absent keys are inserted right after
    /// the opening brace. All other bytes are copied unchanged.
    pub fn with_fields(&self, set: &[(&str, &str)]) -> Vec<u8> {
        let extra: usize = set.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
        let mut out = Vec::with_capacity(self.body.len() + extra);
        let mut replacements: Vec<(&Range<usize>, &str)> = self
            .fields
            .iter()
            .filter_map(|f| set.iter().find(|(k, _)| *k == f.key).map(|(_, v)| (&f.value, *v)))
            .collect();
        replacements.sort_by_key(|(r, _)| r.start);
        let inserts: Vec<&(&str, &str)> = set
            .iter()
            .filter(|(k, _)| !self.fields.iter().any(|f| f.key == *k))
            .collect();

        let head_end = self.open + 1;
        out.extend_from_slice(self.body.get(..head_end).unwrap_or_default());
        for (i, (k, v)) in inserts.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(v.as_bytes());
        }
        if !inserts.is_empty() && !self.fields.is_empty() {
            out.push(b',');
        }
        let mut at = head_end;
        for (range, v) in replacements {
            out.extend_from_slice(self.body.get(at..range.start).unwrap_or_default());
            out.extend_from_slice(v.as_bytes());
            at = range.end;
        }
        out.extend_from_slice(self.body.get(at..).unwrap_or_default());
        out
    }
}

/// Whether a body dprank cannot parse might still carry one of `names` for
/// a more lenient parser (Python's `json` accepts a BOM, NaN, UTF-16): it
/// opens like an object (after any BOM and whitespace) and names a rank field,
/// ignoring NUL bytes (UTF-16/32) and `\u` escapes of ASCII.
pub fn may_name_a_rank(body: &[u8], names: &[&str]) -> bool {
    let narrow: Vec<u8> = body.iter().copied().filter(|b| *b != 0).collect();
    let opens_like_an_object = narrow
        .iter()
        .find(|b| b.is_ascii() && !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{');
    if !opens_like_an_object {
        return false;
    }
    let mut text = Vec::with_capacity(narrow.len());
    let mut i = 0;
    while let Some(&b) = narrow.get(i) {
        let escaped = (b == b'\\' && narrow.get(i + 1) == Some(&b'u'))
            .then(|| narrow.get(i + 2..i + 6))
            .flatten()
            .and_then(|hex| u32::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())
            .filter(|v| *v < 128);
        match escaped {
            Some(v) => {
                text.push(v as u8);
                i += 6;
            }
            None => {
                text.push(b);
                i += 1;
            }
        }
    }
    names
        .iter()
        .any(|name| !name.is_empty() && text.windows(name.len()).any(|w| w == name.as_bytes()))
}

/// JSON string escaping for a value spliced into a body.
pub fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

type Parsed<'a> = Vec<Field<'a>>;

/// Visits the top level: an object yields its fields; anything else yields None.
struct ObjectVisitor<'a> {
    body: &'a [u8],
}

impl<'de> Visitor<'de> for ObjectVisitor<'de> {
    type Value = Option<Parsed<'de>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Vec::new();
        let base = self.body.as_ptr() as usize;
        while let Some(key) = map.next_key::<KeySeedOut<'de>>()? {
            let raw: &'de RawValue = map.next_value()?;
            let text = raw.get();
            let start = (text.as_ptr() as usize).wrapping_sub(base);
            if start > self.body.len() {
                return Err(de::Error::custom("value outside the body"));
            }
            fields.push(Field {
                key: key.0,
                value: start..start + text.len(),
            });
        }
        Ok(Some(fields))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// A key borrowed from the body when it has no escapes, owned otherwise.
struct KeySeedOut<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for KeySeedOut<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = KeySeedOut<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(KeySeedOut(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(KeySeedOut(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

/// Adds the sizes of every string (bytes, words) and integer (token ids) in a
/// value, at any depth, without allocating a tree.
struct SizeSeed<'p> {
    size: &'p mut PromptSize,
    count_words: bool,
}

impl<'de> DeserializeSeed<'de> for SizeSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for SizeSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.size.bytes += v.len() as u64;
        if self.count_words {
            self.size.words += v.split_whitespace().count() as u64;
        }
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.size.token_ids += 1;
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.size.token_ids += 1;
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(SizeSeed {
                size: &mut *self.size,
                count_words: self.count_words,
            })?
            .is_some()
        {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key::<de::IgnoredAny>()?.is_some() {
            map.next_value_seed(SizeSeed {
                size: &mut *self.size,
                count_words: self.count_words,
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(body: &str, fields: &[(&str, &str)]) -> String {
        let obj = JsonObject::parse(body.as_bytes()).unwrap();
        String::from_utf8(obj.with_fields(fields)).unwrap()
    }

    #[test]
    fn inserts_after_the_brace_keeping_every_other_byte() {
        let body = "  {\n \"text\" : \"hi there\",\"sampling_params\":{\"max_new_tokens\":8} } \n";
        assert_eq!(
            set(body, &[("routed_dp_rank", "3")]),
            "  {\"routed_dp_rank\":3,\n \"text\" : \"hi there\",\"sampling_params\":{\"max_new_tokens\":8} } \n"
        );
    }

    #[test]
    fn inserts_into_empty_object_without_a_comma() {
        assert_eq!(set("{}", &[("a", "1"), ("b", "\"x\"")]), "{\"a\":1,\"b\":\"x\"}");
    }

    #[test]
    fn overwrites_existing_values_in_place_including_duplicates() {
        let body = r#"{"routed_dp_rank": 7, "text":"x", "routed_dp_rank":"bad"}"#;
        assert_eq!(
            set(body, &[("routed_dp_rank", "1")]),
            r#"{"routed_dp_rank": 1, "text":"x", "routed_dp_rank":1}"#
        );
    }

    #[test]
    fn nested_keys_of_the_same_name_are_left_alone() {
        let body = r#"{"meta":{"routed_dp_rank":5},"text":"x"}"#;
        assert_eq!(
            set(body, &[("routed_dp_rank", "2")]),
            r#"{"routed_dp_rank":2,"meta":{"routed_dp_rank":5},"text":"x"}"#
        );
    }

    #[test]
    fn mixed_insert_and_overwrite() {
        let body = r#"{"bootstrap_room":1,"text":"x"}"#;
        let out = set(
            body,
            &[("bootstrap_host", "\"10.0.0.1\""), ("bootstrap_room", "99")],
        );
        assert_eq!(
            out,
            r#"{"bootstrap_host":"10.0.0.1","bootstrap_room":99,"text":"x"}"#
        );
    }

    #[test]
    fn escaped_keys_are_matched_by_their_meaning() {
        let body = r#"{"routed\u005fdp_rank":4}"#;
        assert_eq!(
            set(body, &[("routed_dp_rank", "0")]),
            r#"{"routed\u005fdp_rank":0}"#
        );
    }

    #[test]
    fn output_is_valid_json_equal_to_input_plus_field() {
        let body = r#"{"text":["a \"quoted\" b","c"],"stream":true,"n":1.5e3,"x":null}"#;
        let out = set(body, &[("routed_dp_rank", "2")]);
        let mut expected: serde_json::Value = serde_json::from_str(body).unwrap();
        expected["routed_dp_rank"] = 2.into();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), expected);
    }

    #[test]
    fn non_objects_are_told_apart_from_non_json() {
        assert_eq!(JsonObject::parse(b"[1,2]").unwrap_err(), BodyError::NotObject);
        assert_eq!(JsonObject::parse(b"\"s\"").unwrap_err(), BodyError::NotObject);
        assert_eq!(JsonObject::parse(b"null").unwrap_err(), BodyError::NotObject);
        assert_eq!(JsonObject::parse(b"").unwrap_err(), BodyError::NotJson);
        assert_eq!(JsonObject::parse(b"{\"a\":1").unwrap_err(), BodyError::NotJson);
        assert_eq!(JsonObject::parse(b"{\"a\":1} x").unwrap_err(), BodyError::NotJson);
        assert_eq!(JsonObject::parse(b"text=hello").unwrap_err(), BodyError::NotJson);
        assert_eq!(
            JsonObject::parse(b"{\"a\":\"\xff\"}").unwrap_err(),
            BodyError::NotJson
        );
        assert_eq!(
            JsonObject::parse(b"\xef\xbb\xbf{}").unwrap_err(),
            BodyError::NotJson
        );
    }

    #[test]
    fn prompt_sizes_per_endpoint_shape() {
        let gen = JsonObject::parse(br#"{"text":"one two  three","sampling_params":{"x":"ignored words"}}"#)
            .unwrap();
        assert_eq!(
            gen.prompt_size(true),
            PromptSize {
                bytes: 14,
                words: 3,
                token_ids: 0
            }
        );
        let batch = JsonObject::parse(br#"{"text":["ab","cd ef"]}"#).unwrap();
        assert_eq!(
            batch.prompt_size(true),
            PromptSize {
                bytes: 7,
                words: 3,
                token_ids: 0
            }
        );
        let ids = JsonObject::parse(br#"{"input_ids":[[1,2,3],[4]]}"#).unwrap();
        assert_eq!(ids.prompt_size(false).token_ids, 4);
        let chat = JsonObject::parse(
            br#"{"messages":[{"role":"user","content":"hello world"},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        )
        .unwrap();
        // "user", "hello world", "user", "text", "hi": every string value counts.
        assert_eq!(chat.prompt_size(true).words, 6);
        assert_eq!(
            chat.prompt_size(false).words,
            0,
            "words are counted only when asked"
        );
    }

    #[test]
    fn estimates_follow_the_documented_formulas() {
        let p = PromptSize {
            bytes: 9,
            words: 10,
            token_ids: 2,
        };
        assert_eq!(p.estimate(CostEstimate::Bytes), 3 + 2);
        assert_eq!(p.estimate(CostEstimate::Words), 13 + 2);
        assert_eq!(p.estimate(CostEstimate::One), 1);
        assert_eq!(PromptSize::default().estimate(CostEstimate::Bytes), 1);
    }

    #[test]
    fn bodies_that_may_name_a_rank() {
        let names = ["routed_dp_rank", "data_parallel_rank"];
        assert!(may_name_a_rank(b"\xef\xbb\xbf{\"routed_dp_rank\":3}", &names));
        assert!(may_name_a_rank(br#" {"routed_dp_rank":3,"t":NaN}"#, &names));
        assert!(may_name_a_rank(br#"{"data_parallel_\u0072\u0061nk":1"#, &names));
        let utf16: Vec<u8> = "\u{feff}{\"routed_dp_rank\":3}"
            .encode_utf16()
            .flat_map(|u| u.to_le_bytes())
            .collect();
        assert!(may_name_a_rank(&utf16, &names));
        assert!(
            !may_name_a_rank(b"text=frank&routed_dp_rank=1", &names),
            "not an object"
        );
        assert!(
            !may_name_a_rank(br#"{"text":"frank","t":NaN}"#, &names),
            "the word, not a field"
        );
        assert!(!may_name_a_rank(b"{\\u00", &names));
    }

    #[test]
    fn raw_value_takes_the_last_duplicate() {
        let obj = JsonObject::parse(br#"{"r":1,"r":22}"#).unwrap();
        assert_eq!(obj.raw_value("r"), Some(&b"22"[..]));
        assert!(obj.has_any(&["x", "r"]));
    }

    #[test]
    fn deep_nesting_is_valid_json_and_costs_no_recursion() {
        // serde_json skips values iteratively; only the prompt sizing recurses,
        // and it stops at serde_json's depth limit instead of overflowing.
        let deep = format!("{{\"text\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        let obj = JsonObject::parse(deep.as_bytes()).unwrap();
        assert_eq!(obj.estimated_tokens(CostEstimate::Words), 1);
        let out = obj.with_fields(&[("routed_dp_rank", "1")]);
        assert!(out.starts_with(br#"{"routed_dp_rank":1,"text":[[["#));
        assert_eq!(out.len(), deep.len() + r#""routed_dp_rank":1,"#.len());
    }
}
