//! A radix (prefix) tree over token ids, as SGLang's `RadixCache` keeps one
//! per rank: page granular edges, a lock reference count per node (a node
//! used by a running request cannot be evicted), and eviction of unlocked
//! leaves in least-recently-used order.
//! Follows python/sglang/srt/mem_cache/radix_cache.py (match_prefix, insert,
//! inc_lock_ref / dec_lock_ref, evict).

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// A node of the tree; `ROOT` holds no tokens.
pub type NodeId = u32;
pub const ROOT: NodeId = 0;

/// Child keys are already hashes: spread them, nothing more.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0 ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Children = HashMap<u64, NodeId, BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    key: Vec<u32>,
    children: Children,
    lock_ref: u32,
    last_access: u64,
}

/// The prefix cache of one rank. Sizes are in tokens.
#[derive(Debug)]
pub struct RadixCache {
    page: usize,
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    total: u64,
    evictable: u64,
    /// Unlocked leaves by (last access, id): the eviction order.
    lru: BTreeSet<(u64, NodeId)>,
    tick: u64,
}

impl RadixCache {
    pub fn new(page: usize) -> Self {
        Self {
            page: page.max(1),
            nodes: vec![Node::default()],
            free: Vec::new(),
            total: 0,
            evictable: 0,
            lru: BTreeSet::new(),
            tick: 0,
        }
    }

    /// Tokens held.
    pub fn total_size(&self) -> u64 {
        self.total
    }

    /// Tokens held by nodes no running request locks.
    pub fn evictable_size(&self) -> u64 {
        self.evictable
    }

    /// Tokens held by locked nodes.
    pub fn protected_size(&self) -> u64 {
        self.total - self.evictable
    }

    fn page_key(&self, tokens: &[u32]) -> u64 {
        if self.page == 1 {
            return u64::from(tokens[0]);
        }
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for token in &tokens[..self.page] {
            hash = (hash ^ u64::from(*token)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        hash
    }

    /// Length of the common prefix of `a` and `b`, in whole pages.
    fn common_len(&self, a: &[u32], b: &[u32]) -> usize {
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        common / self.page * self.page
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn is_evictable_leaf(&self, id: NodeId) -> bool {
        let node = self.node(id);
        id != ROOT && node.lock_ref == 0 && node.children.is_empty()
    }

    /// Marks a node as just used (keeps the LRU order of leaves right).
    fn touch(&mut self, id: NodeId, tick: u64) {
        let was = self.node(id).last_access;
        if self.is_evictable_leaf(id) {
            self.lru.remove(&(was, id));
            self.lru.insert((tick, id));
        }
        self.node_mut(id).last_access = tick;
    }

    /// Tokens of `tokens` already held, in whole pages, without changing
    /// anything (used to estimate, never to admit).
    pub fn match_len(&self, tokens: &[u32]) -> usize {
        let mut node = ROOT;
        let mut pos = 0;
        while tokens.len() - pos >= self.page {
            let key = self.page_key(&tokens[pos..]);
            let Some(&child) = self.node(node).children.get(&key) else {
                break;
            };
            let child_key = &self.node(child).key;
            let common = self.common_len(child_key, &tokens[pos..]);
            pos += common;
            if common < child_key.len() {
                break;
            }
            node = child;
        }
        pos
    }

    /// Walks `tokens` down the tree, splitting the last edge where the
    /// match ends inside it and marking the path as used. Returns the
    /// matched length and the node that ends exactly there.
    fn descend(&mut self, tokens: &[u32]) -> (usize, NodeId) {
        self.tick += 1;
        let tick = self.tick;
        let mut node = ROOT;
        let mut pos = 0;
        while tokens.len() - pos >= self.page {
            let key = self.page_key(&tokens[pos..]);
            let Some(&child) = self.node(node).children.get(&key) else {
                break;
            };
            let common = self.common_len(&self.node(child).key, &tokens[pos..]);
            if common == 0 {
                break;
            }
            if common < self.node(child).key.len() {
                let mid = self.split(child, common);
                self.touch(mid, tick);
                return (pos + common, mid);
            }
            self.touch(child, tick);
            pos += common;
            node = child;
        }
        (pos, node)
    }

    /// The longest cached prefix of `tokens` (whole pages), with its node.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> (usize, NodeId) {
        self.descend(tokens)
    }

    /// Splits `id` after `at` tokens; returns the new upper node.
    fn split(&mut self, id: NodeId, at: usize) -> NodeId {
        let node = self.node_mut(id);
        let lower = node.key.split_off(at);
        let upper_key = std::mem::replace(&mut node.key, lower);
        let (parent, lock_ref, last_access) = (node.parent, node.lock_ref, node.last_access);
        let lower_key = self.page_key(&self.node(id).key);
        let upper_page_key = self.page_key(&upper_key);
        let mut children = Children::default();
        children.insert(lower_key, id);
        let mid = self.alloc(Node {
            parent,
            key: upper_key,
            children,
            lock_ref,
            last_access,
        });
        self.node_mut(id).parent = mid;
        self.node_mut(parent).children.insert(upper_page_key, mid);
        mid
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Inserts the whole pages of `tokens`. Returns how many tokens were
    /// already held (the caller frees its copies of those) and the node
    /// ending the inserted path.
    pub fn insert(&mut self, tokens: &[u32]) -> (usize, NodeId) {
        let len = tokens.len() / self.page * self.page;
        let tokens = &tokens[..len];
        let (pos, node) = self.descend(tokens);
        if pos == len {
            return (pos, node);
        }
        let tick = self.tick;
        if node != ROOT {
            // The parent stops being a leaf.
            let access = self.node(node).last_access;
            self.lru.remove(&(access, node));
        }
        let added = (len - pos) as u64;
        let key = self.page_key(&tokens[pos..]);
        let leaf = self.alloc(Node {
            parent: node,
            key: tokens[pos..].to_vec(),
            children: Children::default(),
            lock_ref: 0,
            last_access: tick,
        });
        self.node_mut(node).children.insert(key, leaf);
        self.total += added;
        self.evictable += added;
        self.lru.insert((tick, leaf));
        (pos, leaf)
    }

    /// A running request uses the path from `id` to the root.
    pub fn lock(&mut self, id: NodeId) {
        let mut id = id;
        while id != ROOT {
            let (len, access, was_unlocked) = {
                let node = self.node(id);
                (node.key.len() as u64, node.last_access, node.lock_ref == 0)
            };
            if was_unlocked {
                self.evictable -= len;
                self.lru.remove(&(access, id));
            }
            let node = self.node_mut(id);
            node.lock_ref += 1;
            id = node.parent;
        }
    }

    /// Releases a `lock`.
    pub fn unlock(&mut self, id: NodeId) {
        let mut id = id;
        while id != ROOT {
            let node = self.node_mut(id);
            node.lock_ref = node.lock_ref.saturating_sub(1);
            let parent = node.parent;
            if node.lock_ref == 0 {
                let (len, access) = (node.key.len() as u64, node.last_access);
                self.evictable += len;
                if self.node(id).children.is_empty() {
                    self.lru.insert((access, id));
                }
            }
            id = parent;
        }
    }

    /// Frees at least `tokens` tokens (if that many are evictable), least
    /// recently used leaves first; returns the tokens freed.
    pub fn evict(&mut self, tokens: u64) -> u64 {
        let mut freed = 0;
        while freed < tokens {
            let Some((_, id)) = self.lru.pop_first() else {
                break;
            };
            let node = std::mem::take(self.node_mut(id));
            let len = node.key.len() as u64;
            freed += len;
            self.total -= len;
            self.evictable -= len;
            let key = self.page_key(&node.key);
            let parent = node.parent;
            self.node_mut(parent).children.remove(&key);
            self.free.push(id);
            if self.is_evictable_leaf(parent) {
                let access = self.node(parent).last_access;
                self.lru.insert((access, parent));
            }
        }
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn match_insert_and_split() {
        let mut cache = RadixCache::new(1);
        assert_eq!(cache.insert(&seq(0..10)), (0, 1));
        assert_eq!(cache.total_size(), 10);
        // A shared prefix of 6 then a fork.
        let mut fork = seq(0..6);
        fork.extend([100, 101]);
        let (existing, _) = cache.insert(&fork);
        assert_eq!(existing, 6);
        assert_eq!(cache.total_size(), 12);
        assert_eq!(cache.match_len(&seq(0..10)), 10);
        assert_eq!(cache.match_len(&fork), 8);
        assert_eq!(cache.match_len(&[0, 1, 2, 7]), 3);
        assert_eq!(cache.match_len(&[5]), 0);
        let (len, node) = cache.match_prefix(&seq(0..4));
        assert_eq!(len, 4);
        assert_ne!(node, ROOT);
        assert_eq!(cache.total_size(), 12);
        assert_eq!(cache.evictable_size(), 12);
    }

    #[test]
    fn pages_are_whole() {
        let mut cache = RadixCache::new(4);
        let (existing, _) = cache.insert(&seq(0..10));
        assert_eq!(existing, 0);
        assert_eq!(cache.total_size(), 8);
        assert_eq!(cache.match_len(&seq(0..10)), 8);
        assert_eq!(cache.match_len(&[0, 1, 2, 3, 4, 5, 99, 7]), 4);
        assert_eq!(cache.match_len(&[0, 1, 2]), 0);
    }

    #[test]
    fn eviction_takes_unlocked_leaves_least_recent_first() {
        let mut cache = RadixCache::new(1);
        let a = seq(0..10);
        let b = seq(100..110);
        let c = seq(200..210);
        cache.insert(&a);
        cache.insert(&b);
        let (_, c_node) = cache.insert(&c);
        // Use a again: b is now the least recently used.
        cache.match_prefix(&a);
        cache.lock(c_node);
        assert_eq!(cache.protected_size(), 10);
        assert_eq!(cache.evict(5), 10);
        assert_eq!(cache.match_len(&b), 0);
        assert_eq!(cache.match_len(&a), 10);
        // Only a is evictable now; c is locked.
        assert_eq!(cache.evict(100), 10);
        assert_eq!(cache.match_len(&c), 10);
        assert_eq!(cache.total_size(), 10);
        cache.unlock(c_node);
        assert_eq!(cache.evictable_size(), 10);
        assert_eq!(cache.evict(1), 10);
        assert_eq!(cache.total_size(), 0);
    }

    #[test]
    fn locks_protect_the_whole_path_and_inner_nodes_evict_after_their_leaves() {
        let mut cache = RadixCache::new(1);
        cache.insert(&seq(0..10));
        let mut longer = seq(0..10);
        longer.extend(50..55);
        let (_, leaf) = cache.insert(&longer);
        cache.lock(leaf);
        assert_eq!(cache.evictable_size(), 0);
        assert_eq!(cache.evict(100), 0);
        cache.unlock(leaf);
        // The leaf goes first, then its parent.
        assert_eq!(cache.evict(1), 5);
        assert_eq!(cache.match_len(&longer), 10);
        assert_eq!(cache.evict(1), 10);
        assert_eq!(cache.total_size(), 0);
        assert_eq!(cache.evictable_size(), 0);
    }

    #[test]
    fn a_split_keeps_locks_on_both_halves() {
        let mut cache = RadixCache::new(1);
        let (_, node) = cache.insert(&seq(0..10));
        cache.lock(node);
        // Matching a shorter prefix splits the locked edge.
        let (len, upper) = cache.match_prefix(&seq(0..4));
        assert_eq!(len, 4);
        assert_ne!(upper, node);
        assert_eq!(cache.evictable_size(), 0);
        cache.unlock(node);
        assert_eq!(cache.evictable_size(), 10);
        assert_eq!(cache.evict(100), 10);
    }
}
