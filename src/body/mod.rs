//! Request bodies: find the top-level fields of a JSON object without building
//! a tree, and splice fields in so that every other byte of the client's body
//! stays as it was sent. `prompt.rs` estimates the prompt's token cost;
//! `shape.rs` holds what dprank knows of SGLang's request bodies.

mod prompt;
mod shape;

pub use prompt::PromptSize;
pub use shape::{batch_size, bootstrap_fields, json_string, may_name_a_rank};

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyError {
    /// Not valid JSON (or not UTF-8, or trailing garbage).
    NotJson,
    /// Valid JSON, but not an object.
    NotObject,
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
    fn raw_value_takes_the_last_duplicate() {
        let obj = JsonObject::parse(br#"{"r":1,"r":22}"#).unwrap();
        assert_eq!(obj.raw_value("r"), Some(&b"22"[..]));
        assert!(obj.has_any(&["x", "r"]));
    }
}
