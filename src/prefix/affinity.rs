//! One request's view of the prefix indexes: its prompt blocks, how many of
//! its tokens each candidate rank is thought to hold, and the record of
//! where it went. Each candidate worker's index is read at most once per
//! request (when a scorer first asks for it), and the chosen worker's is
//! written back with the compare-and-swap token of that read.

use super::blocks::PromptBlocks;
use super::index::{IndexRecord, IndexView};
use crate::codec::decode_view;
use crate::config::{Config, Prefix};
use crate::cost::weighted;
use crate::host::Host;
use crate::state::Charge;
use crate::store;
use std::cell::RefCell;
use std::fmt;

/// What was read of one worker's index.
struct Read {
    /// The value and its cas (None: no index yet).
    value: Option<(Vec<u8>, u32)>,
    /// Prompt tokens each rank is thought to hold.
    cached: Vec<u64>,
}

pub struct Affinity<'a> {
    pub settings: &'a Prefix,
    config: &'a Config,
    host: &'a dyn Host,
    /// `Config::all_workers` index of the pool's first worker.
    offset: usize,
    pub prompt: PromptBlocks,
    /// The client asked for a streamed response (its first byte is its first token).
    pub streamed: bool,
    /// Output tokens the request may generate (its `max_new_tokens`), as the
    /// server reserves KV for them.
    pub output: u64,
    now_ms: u64,
    /// Per pool worker, once read.
    reads: RefCell<Vec<Option<Read>>>,
}

impl fmt::Debug for Affinity<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.debug_struct("Affinity")
            .field("offset", &self.offset)
            .field("prompt_tokens", &self.prompt.tokens())
            .field("streamed", &self.streamed)
            .finish()
    }
}

impl<'a> Affinity<'a> {
    /// For a pool whose first worker is `offset` in `Config::all_workers`, at
    /// `now_ms`: the time the router already read for the same decision (the
    /// clock is a host call).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &'a Config,
        settings: &'a Prefix,
        host: &'a dyn Host,
        offset: usize,
        prompt: PromptBlocks,
        streamed: bool,
        output: u64,
        now_ms: u64,
    ) -> Affinity<'a> {
        Affinity {
            settings,
            config,
            host,
            offset,
            prompt,
            streamed,
            output,
            now_ms,
            reads: RefCell::new(Vec::new()),
        }
    }

    fn hashed(&self) -> bool {
        self.prompt.chains.iter().any(|c| !c.hashes.is_empty())
    }

    /// Reads pool worker `worker`'s index (once) and returns what `f` makes
    /// of the tokens each of its ranks is thought to hold.
    fn with_cached<R>(&self, worker: usize, f: impl FnOnce(&[u64]) -> R) -> R {
        if !self.hashed() {
            return f(&[]);
        }
        let mut reads = self.reads.borrow_mut();
        if reads.len() <= worker {
            reads.resize_with(worker + 1, || None);
        }
        let Some(slot) = reads.get_mut(worker) else {
            return f(&[]);
        };
        let read = slot.get_or_insert_with(|| self.read(worker));
        f(&read.cached)
    }

    fn read(&self, worker: usize) -> Read {
        let value = self.config.worker(self.offset + worker).and_then(|w| {
            self.host
                .shared_get(&store::Keys::of(self.config).prefix_index(&w.address))
        });
        let cached = value
            .as_ref()
            .and_then(|(bytes, _)| decode_view::<IndexView>(bytes))
            .filter(|v| v.block_bytes == self.prompt.block_bytes)
            .map(|v| {
                let alive_from = v.alive_from(self.now_ms, self.settings.ttl_ms);
                let per_block = self.prompt.tokens_per_block();
                (0..v.ranks())
                    .map(|r| {
                        let Some(rank) = v.rank(r) else { return 0 };
                        if rank.is_empty() {
                            return 0;
                        }
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
            })
            .unwrap_or_default();
        Read { value, cached }
    }

    /// Adds `uncached_weight` x the prompt tokens each rank of pool worker
    /// `worker` is thought not to hold to its slot.
    pub fn add_uncached(&self, worker: usize, costs: &mut [crate::cost::Slot]) {
        let total = self.prompt.tokens();
        let weight = self.settings.uncached_weight;
        self.with_cached(worker, |cached| {
            for (rank, cost) in costs.iter_mut().enumerate() {
                let held = cached.get(rank).copied().unwrap_or(0);
                crate::cost::add_cost(cost, weighted(total.saturating_sub(held), weight));
            }
        });
    }

    /// Prompt tokens (pool worker, rank) is thought to hold.
    pub fn cached(&self, worker: usize, rank: usize) -> u64 {
        self.with_cached(worker, |c| c.get(rank).copied().unwrap_or(0))
    }

    /// What the request is expected to cost (pool worker, rank).
    pub fn charge(&self, worker: usize, rank: u32) -> Charge {
        let cached = self.with_cached(worker, |c| c.get(rank as usize).copied().unwrap_or(0));
        Charge {
            prompt: self.prompt.tokens(),
            cached,
        }
    }

    /// Records the request's prompt on (pool worker, rank), whose reported
    /// KV capacity is `capacity_tokens`. Written with the cas of this
    /// request's read, read again only if another thread wrote in between.
    pub fn record(&self, worker: usize, rank: u32, capacity_tokens: Option<u64>) {
        if !self.hashed() {
            return;
        }
        let first = self.reads.borrow_mut().get_mut(worker).and_then(Option::take);
        let chains: Vec<&[u32]> = self.prompt.chains.iter().map(|c| c.hashes.as_slice()).collect();
        let capacity = self.settings.capacity_blocks(capacity_tokens);
        let (block_bytes, now, ttl) = (self.prompt.block_bytes, self.now_ms, self.settings.ttl_ms);
        store::update_index(
            self.config,
            self.host,
            self.offset + worker,
            first.map(|r| r.value),
            |view| {
                let mut record = IndexRecord::from_view(view.as_ref(), block_bytes, now);
                record
                    .touch(rank as usize, &chains, now, ttl, capacity)
                    .then_some(record)
            },
        );
    }
}
