//! One request's prefix affinity: its prompt blocks and, per candidate
//! worker, what that worker's index says of them. The router reads the
//! indexes of the workers the scheduler's filters keep into it before the
//! scheduler runs (`insert`), so the scorers score data, not shared data;
//! the value read is kept for the write that records where the request went.

use super::blocks::PromptBlocks;
use super::index::{IndexRecord, IndexView};
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
        let cached = value
            .as_ref()
            .and_then(|(bytes, _)| decode_view::<IndexView>(bytes))
            .map(|view| self.held(&view))
            .unwrap_or_default();
        if self.indexes.len() <= worker {
            self.indexes.resize_with(worker + 1, || None);
        }
        if let Some(slot) = self.indexes.get_mut(worker) {
            *slot = Some(WorkerIndex { value, cached });
        }
    }

    /// Prompt tokens each rank of an index is thought to hold (nothing when
    /// the index was made with another block size).
    fn held(&self, view: &IndexView) -> Vec<u64> {
        if view.block_bytes != self.prompt.block_bytes {
            return Vec::new();
        }
        let alive_from = view.alive_from(self.now_ms, self.settings.ttl_ms);
        let per_block = self.prompt.tokens_per_block();
        (0..view.ranks())
            .map(|r| {
                let Some(rank) = view.rank(r).filter(|rank| !rank.is_empty()) else {
                    return 0;
                };
                self.prompt
                    .chains
                    .iter()
                    .map(|c| {
                        let blocks = rank.matched(&c.hashes, alive_from) as u64;
                        (blocks * per_block).min(c.tokens)
                    })
                    .fold(0, u64::saturating_add)
            })
            .collect()
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
        let chains: Vec<&[u32]> = self.prompt.chains.iter().map(|c| c.hashes.as_slice()).collect();
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
        let chains: Vec<&[u32]> = blocks.chains.iter().map(|c| c.hashes.as_slice()).collect();
        let mut held = IndexRecord::empty(64, 5000);
        held.touch(2, &chains, 5000, settings.ttl_ms, 100);
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
    fn an_index_of_another_block_size_or_an_unhashed_prompt_holds_nothing() {
        let settings = Prefix::default();
        let blocks = prompt(&"q".repeat(2000), settings.block_bytes);
        let chains: Vec<&[u32]> = blocks.chains.iter().map(|c| c.hashes.as_slice()).collect();
        let mut other = IndexRecord::empty(64, 5000);
        other.touch(0, &chains, 5000, settings.ttl_ms, 100);
        let mut request = RequestPrefix::new(&settings, blocks, false, 0, 6000);
        request.insert(0, Some((encode(&other), 1)));
        assert_eq!(request.cached(0, 0), 0);
        let empty = RequestPrefix::new(&settings, prompt("", settings.block_bytes), false, 0, 6000);
        assert!(!empty.wants(0) && !empty.records());
    }
}
