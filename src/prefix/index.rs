//! One worker's approximate prefix index, as kept in shared data (one key
//! per worker, `store.rs`): per rank, the hashes of the prompt blocks
//! dprank routed there (`blocks.rs`), each with when it was last routed to.
//!
//! The layout is made to be read in place, since every request reads the
//! index of every candidate worker: per rank, the hashes as a sorted array
//! of little-endian u32 and their stamps (ms after the record's `base_ms`)
//! in the same order, both as byte strings a decoded [`IndexView`] borrows.
//! A lookup is a binary search; how much of a prompt a rank holds is a
//! binary search over the prompt's chain (the index holds whole prefixes:
//! a prompt's blocks are recorded together, and deeper blocks get slightly
//! older stamps so that eviction takes them first). Writes (one per routed
//! request, to the chosen worker) rebuild the chosen rank's arrays.
//!
//! Each rank keeps at most its capacity in blocks (least recently routed
//! first out), forgets entries older than the TTL, and gives up part of its
//! entries when the rank reports far fewer cache hits than the index
//! expected (`state/prefill.rs`).

use crate::config::prefix::MAX_BLOCKS_PER_RANK;
use crate::config::MAX_DP_SIZE;
use crate::store::bytes;
use serde::{Deserialize, Serialize};

/// A stamp is refreshed (and the record written) when a routed prompt
/// finds its blocks older than this; fresher ones are left as they are.
pub const TOUCH_AFTER_MS: u32 = 1000;
/// Rebase the stamps when they would no longer fit in u32.
const REBASE_AFTER_MS: u64 = 1 << 31;
/// A fresh record's base lies this far back, so deeper blocks' stamps
/// (`now - depth`) never go below it.
const BASE_MARGIN_MS: u64 = 1 << 20;
/// Stamps of deeper blocks are older by 1 ms per block, up to this.
const MAX_DEPTH_OFFSET: u32 = 4095;

/// The stored form of a worker's index (tag `DPX1`), built to write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexRecord {
    /// The block size the hashes were made with; another size reads as empty.
    pub block_bytes: u32,
    /// Stamps are ms after this (ms since the Unix epoch).
    pub base_ms: u64,
    pub ranks: Vec<RankRecord>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRecord {
    /// Sorted little-endian u32 hashes.
    #[serde(with = "bytes")]
    hashes: Vec<u8>,
    /// Little-endian u32 stamps, in the order of `hashes`.
    #[serde(with = "bytes")]
    stamps: Vec<u8>,
}

/// A worker's index read in place from the shared-data value.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct IndexView<'a> {
    pub block_bytes: u32,
    pub base_ms: u64,
    #[serde(borrow)]
    ranks: Vec<RankView<'a>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct RankView<'a> {
    hashes: &'a [u8],
    stamps: &'a [u8],
}

fn word(bytes: &[u8], i: usize) -> u32 {
    bytes
        .get(4 * i..4 * i + 4)
        .and_then(|w| w.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

impl<'a> IndexView<'a> {
    /// Whether the sizes are within what dprank ever writes.
    pub fn within_limits(&self) -> bool {
        self.ranks.len() <= MAX_DP_SIZE as usize
            && self.ranks.iter().all(|r| {
                r.hashes.len().is_multiple_of(4)
                    && r.stamps.len() == r.hashes.len()
                    && r.hashes.len() / 4 <= MAX_BLOCKS_PER_RANK
            })
    }

    pub fn rank(&self, rank: usize) -> Option<RankView<'a>> {
        self.ranks.get(rank).copied()
    }

    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Entries of every rank.
    pub fn entries(&self) -> usize {
        self.ranks.iter().map(RankView::len).sum()
    }

    /// The earliest stamp still alive at `now_ms` under `ttl_ms`, in this
    /// record's stamp units.
    pub fn alive_from(&self, now_ms: u64, ttl_ms: u64) -> u32 {
        now_ms
            .saturating_sub(ttl_ms)
            .saturating_sub(self.base_ms)
            .min(u64::from(u32::MAX)) as u32
    }
}

impl RankView<'_> {
    pub fn len(&self) -> usize {
        self.hashes.len() / 4
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// The stamp of `hash`, if the rank holds it.
    pub fn stamp(&self, hash: u32) -> Option<u32> {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match word(self.hashes, mid).cmp(&hash) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(word(self.stamps, mid)),
            }
        }
        None
    }

    /// How many leading blocks of `chain` the rank holds with a stamp of at
    /// least `alive_from`.
    pub fn matched(&self, chain: &[u32], alive_from: u32) -> usize {
        let holds = |k: usize| {
            chain
                .get(k)
                .and_then(|h| self.stamp(*h))
                .is_some_and(|s| s >= alive_from)
        };
        // Largest n with blocks 0..n held: blocks are recorded as prefixes.
        let (mut lo, mut hi) = (0, chain.len());
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if holds(mid - 1) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

impl RankRecord {
    fn len(&self) -> usize {
        self.hashes.len() / 4
    }

    fn entries(&self) -> Vec<(u32, u32)> {
        (0..self.len())
            .map(|i| (word(&self.hashes, i), word(&self.stamps, i)))
            .collect()
    }

    fn set(&mut self, entries: &[(u32, u32)]) {
        self.hashes.clear();
        self.stamps.clear();
        for (h, s) in entries {
            self.hashes.extend_from_slice(&h.to_le_bytes());
            self.stamps.extend_from_slice(&s.to_le_bytes());
        }
    }
}

/// Keeps the `keep` most recently stamped entries (sorted by hash, as given).
fn keep_newest(entries: &mut Vec<(u32, u32)>, keep: usize) {
    if entries.len() <= keep {
        return;
    }
    if keep == 0 {
        entries.clear();
        return;
    }
    let mut stamps: Vec<u32> = entries.iter().map(|e| e.1).collect();
    let cut = entries.len() - keep;
    let (_, threshold, _) = stamps.select_nth_unstable(cut);
    let threshold = *threshold;
    // Entries older than the threshold go; of those at it, as many as needed.
    let mut at_threshold_to_drop = cut - entries.iter().filter(|e| e.1 < threshold).count();
    entries.retain(|e| {
        if e.1 < threshold {
            return false;
        }
        if e.1 == threshold && at_threshold_to_drop > 0 {
            at_threshold_to_drop -= 1;
            return false;
        }
        true
    });
}

impl IndexRecord {
    /// An empty index for blocks of `block_bytes`, at `now_ms`.
    pub fn empty(block_bytes: u32, now_ms: u64) -> IndexRecord {
        IndexRecord {
            block_bytes,
            base_ms: now_ms.saturating_sub(BASE_MARGIN_MS),
            ranks: Vec::new(),
        }
    }

    /// The record a view reads, to modify; an empty one if there is no view
    /// or it was made with another block size.
    pub fn from_view(view: Option<&IndexView>, block_bytes: u32, now_ms: u64) -> IndexRecord {
        match view {
            Some(v) if v.block_bytes == block_bytes => IndexRecord {
                block_bytes,
                base_ms: v.base_ms,
                ranks: v
                    .ranks
                    .iter()
                    .map(|r| RankRecord {
                        hashes: r.hashes.to_vec(),
                        stamps: r.stamps.to_vec(),
                    })
                    .collect(),
            },
            _ => IndexRecord::empty(block_bytes, now_ms),
        }
    }

    /// The stamp of `now_ms`, rebasing first if it no longer fits.
    fn stamp_now(&mut self, now_ms: u64) -> u32 {
        if now_ms.saturating_sub(self.base_ms) >= REBASE_AFTER_MS {
            let base = now_ms.saturating_sub(BASE_MARGIN_MS);
            let shift = base.saturating_sub(self.base_ms).min(u64::from(u32::MAX)) as u32;
            for rank in &mut self.ranks {
                let mut entries = rank.entries();
                for e in &mut entries {
                    e.1 = e.1.saturating_sub(shift);
                }
                rank.set(&entries);
            }
            self.base_ms = base;
        }
        now_ms.saturating_sub(self.base_ms) as u32
    }

    fn rank_mut(&mut self, rank: usize) -> Option<&mut RankRecord> {
        if rank >= MAX_DP_SIZE as usize {
            return None;
        }
        if self.ranks.len() <= rank {
            self.ranks.resize(rank + 1, RankRecord::default());
        }
        self.ranks.get_mut(rank)
    }

    /// Records that the prompts `chains` were routed to `rank` at `now_ms`:
    /// their blocks are added or refreshed, entries past `ttl_ms` dropped,
    /// and the least recently routed dropped beyond `capacity` blocks.
    /// Returns false when nothing changed enough to be written (every block
    /// already there and fresh).
    pub fn touch(
        &mut self,
        rank: usize,
        chains: &[&[u32]],
        now_ms: u64,
        ttl_ms: u64,
        capacity: usize,
    ) -> bool {
        let now = self.stamp_now(now_ms);
        let alive_from = now_ms.saturating_sub(ttl_ms).saturating_sub(self.base_ms) as u32;
        let Some(record) = self.rank_mut(rank) else {
            return false;
        };
        let mut new: Vec<(u32, u32)> = chains
            .iter()
            .flat_map(|chain| {
                chain
                    .iter()
                    .enumerate()
                    .map(move |(depth, h)| (*h, now.saturating_sub((depth as u32).min(MAX_DEPTH_OFFSET))))
            })
            .collect();
        new.sort_unstable();
        // Equal hashes (a batch of equal prompts): keep the newest stamp.
        new.dedup_by(|later, kept| {
            if later.0 == kept.0 {
                kept.1 = kept.1.max(later.1);
                true
            } else {
                false
            }
        });
        let old = record.entries();
        let mut changed = false;
        let mut merged = Vec::with_capacity(old.len() + new.len());
        let (mut i, mut j) = (0, 0);
        while i < old.len() || j < new.len() {
            match (old.get(i), new.get(j)) {
                (Some(o), Some(n)) if o.0 == n.0 => {
                    if n.1 >= o.1.saturating_add(TOUCH_AFTER_MS) {
                        changed = true;
                    }
                    merged.push((o.0, o.1.max(n.1)));
                    i += 1;
                    j += 1;
                }
                (Some(o), Some(n)) if o.0 < n.0 => {
                    merged.push(*o);
                    i += 1;
                }
                (Some(o), None) => {
                    merged.push(*o);
                    i += 1;
                }
                (_, Some(n)) => {
                    changed = true;
                    merged.push(*n);
                    j += 1;
                }
                (None, None) => break,
            }
        }
        let before = merged.len();
        merged.retain(|e| e.1 >= alive_from);
        keep_newest(&mut merged, capacity.min(MAX_BLOCKS_PER_RANK));
        changed |= merged.len() != before;
        if changed {
            record.set(&merged);
        }
        changed
    }

    /// Keeps `rank`'s `keep` share (0..=1) of its entries, the most
    /// recently routed; false if it had nothing to give up.
    pub fn shrink(&mut self, rank: usize, keep: f64) -> bool {
        let Some(record) = self.ranks.get_mut(rank) else {
            return false;
        };
        let mut entries = record.entries();
        let target = (entries.len() as f64 * keep.clamp(0.0, 1.0)).floor() as usize;
        if target >= entries.len() {
            return false;
        }
        keep_newest(&mut entries, target);
        record.set(&entries);
        true
    }

    /// Entries of `rank`.
    pub fn len(&self, rank: usize) -> usize {
        self.ranks.get(rank).map_or(0, RankRecord::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{decode_view, encode};

    const NOW: u64 = 1_800_000_000_000;
    const TTL: u64 = 60_000;

    fn view(record: &IndexRecord) -> Vec<u8> {
        encode(record)
    }

    fn matched(bytes: &[u8], rank: usize, chain: &[u32], now: u64) -> usize {
        let v: IndexView = decode_view(bytes).unwrap();
        let alive = v.alive_from(now, TTL);
        v.rank(rank).map_or(0, |r| r.matched(chain, alive))
    }

    #[test]
    fn a_recorded_prompt_matches_its_shared_prefix_only() {
        let mut r = IndexRecord::empty(512, NOW);
        assert!(r.touch(2, &[&[10, 20, 30, 40]], NOW, TTL, 100));
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 2, &[10, 20, 30, 40, 50], NOW), 4);
        assert_eq!(matched(&bytes, 2, &[10, 20, 99, 40], NOW), 2);
        assert_eq!(matched(&bytes, 2, &[11, 20], NOW), 0);
        assert_eq!(matched(&bytes, 0, &[10, 20], NOW), 0, "another rank");
        assert_eq!(matched(&bytes, 7, &[10], NOW), 0, "a rank never written");
        assert_eq!(matched(&bytes, 2, &[], NOW), 0);
    }

    #[test]
    fn fresh_blocks_are_not_written_again() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&[1, 2, 3]], NOW, TTL, 100);
        assert!(!r.touch(0, &[&[1, 2]], NOW + 500, TTL, 100), "fresh: no write");
        assert!(r.touch(0, &[&[1, 2]], NOW + 5000, TTL, 100), "refreshed");
        assert!(r.touch(0, &[&[1, 2, 4]], NOW + 5001, TTL, 100), "a new block");
    }

    #[test]
    fn the_least_recently_routed_blocks_leave_first_deepest_first() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&[1, 2, 3, 4]], NOW, TTL, 6);
        r.touch(0, &[&[5, 6]], NOW + 10, TTL, 6);
        r.touch(0, &[&[1]], NOW + 5000, TTL, 6);
        // Two more blocks: over capacity by two; 3 and 4 (old, deep) go.
        r.touch(0, &[&[7, 8]], NOW + 6000, TTL, 6);
        assert_eq!(r.len(0), 6);
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 0, &[1, 2, 3, 4], NOW + 6000), 2);
        assert_eq!(matched(&bytes, 0, &[5, 6], NOW + 6000), 2);
        assert_eq!(matched(&bytes, 0, &[7, 8], NOW + 6000), 2);
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(1, &[&[1, 2]], NOW, TTL, 100);
        r.touch(1, &[&[3]], NOW + TTL / 2, TTL, 100);
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 1, &[1, 2], NOW + TTL - 100), 2);
        assert_eq!(matched(&bytes, 1, &[1, 2], NOW + TTL + 1), 0, "read as gone");
        assert_eq!(matched(&bytes, 1, &[3], NOW + TTL + 1), 1);
        // The next write drops them.
        assert!(r.touch(1, &[&[3]], NOW + TTL + 1, TTL, 100));
        assert_eq!(r.len(1), 1);
    }

    #[test]
    fn shrinking_keeps_the_most_recent_share() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&[1, 2]], NOW, TTL, 100);
        r.touch(0, &[&[3, 4]], NOW + 2000, TTL, 100);
        assert!(r.shrink(0, 0.5));
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 0, &[1, 2], NOW + 2000), 0);
        assert_eq!(matched(&bytes, 0, &[3, 4], NOW + 2000), 2);
        assert!(r.shrink(0, 0.0));
        assert_eq!(r.len(0), 0);
        assert!(!r.shrink(0, 0.0), "nothing left to give up");
        assert!(!r.shrink(5, 0.0));
    }

    #[test]
    fn another_block_size_or_a_damaged_value_reads_as_empty() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&[1]], NOW, TTL, 100);
        let bytes = view(&r);
        let v: IndexView = decode_view(&bytes).unwrap();
        assert_eq!(IndexRecord::from_view(Some(&v), 512, NOW), r);
        assert_eq!(IndexRecord::from_view(Some(&v), 256, NOW).ranks.len(), 0);
        assert!(decode_view::<IndexView>(&bytes[..bytes.len() - 1]).is_none());
        let mut odd = r.clone();
        odd.ranks[0].stamps.pop();
        assert!(decode_view::<IndexView>(&encode(&odd)).is_none(), "sizes differ");
    }

    #[test]
    fn stamps_are_rebased_before_they_overflow() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&[1]], NOW, u64::MAX, 100);
        let later = NOW + REBASE_AFTER_MS + 5;
        r.touch(0, &[&[2]], later, u64::MAX, 100);
        assert!(r.base_ms > NOW);
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 0, &[2], later), 1);
        let v: IndexView = decode_view(&bytes).unwrap();
        let one = v.rank(0).unwrap();
        assert!(one.stamp(1).unwrap() < one.stamp(2).unwrap(), "order kept");
    }

    #[test]
    fn a_hole_in_a_chain_never_panics_and_gives_a_held_prefix() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&[1, 2, 3, 4, 5, 6, 7, 8]], NOW, TTL, 100);
        let mut entries = r.ranks[0].entries();
        entries.retain(|e| e.0 != 3);
        r.ranks[0].set(&entries);
        let n = matched(&view(&r), 0, &[1, 2, 3, 4, 5, 6, 7, 8], NOW);
        assert!(n == 2 || n == 8, "{n}");
    }
}
