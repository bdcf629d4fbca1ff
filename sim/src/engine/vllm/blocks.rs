//! One engine's KV blocks and its prefix cache, as vLLM keeps them
//! (vllm/v1/core/block_pool.py, kv_cache_manager.py): a fixed pool of
//! blocks of `block_size` tokens; a block a request holds has a reference
//! count; a full block is known by a hash chained over the blocks before
//! it, and a hash map finds a cached block by it. Free blocks wait in a
//! queue, least recently freed first: allocating takes the queue's head and
//! evicts whatever it cached; a cache hit on a free block takes it out of
//! the queue. A request's blocks are freed tail first, so the ends of
//! prompts go before their shared beginnings.

use std::collections::HashMap;

/// A block's index in the pool.
pub type BlockId = u32;

const NONE: u32 = u32::MAX;
/// The parent hash of a request's first block.
const ROOT_HASH: u64 = 0x5eed_b10c_4a54_0001;

/// The hash of a full block: its tokens, chained to its parent's hash (so a
/// block matches only after the same prefix).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0x9e37_79b9_7f4a_7c15;
    for &token in tokens {
        h = (h ^ u64::from(token)).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    // splitmix64's finaliser.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The hash chain of `tokens`' full blocks, from `done` blocks on (extending
/// `hashes`, which holds the first `done`).
pub fn extend_hashes(hashes: &mut Vec<u64>, block_size: usize, tokens: impl Fn(usize) -> u32, len: usize) {
    let block_size = block_size.max(1);
    let mut buffer = Vec::with_capacity(block_size);
    while (hashes.len() + 1) * block_size <= len {
        let start = hashes.len() * block_size;
        buffer.clear();
        buffer.extend((start..start + block_size).map(&tokens));
        let parent = hashes.last().copied().unwrap_or(ROOT_HASH);
        hashes.push(block_hash(parent, &buffer));
    }
}

#[derive(Debug)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u64>>,
    /// The free queue, a doubly linked list over block ids.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: u64,
    cached: HashMap<u64, BlockId>,
}

impl BlockPool {
    pub fn new(blocks: u64) -> Self {
        let n = blocks.min(u64::from(NONE - 1)) as u32;
        let mut pool = Self {
            ref_cnt: vec![0; n as usize],
            hash: vec![None; n as usize],
            prev: vec![NONE; n as usize],
            next: vec![NONE; n as usize],
            head: NONE,
            tail: NONE,
            free: 0,
            cached: HashMap::new(),
        };
        for block in 0..n {
            pool.push_back(block);
        }
        pool
    }

    pub fn num_blocks(&self) -> u64 {
        self.ref_cnt.len() as u64
    }

    /// Blocks no request holds (cached ones among them, evictable).
    pub fn free_blocks(&self) -> u64 {
        self.free
    }

    /// vLLM's `kv_cache_usage`: the share of blocks requests hold.
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks();
        if total == 0 {
            return 0.0;
        }
        1.0 - self.free as f64 / total as f64
    }

    /// Blocks known by a hash (held or free).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// The cached block with this hash, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_cnt.get(block as usize).copied().unwrap_or(0)
    }

    /// A cache hit: the block is held once more (taken out of the free
    /// queue if nobody held it).
    pub fn touch(&mut self, block: BlockId) {
        let Some(count) = self.ref_cnt.get(block as usize).copied() else {
            return;
        };
        if count == 0 {
            self.remove(block);
        }
        self.ref_cnt[block as usize] = count + 1;
    }

    /// A new block from the head of the free queue, its cached content
    /// evicted; None when no block is free.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = self.head;
        if block == NONE {
            return None;
        }
        self.remove(block);
        if let Some(hash) = self.hash[block as usize].take() {
            if self.cached.get(&hash) == Some(&block) {
                self.cached.remove(&hash);
            }
        }
        self.ref_cnt[block as usize] = 1;
        Some(block)
    }

    /// Drops one hold; a block nobody holds joins the tail of the free
    /// queue (keeping its cached content until it is reused).
    pub fn release(&mut self, block: BlockId) {
        let Some(count) = self.ref_cnt.get(block as usize).copied() else {
            return;
        };
        let count = count.saturating_sub(1);
        self.ref_cnt[block as usize] = count;
        if count == 0 {
            self.push_back(block);
        }
    }

    /// A block became full: it is cached under `hash` (unless another block
    /// already is; the map keeps one block per hash).
    pub fn commit(&mut self, block: BlockId, hash: u64) {
        if self.hash.get(block as usize).is_none_or(Option::is_some) {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(entry) = self.cached.entry(hash) {
            entry.insert(block);
            self.hash[block as usize] = Some(hash);
        }
    }

    fn push_back(&mut self, block: BlockId) {
        let b = block as usize;
        self.prev[b] = self.tail;
        self.next[b] = NONE;
        if self.tail == NONE {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.free += 1;
    }

    fn remove(&mut self, block: BlockId) {
        let b = block as usize;
        let (prev, next) = (self.prev[b], self.next[b]);
        if prev == NONE {
            self.head = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NONE {
            self.tail = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        self.prev[b] = NONE;
        self.next[b] = NONE;
        self.free -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_full_blocks_only() {
        let tokens: Vec<u32> = (0..40).collect();
        let mut hashes = Vec::new();
        extend_hashes(&mut hashes, 16, |i| tokens[i], tokens.len());
        assert_eq!(hashes.len(), 2);
        // The same block after another prefix hashes differently.
        let mut other: Vec<u32> = (100..116).collect();
        other.extend(16..32);
        let mut other_hashes = Vec::new();
        extend_hashes(&mut other_hashes, 16, |i| other[i], other.len());
        assert_ne!(hashes[1], other_hashes[1]);
        // Extending continues the chain.
        let mut partial = vec![hashes[0]];
        extend_hashes(&mut partial, 16, |i| tokens[i], 32);
        assert_eq!(partial, hashes);
    }

    #[test]
    fn free_blocks_are_reused_least_recently_freed_first_and_lose_their_hash() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let c = pool.allocate().unwrap();
        assert_eq!(pool.allocate(), None);
        pool.commit(a, 11);
        pool.commit(b, 22);
        pool.commit(c, 33);
        // Freed tail first: c, then b, then a.
        for block in [c, b, a] {
            pool.release(block);
        }
        assert_eq!((pool.free_blocks(), pool.cached_blocks()), (3, 3));
        // A hit on b takes it off the free queue; its content stays.
        pool.touch(b);
        assert_eq!(pool.free_blocks(), 2);
        // The least recently freed (c) goes first, then a.
        assert_eq!(pool.allocate(), Some(c));
        assert_eq!(pool.lookup(33), None);
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.lookup(11), None);
        assert_eq!(pool.lookup(22), Some(b));
        assert!((pool.usage() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_hash_is_cached_once() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        pool.commit(a, 7);
        pool.commit(b, 7);
        assert_eq!(pool.lookup(7), Some(a));
        // Reusing b does not evict a's entry.
        pool.release(b);
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.lookup(7), Some(a));
    }
}
