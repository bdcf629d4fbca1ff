//! The token cost of a request, estimated from its prompt-bearing values
//! (`cost_estimate` in the configuration).

use super::JsonObject;
use crate::config::CostEstimate;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// Top-level keys whose values hold the prompt, per SGLang endpoint:
/// `/generate` (`text`, `input_ids`), completions (`prompt`), chat (`messages`).
const PROMPT_KEYS: [&str; 4] = ["text", "prompt", "messages", "input_ids"];

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

impl JsonObject<'_> {
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
