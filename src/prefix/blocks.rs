//! A request's prompts as chains of block hashes: the prompt read as one
//! byte stream, cut into `prefix_block_bytes` blocks, hash k covering
//! blocks 0..=k (docs/architecture.md, "The prefix index"). A batch is one
//! chain per prompt; a block stands for `block_bytes / 4` tokens.

use crate::body::JsonObject;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use xxhash_rust::xxh3::xxh3_64;

/// Prompts of a batch hashed; the tokens of further prompts count as uncached.
pub const MAX_CHAINS: usize = 64;
/// Blocks hashed per prompt (at 512 bytes, the first 2 MiB); the rest of a
/// longer prompt counts as uncached.
pub const MAX_BLOCKS: usize = 4096;
/// Between a chat message's role and its content, and after the message.
const ROLE_END: u8 = 0x1f;
const MESSAGE_END: u8 = 0x1e;

/// One prompt: its block hashes and its estimated tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chain {
    /// `hashes[k]` covers blocks 0..=k.
    pub hashes: Vec<u32>,
    /// Estimated tokens of the whole prompt.
    pub tokens: u64,
}

/// Every prompt of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PromptBlocks {
    pub block_bytes: u32,
    pub chains: Vec<Chain>,
    /// Tokens of prompts beyond `MAX_CHAINS` (never matched).
    pub extra_tokens: u64,
}

impl PromptBlocks {
    /// The prompts of a request body: `text`, `prompt`, `input_ids` and
    /// `messages`, in that order. Values of other shapes add nothing.
    pub fn of(body: &JsonObject, block_bytes: u32) -> PromptBlocks {
        let mut out = PromptBlocks {
            block_bytes,
            ..PromptBlocks::default()
        };
        for key in ["text", "prompt", "input_ids"] {
            if let Some(raw) = body.raw_value(key) {
                out.prompts(raw, 0);
            }
        }
        if let Some(raw) = body.raw_value("messages") {
            let mut chainer = Chainer::new(block_bytes);
            let mut de = serde_json::Deserializer::from_slice(raw);
            if de.deserialize_seq(Messages(&mut chainer)).is_ok() {
                out.push(chainer.finish());
            }
        }
        out
    }

    /// A `text`, `prompt` or `input_ids` value (`depth` 0), or an element of
    /// a batch (`depth` 1): a string, token ids, or a batch of either.
    fn prompts(&mut self, raw: &[u8], depth: u8) {
        if let Some(text) = plain_string(raw) {
            let mut chainer = Chainer::new(self.block_bytes);
            chainer.feed(text);
            self.push(chainer.finish());
            return;
        }
        let mut de = serde_json::Deserializer::from_slice(raw);
        let _ = de.deserialize_any(Prompts { out: self, depth });
    }

    fn push(&mut self, chain: Chain) {
        if self.chains.len() < MAX_CHAINS {
            self.chains.push(chain);
        } else {
            self.extra_tokens = self.extra_tokens.saturating_add(chain.tokens);
        }
    }

    /// Estimated prompt tokens of the whole request.
    pub fn tokens(&self) -> u64 {
        self.chains
            .iter()
            .map(|c| c.tokens)
            .fold(self.extra_tokens, u64::saturating_add)
    }

    /// Each prompt's block hashes, as the index records and matches them.
    pub fn hash_chains(&self) -> Vec<&[u32]> {
        self.chains.iter().map(|c| c.hashes.as_slice()).collect()
    }

    /// Tokens a block stands for.
    pub fn tokens_per_block(&self) -> u64 {
        u64::from(self.block_bytes / 4).max(1)
    }
}

/// Cuts a byte stream into blocks and chains their hashes.
struct Chainer {
    block: usize,
    /// The current partial block.
    buf: Vec<u8>,
    hash: u64,
    hashes: Vec<u32>,
    bytes: u64,
}

/// Folds a block's hash into the chain (a 64x64->128 multiply mix: cheap,
/// and every bit of both inputs reaches every bit of the result).
fn chain(previous: u64, block: u64) -> u64 {
    let m = u128::from(previous ^ block.rotate_left(23)) * 0x9E37_79B9_7F4A_7C15;
    (m as u64) ^ ((m >> 64) as u64)
}

impl Chainer {
    fn new(block_bytes: u32) -> Chainer {
        Chainer {
            block: block_bytes as usize,
            buf: Vec::new(),
            hash: u64::from(block_bytes),
            hashes: Vec::new(),
            bytes: 0,
        }
    }

    /// A chainer that only collects its bytes (never hashes: blocks of
    /// `usize::MAX`), to be fed to another later.
    fn buffer() -> Chainer {
        Chainer {
            block: usize::MAX,
            ..Chainer::new(0)
        }
    }

    fn emit(&mut self, block: &[u8]) {
        self.hash = chain(self.hash, xxh3_64(block));
        self.hashes.push((self.hash ^ (self.hash >> 32)) as u32);
    }

    fn feed(&mut self, mut data: &[u8]) {
        self.bytes = self.bytes.saturating_add(data.len() as u64);
        if self.hashes.len() >= MAX_BLOCKS {
            return;
        }
        if !self.buf.is_empty() {
            let take = (self.block - self.buf.len()).min(data.len());
            let (head, rest) = data.split_at(take);
            self.buf.extend_from_slice(head);
            data = rest;
            if self.buf.len() < self.block {
                return;
            }
            let block = std::mem::take(&mut self.buf);
            self.emit(&block);
            self.buf = block;
            self.buf.clear();
        }
        let mut blocks = data.chunks_exact(self.block);
        for block in blocks.by_ref() {
            if self.hashes.len() >= MAX_BLOCKS {
                return;
            }
            self.emit(block);
        }
        self.buf.extend_from_slice(blocks.remainder());
    }

    fn finish(self) -> Chain {
        Chain {
            hashes: self.hashes,
            tokens: self.bytes.div_ceil(4).max(1),
        }
    }
}

/// The bytes of a JSON string value that holds no escape: the text itself,
/// read without parsing it again (the body was validated whole).
fn plain_string(raw: &[u8]) -> Option<&[u8]> {
    let inner = raw.trim_ascii().strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    (!inner.contains(&b'\\')).then_some(inner)
}

/// Chat `messages`, fed to the chainer in one pass: per message its role,
/// `ROLE_END`, its content's strings, `MESSAGE_END`.
struct Messages<'c>(&'c mut Chainer);

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Message(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

struct Message<'c>(&'c mut Chainer);

impl<'de> DeserializeSeed<'de> for Message<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Message<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let chainer = self.0;
        let mut role_fed = false;
        // Content before the role (rare): kept until the role is known.
        let mut early: Option<Chainer> = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            match key.as_ref() {
                "role" if !role_fed => {
                    let role = map.next_value::<Cow<'de, str>>()?;
                    chainer.feed(role.as_bytes());
                    chainer.feed(&[ROLE_END]);
                    role_fed = true;
                    if let Some(content) = early.take() {
                        chainer.feed(&content.buf);
                    }
                }
                "content" if role_fed => map.next_value_seed(Strings(&mut *chainer))?,
                "content" => {
                    let buffer = early.get_or_insert_with(Chainer::buffer);
                    map.next_value_seed(Strings(buffer))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !role_fed {
            chainer.feed(b"user");
            chainer.feed(&[ROLE_END]);
            if let Some(content) = early {
                chainer.feed(&content.buf);
            }
        }
        chainer.feed(&[MESSAGE_END]);
        Ok(())
    }
}

/// The value of `text`, `prompt` or `input_ids`: a string, a list of token
/// ids, or a batch of either (one chain each).
struct Prompts<'o> {
    out: &'o mut PromptBlocks,
    depth: u8,
}

impl<'de> Visitor<'de> for Prompts<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt, token ids, or a batch of them")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let mut chainer = Chainer::new(self.out.block_bytes);
        chainer.feed(v.as_bytes());
        self.out.push(chainer.finish());
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        // Token ids at this level form one prompt; strings or lists are a batch.
        let mut ids: Option<Chainer> = None;
        while let Some(item) = seq.next_element::<Item>()? {
            match item {
                Item::Id(id) => ids
                    .get_or_insert_with(|| Chainer::new(self.out.block_bytes))
                    .feed(&(id as u32).to_le_bytes()),
                Item::Raw(raw) if self.depth == 0 => self.out.prompts(raw.get().as_bytes(), 1),
                Item::Raw(_) => {}
            }
        }
        if let Some(chainer) = ids {
            self.out.push(chainer.finish());
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
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
}

/// An element of a prompt list: a token id, or anything else kept raw.
enum Item<'a> {
    Id(u64),
    Raw(&'a RawValue),
}

impl<'de: 'a, 'a> Deserialize<'de> for Item<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&'a RawValue>::deserialize(d)?;
        let text = raw.get();
        // Ids are non-negative integers; anything else is a nested prompt.
        Ok(match text.parse::<u64>() {
            Ok(id) => Item::Id(id),
            Err(_) => Item::Raw(raw),
        })
    }
}

/// Feeds every string of a value (chat content: a string, or parts), in order.
struct Strings<'c>(&'c mut Chainer);

impl<'de> Visitor<'de> for Strings<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.feed(v.as_bytes());
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Strings(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // A content part's `type` is not text the model sees: parts of text
        // read like the same text given as a string.
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == "type" {
                map.next_value::<IgnoredAny>()?;
            } else {
                map.next_value_seed(Strings(&mut *self.0))?;
            }
        }
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
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
}

impl<'de> DeserializeSeed<'de> for Strings<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(body: &str, block_bytes: u32) -> PromptBlocks {
        PromptBlocks::of(&JsonObject::parse(body.as_bytes()).unwrap(), block_bytes)
    }

    fn text(s: &str) -> String {
        format!(r#"{{"text":{}}}"#, serde_json::to_string(s).unwrap())
    }

    #[test]
    fn shared_blocks_share_hashes_and_the_partial_tail_is_not_hashed() {
        let a = blocks(&text(&"a".repeat(64 * 3 + 10)), 64);
        assert_eq!(a.chains.len(), 1);
        assert_eq!(a.chains[0].hashes.len(), 3);
        assert_eq!(a.chains[0].tokens, (64 * 3 + 10_u64).div_ceil(4));
        let b = blocks(&text(&format!("{}{}", "a".repeat(64 * 2), "b".repeat(64))), 64);
        assert_eq!(b.chains[0].hashes[..2], a.chains[0].hashes[..2]);
        assert_ne!(b.chains[0].hashes[2], a.chains[0].hashes[2]);
        // A block equal in content but after a different prefix hashes apart.
        let c = blocks(&text(&format!("{}{}", "b".repeat(64), "a".repeat(64))), 64);
        assert_ne!(c.chains[0].hashes[1], a.chains[0].hashes[1]);
        assert!(blocks(&text("short"), 64).chains[0].hashes.is_empty());
    }

    #[test]
    fn escapes_are_read_as_the_text_they_stand_for() {
        let tail = " and so on,".repeat(8);
        let plain = blocks(&format!(r#"{{"prompt":"é\n{tail}"}}"#), 64);
        let escaped = blocks(&format!(r#"{{"prompt":"\u00e9\u000a{tail}"}}"#), 64);
        assert_eq!(plain, escaped);
        assert_eq!(plain.chains[0].hashes.len(), 1);
    }

    #[test]
    fn a_chat_turn_extends_the_previous_turns_chain() {
        let system = "You are a careful assistant. ".repeat(20);
        let first = format!(
            r#"{{"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"Hi, tell me about prefix caches"}}]}}"#
        );
        let second = format!(
            r#"{{"messages":[{{"content":"{system}","role":"system"}},{{"role":"user","content":[{{"type":"text","text":"Hi, tell me about prefix caches"}}]}},
                {{"role":"assistant","content":"A radix tree per rank."}},{{"role":"user","content":"And then?"}}],"stream":true}}"#
        );
        let (a, b) = (blocks(&first, 64), blocks(&second, 64));
        let (a, b) = (&a.chains[0], &b.chains[0]);
        assert!(b.hashes.len() > a.hashes.len());
        // Neither key order nor content given as text parts changes the stream.
        assert_eq!(a.hashes[..], b.hashes[..a.hashes.len()]);
        let other_role = first.replace("\"system\"", "\"developer\"");
        assert_ne!(blocks(&other_role, 64).chains[0].hashes[0], a.hashes[0]);
    }

    #[test]
    fn token_ids_and_batches() {
        let ids: Vec<u32> = (0..100).collect();
        let one = blocks(&format!(r#"{{"input_ids":{ids:?}}}"#), 64);
        assert_eq!(one.chains.len(), 1);
        assert_eq!(one.chains[0].hashes.len(), 100 * 4 / 64);
        assert_eq!(one.chains[0].tokens, 100);
        let batch = blocks(&format!(r#"{{"input_ids":[{ids:?},{ids:?},[1]]}}"#), 64);
        assert_eq!(batch.chains.len(), 3);
        assert_eq!(batch.chains[0], batch.chains[1]);
        assert_eq!(batch.tokens(), 201);
        let texts = blocks(r#"{"text":["a","bb",{"x":1},3]}"#, 64);
        assert_eq!(texts.chains.len(), 3, "two texts, then the ids: {texts:?}");
        let many = format!(r#"{{"text":[{}]}}"#, vec!["\"abcd\""; MAX_CHAINS + 2].join(","));
        let many = blocks(&many, 64);
        assert_eq!((many.chains.len(), many.extra_tokens), (MAX_CHAINS, 2));
        assert_eq!(many.tokens(), MAX_CHAINS as u64 + 2);
    }

    #[test]
    fn other_shapes_add_nothing_and_never_fail() {
        for body in [
            r#"{"text":{"a":"b"}}"#,
            r#"{"messages":"hi"}"#,
            r#"{"messages":[1,2]}"#,
            r#"{"text":null,"prompt":true,"input_ids":-3}"#,
            r#"{"other":"x"}"#,
        ] {
            assert_eq!(blocks(body, 64).tokens(), 0, "{body}");
        }
        let deep = format!(
            r#"{{"messages":[{{"content":{}{}}}]}}"#,
            "[".repeat(5000),
            "]".repeat(5000)
        );
        assert!(blocks(&deep, 64).chains.len() <= 1);
    }

    #[test]
    fn long_prompts_are_hashed_up_to_the_limit_and_counted_whole() {
        let long = blocks(&text(&"z".repeat(64 * (MAX_BLOCKS + 10))), 64);
        assert_eq!(long.chains[0].hashes.len(), MAX_BLOCKS);
        assert_eq!(long.chains[0].tokens, 16 * (MAX_BLOCKS as u64 + 10));
    }
}
