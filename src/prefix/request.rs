//! One request's prefix affinity: its prompt blocks and, per candidate
//! worker, what that worker's index says of them. The router reads the
//! indexes of the workers the scheduler's filters keep into it before the
//! scheduler runs (`insert`), so the scorers score data, not shared data;
//! the value read is kept for the write that records where the request went.

use super::blocks::PromptBlocks;
use super::index::{IndexRecord, IndexView, STAMP_MS};
use crate::codec::decode_view;
use crate::config::Prefix;
use std::fmt;

/// A shared-data value and its compare-and-swap token (None: absent).
pub type ReadValue = Option<(Vec<u8>, u32)>;

/// What was read of one worker's index.
struct WorkerIndex {
    value: ReadValue,
    /// Prompt tokens each rank is thought to hold.
    cached: Vec<u64>,
}

pub struct RequestPrefix<'a> {
    pub settings: &'a Prefix,
    pub prompt: PromptBlocks,
    /// The client asked for a streamed response (its first byte is its first token).
    pub streamed: bool,
    /// Output tokens the request may generate (its `max_new_tokens`), as the
    /// server reserves KV for them.
    pub output: u64,
    /// The clock of the routing decision (index entries older than the TTL are dead).
    now_ms: u64,
    /// Per pool worker, once read.
    indexes: Vec<Option<WorkerIndex>>,
    /// The deepest match among the workers read: its prompt tokens and when
    /// its deepest block was last routed (ms).
    deepest: Option<Match>,
    /// Some rank of a worker read holds a confirmed match of the prompt.
    held_somewhere: bool,
}

/// How much of the prompt one rank holds, when the deepest block it holds
/// was last routed there, and whether the match is confirmed: two blocks or
/// more, the first held too. A 3-byte key can match another prompt's block
/// by chance (one in 16.7 million per entry, for every block of a full
/// index); two chance matches of one prompt on one rank are not expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Match {
    tokens: u64,
    routed_ms: u64,
    confirmed: bool,
}

impl fmt::Debug for RequestPrefix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("RequestPrefix")
            .field("prompt_tokens", &self.prompt.tokens())
            .field("streamed", &self.streamed)
            .field("read", &self.indexes.iter().filter(|i| i.is_some()).count())
            .finish()
    }
}

impl<'a> RequestPrefix<'a> {
    /// At `now_ms`: the time the router already read for the same decision
    /// (the clock is a host call).
    pub fn new(settings: &'a Prefix, prompt: PromptBlocks, streamed: bool, output: u64, now_ms: u64) -> Self {
        RequestPrefix {
            settings,
            prompt,
            streamed,
            output,
            now_ms,
            indexes: Vec::new(),
            deepest: None,
            held_somewhere: false,
        }
    }

    fn hashed(&self) -> bool {
        self.prompt.chains.iter().any(|c| !c.hashes.is_empty())
    }

    /// Whether pool worker `worker`'s index is still to be read: the prompt
    /// has blocks to look up and it was not read for this request yet.
    pub fn wants(&self, worker: usize) -> bool {
        self.hashed() && !matches!(self.indexes.get(worker), Some(Some(_)))
    }

    /// Takes in `value`, pool worker `worker`'s index as read (None: none
    /// yet), and works out once how much of the prompt each rank holds.
    pub fn insert(&mut self, worker: usize, value: ReadValue) {
        let matches = value
            .as_ref()
            .and_then(|(bytes, _)| decode_view::<IndexView>(bytes))
            .map(|view| self.held(&view))
            .unwrap_or_default();
        for m in matches.iter().flatten() {
            self.held_somewhere |= m.confirmed;
            // The deepest; of equals, the most recently routed.
            let deeper = self
                .deepest
                .is_none_or(|d| (m.tokens, m.routed_ms) > (d.tokens, d.routed_ms));
            if m.tokens > 0 && deeper {
                self.deepest = Some(*m);
            }
        }
        let cached = matches.iter().map(|m| m.map_or(0, |m| m.tokens)).collect();
        if self.indexes.len() <= worker {
            self.indexes.resize_with(worker + 1, || None);
        }
        if let Some(slot) = self.indexes.get_mut(worker) {
            *slot = Some(WorkerIndex { value, cached });
        }
    }

    /// What each rank of an index is thought to hold of the prompt (nothing
    /// when the index was made with another block size; None for a rank
    /// holding none of it).
    fn held(&self, view: &IndexView) -> Vec<Option<Match>> {
        if view.block_bytes != self.prompt.block_bytes {
            return Vec::new();
        }
        let alive_from = view.alive_from(self.now_ms, self.settings.ttl_ms);
        let per_block = self.prompt.tokens_per_block();
        (0..view.ranks())
            .map(|r| {
                let rank = view.rank(r).filter(|rank| !rank.is_empty())?;
                let mut held: Option<Match> = None;
                for chain in &self.prompt.chains {
                    let blocks = rank.matched(&chain.hashes, alive_from);
                    let Some(stamp) = blocks
                        .checked_sub(1)
                        .and_then(|last| rank.stamp(chain.hashes[last]))
                    else {
                        continue;
                    };
                    let tokens = (blocks as u64 * per_block).min(chain.tokens);
                    let routed_ms = view.base_ms.saturating_add(u64::from(stamp) * STAMP_MS);
                    let confirmed = blocks >= 2 && rank.stamp(chain.hashes[0]).is_some();
                    held = Some(match held {
                        None => Match {
                            tokens,
                            routed_ms,
                            confirmed,
                        },
                        Some(h) => Match {
                            tokens: h.tokens.saturating_add(tokens),
                            routed_ms: h.routed_ms.max(routed_ms),
                            confirmed: h.confirmed && confirmed,
                        },
                    });
                }
                held
            })
            .collect()
    }

    /// Prompt tokens of the deepest match among the workers read, when
    /// that match is confirmed and private: last routed `private_after_ms`
    /// ago or more.
    pub fn private_match(&self) -> Option<u64> {
        self.deepest
            .filter(|d| {
                d.confirmed && self.now_ms.saturating_sub(d.routed_ms) >= self.settings.private_after_ms
            })
            .map(|d| d.tokens)
    }

    /// Whether no rank of the workers read holds a confirmed match of the
    /// prompt (its first two blocks or more).
    pub fn held_nowhere(&self) -> bool {
        !self.held_somewhere
    }

    /// Prompt tokens each rank of pool worker `worker` is thought to hold
    /// (empty: none, or its index was not read).
    pub fn cached_ranks(&self, worker: usize) -> &[u64] {
        match self.indexes.get(worker) {
            Some(Some(index)) => &index.cached,
            _ => &[],
        }
    }

    /// Prompt tokens (pool worker, rank) is thought to hold.
    pub fn cached(&self, worker: usize, rank: usize) -> u64 {
        self.cached_ranks(worker).get(rank).copied().unwrap_or(0)
    }

    /// Whether there is anything to record (the prompt has blocks).
    pub fn records(&self) -> bool {
        self.hashed()
    }

    /// The value read of pool worker `worker`'s index, handed over once for
    /// the write that records the prompt there (its cas guards that write);
    /// None when it was not read.
    pub fn take_value(&mut self, worker: usize) -> Option<ReadValue> {
        let index = self.indexes.get_mut(worker)?.as_mut()?;
        Some(index.value.take())
    }

    /// The change that records the prompt on `rank` of an index (into a
    /// rank of `capacity_tokens` reported KV): None when nothing changed.
    pub fn record_on(
        &self,
        rank: u32,
        capacity_tokens: Option<u64>,
    ) -> impl FnMut(Option<IndexView>) -> Option<IndexRecord> + '_ {
        let capacity = self.settings.capacity_blocks(capacity_tokens);
        let (block_bytes, now, ttl) = (self.prompt.block_bytes, self.now_ms, self.settings.ttl_ms);
        let chains = self.prompt.hash_chains();
        move |view| {
            let mut record = IndexRecord::from_view(view.as_ref(), block_bytes, now);
            record
                .touch(rank as usize, &chains, now, ttl, capacity)
                .then_some(record)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::JsonObject;
    use crate::codec::encode;

    fn prompt(text: &str, block_bytes: u32) -> PromptBlocks {
        let body = format!(r#"{{"text":"{text}"}}"#);
        PromptBlocks::of(&JsonObject::parse(body.as_bytes()).unwrap(), block_bytes)
    }

    #[test]
    fn reads_each_worker_once_and_records_under_that_read() {
        let settings = Prefix {
            block_bytes: 64,
            ..Prefix::default()
        };
        let blocks = prompt(&"p".repeat(256), 64);
        let held = IndexRecord::holding(2, &blocks.hash_chains(), 5000);
        let mut request = RequestPrefix::new(&settings, blocks.clone(), false, 0, 6000);
        assert!(request.wants(3) && request.cached_ranks(3).is_empty());
        request.insert(3, Some((encode(&held), 41)));
        assert!(!request.wants(3), "read once per request");
        assert_eq!(request.cached_ranks(3), [0, 0, 64]);
        assert_eq!(
            (request.cached(3, 2), request.cached(3, 7), request.cached(0, 2)),
            (64, 0, 0)
        );
        request.insert(0, None);
        assert!(
            !request.wants(0) && request.cached_ranks(0).is_empty(),
            "no index yet"
        );
        // The write that records the prompt on rank 1 goes under the cas read.
        let Some(Some((bytes, 41))) = request.take_value(3) else {
            panic!("the value read is handed over")
        };
        assert_eq!(request.take_value(3), Some(None), "once");
        assert_eq!(request.take_value(5), None, "never read");
        let recorded = request.record_on(1, None)(decode_view(&bytes)).unwrap();
        let mut again = RequestPrefix::new(&settings, blocks, false, 0, 6000);
        again.insert(3, Some((encode(&recorded), 42)));
        assert_eq!(again.cached_ranks(3), [0, 64, 64]);
    }

    #[test]
    fn the_deepest_match_is_private_once_it_was_routed_long_enough_ago() {
        let settings = Prefix {
            block_bytes: 64,
            ..Prefix::default()
        };
        // A conversation's history: its first turn went to rank 1 of worker
        // 0 at 10 s; rank 0 of worker 1 holds the opening block alone, routed
        // at 20 s (a prompt many requests start with).
        let first = IndexRecord::holding(1, &prompt(&"h".repeat(512), 64).hash_chains(), 10_000);
        let second = IndexRecord::holding(0, &prompt(&"h".repeat(64), 64).hash_chains(), 20_000);
        let next_turn = prompt(&format!("{}{}", "h".repeat(512), "n".repeat(256)), 64);
        let at = |now_ms: u64| {
            let mut request = RequestPrefix::new(&settings, next_turn.clone(), false, 0, now_ms);
            request.insert(1, Some((encode(&second), 1)));
            request.insert(0, Some((encode(&first), 2)));
            request
        };
        // 512 bytes = 128 tokens held on worker 0's rank 1; its deepest block
        // was stamped up to 0.7 s before it was routed.
        assert_eq!(at(16_000).cached_ranks(0), [0, 128]);
        assert_eq!(at(16_000).private_match(), Some(128), "routed 6 s ago: private");
        assert!(!at(16_000).held_nowhere(), "a confirmed match");
        assert_eq!(at(11_500).private_match(), None, "routed 1.5 s ago: still shared");
        let only_opening = {
            let mut request = RequestPrefix::new(&settings, next_turn.clone(), false, 0, 40_000);
            request.insert(1, Some((encode(&second), 1)));
            request
        };
        assert_eq!(only_opening.private_match(), None, "one block: not confirmed");
        assert!(only_opening.held_nowhere(), "one block: not confirmed");
        let opening_twice = IndexRecord::holding(0, &prompt(&"h".repeat(128), 64).hash_chains(), 20_000);
        let mut request = RequestPrefix::new(&settings, next_turn.clone(), false, 0, 40_000);
        request.insert(1, Some((encode(&opening_twice), 1)));
        assert_eq!(
            request.private_match(),
            Some(32),
            "the deepest among the workers read"
        );
        // A chance match of the second block alone (the first not held).
        let four = prompt(&"c".repeat(256), 64);
        let stray = IndexRecord::holding(0, &[&four.chains[0].hashes[1..2]], 20_000);
        let mut request = RequestPrefix::new(&settings, four.clone(), false, 0, 40_000);
        request.insert(0, Some((encode(&stray), 1)));
        assert_eq!(request.cached(0, 0), 32, "matched as two blocks");
        assert_eq!(
            request.private_match(),
            None,
            "its first block not held: not confirmed"
        );
        assert!(request.held_nowhere(), "a chance match holds nothing");
        let nothing = RequestPrefix::new(&settings, next_turn, false, 0, 40_000);
        assert_eq!(nothing.private_match(), None, "nothing held: nothing to keep");
        assert!(nothing.held_nowhere());
    }

    #[test]
    fn an_index_of_another_block_size_or_an_unhashed_prompt_holds_nothing() {
        let settings = Prefix::default();
        let blocks = prompt(&"q".repeat(2000), settings.block_bytes);
        let other = IndexRecord::holding(0, &blocks.hash_chains(), 5000);
        let mut request = RequestPrefix::new(&settings, blocks, false, 0, 6000);
        request.insert(0, Some((encode(&other), 1)));
        assert_eq!(request.cached(0, 0), 0);
        let empty = RequestPrefix::new(&settings, prompt("", settings.block_bytes), false, 0, 6000);
        assert!(!empty.wants(0) && !empty.records());
    }
}
