//! One worker's approximate prefix index, as kept in shared data: per rank,
//! the hashes of the prompt blocks dprank routed there, each with when it
//! was last routed to, laid out to be small and read in place (5 bytes a
//! block; docs/architecture.md, "The prefix index").

use crate::codec::{bytes, Record, RecordView};
use crate::config::prefix::{MAX_BLOCKS_PER_RANK, MAX_TTL_MS};
use crate::config::MAX_DP_SIZE;
use serde::{Deserialize, Serialize};

/// Milliseconds per stamp unit.
pub const STAMP_MS: u64 = 100;
/// A stamp is refreshed (and the record written) when a routed prompt
/// finds its blocks older than this; fresher ones are left as they are.
pub const TOUCH_AFTER_MS: u64 = 1000;
/// Rebase the stamps when they reach this many units (of 65535).
const REBASE_AFTER_UNITS: u64 = 60_000;
/// A rebased or fresh record's base lies this far back (in units), so deeper
/// blocks' stamps (`now - depth`) never go below it.
const BASE_MARGIN_UNITS: u64 = 16;
/// Stamps of deeper blocks are one unit older per block, up to this.
const MAX_DEPTH_OFFSET: u16 = 7;
/// Bytes of a stored key (the top 24 bits of a block hash).
const KEY_BYTES: usize = 3;
// The longest TTL, the base's margin and the deepest offset fit below the
// rebase point: a live stamp is never cut off by a rebase.
const _: () =
    assert!(MAX_TTL_MS / STAMP_MS + BASE_MARGIN_UNITS + MAX_DEPTH_OFFSET as u64 <= REBASE_AFTER_UNITS);

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
    /// Sorted 3-byte little-endian keys.
    #[serde(with = "bytes")]
    keys: Vec<u8>,
    /// Little-endian u16 stamps, in the order of `keys`.
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
    keys: &'a [u8],
    stamps: &'a [u8],
}

/// Kept at `<p>.px.<ip:port>` (`shared_data.rs`).
impl Record for IndexRecord {
    const TAG: [u8; 4] = *b"DPX1";
}

impl<'a> RecordView<'a> for IndexView<'a> {
    const TAG: [u8; 4] = IndexRecord::TAG;
    fn within_limits(&self) -> bool {
        IndexView::within_limits(self)
    }
}

/// The stored key of a block hash.
pub fn key_of(hash: u32) -> u32 {
    hash >> 8
}

fn key_at(keys: &[u8], i: usize) -> u32 {
    match keys.get(KEY_BYTES * i..KEY_BYTES * i + KEY_BYTES) {
        Some(&[a, b, c]) => u32::from_le_bytes([a, b, c, 0]),
        _ => 0,
    }
}

fn stamp_at(stamps: &[u8], i: usize) -> u16 {
    match stamps.get(2 * i..2 * i + 2) {
        Some(&[a, b]) => u16::from_le_bytes([a, b]),
        _ => 0,
    }
}

impl<'a> IndexView<'a> {
    /// Whether the sizes are within what dprank ever writes.
    pub fn within_limits(&self) -> bool {
        self.ranks.len() <= MAX_DP_SIZE as usize
            && self.ranks.iter().all(|r| {
                r.keys.len().is_multiple_of(KEY_BYTES)
                    && r.stamps.len() * KEY_BYTES == r.keys.len() * 2
                    && r.len() <= MAX_BLOCKS_PER_RANK
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

    /// The earliest stamp still alive at `now_ms` under `ttl_ms` (above
    /// every stamp when nothing can be).
    pub fn alive_from(&self, now_ms: u64, ttl_ms: u64) -> u32 {
        alive_from(self.base_ms, now_ms, ttl_ms)
    }
}

/// The first stamp (in units after `base_ms`) alive at `now_ms` under
/// `ttl_ms`; u32 so that "none alive" is above every u16 stamp.
fn alive_from(base_ms: u64, now_ms: u64, ttl_ms: u64) -> u32 {
    let from = now_ms.saturating_sub(ttl_ms).saturating_sub(base_ms);
    from.div_ceil(STAMP_MS).min(u64::from(u32::MAX)) as u32
}

impl RankView<'_> {
    pub fn len(&self) -> usize {
        self.keys.len() / KEY_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The stamp of the block `hash`, if the rank holds it.
    pub fn stamp(&self, hash: u32) -> Option<u32> {
        let key = key_of(hash);
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match key_at(self.keys, mid).cmp(&key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(u32::from(stamp_at(self.stamps, mid))),
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
        self.keys.len() / KEY_BYTES
    }

    /// (key, stamp) pairs, sorted by key.
    fn entries(&self) -> Vec<(u32, u16)> {
        (0..self.len())
            .map(|i| (key_at(&self.keys, i), stamp_at(&self.stamps, i)))
            .collect()
    }

    fn set(&mut self, entries: &[(u32, u16)]) {
        self.keys.clear();
        self.stamps.clear();
        for (k, s) in entries {
            self.keys.extend_from_slice(&k.to_le_bytes()[..KEY_BYTES]);
            self.stamps.extend_from_slice(&s.to_le_bytes());
        }
    }
}

/// Keeps the `keep` most recently stamped entries (sorted by key, as given).
fn keep_newest(entries: &mut Vec<(u32, u16)>, keep: usize) {
    if entries.len() <= keep {
        return;
    }
    if keep == 0 {
        entries.clear();
        return;
    }
    let mut stamps: Vec<u16> = entries.iter().map(|e| e.1).collect();
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
            base_ms: now_ms.saturating_sub(BASE_MARGIN_UNITS * STAMP_MS),
            ranks: Vec::new(),
        }
    }

    /// Tests: an index of 64-byte blocks holding `chains` on `rank`, routed
    /// there at `at_ms` (the default TTL, 100 blocks a rank).
    #[cfg(test)]
    pub fn holding(rank: usize, chains: &[&[u32]], at_ms: u64) -> IndexRecord {
        let mut index = IndexRecord::empty(64, at_ms);
        index.touch(rank, chains, at_ms, crate::config::Prefix::default().ttl_ms, 100);
        index
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
                        keys: r.keys.to_vec(),
                        stamps: r.stamps.to_vec(),
                    })
                    .collect(),
            },
            _ => IndexRecord::empty(block_bytes, now_ms),
        }
    }

    /// The stamp of `now_ms`, rebasing first if it would not fit. Stamps
    /// that fall below the new base become 0: older than any TTL allowed.
    fn stamp_now(&mut self, now_ms: u64) -> u16 {
        if now_ms.saturating_sub(self.base_ms) / STAMP_MS >= REBASE_AFTER_UNITS {
            let base = now_ms.saturating_sub((MAX_TTL_MS / STAMP_MS + BASE_MARGIN_UNITS) * STAMP_MS);
            let shift = (base.saturating_sub(self.base_ms) / STAMP_MS).min(u64::from(u16::MAX)) as u16;
            let base = self.base_ms + u64::from(shift) * STAMP_MS;
            for rank in &mut self.ranks {
                let mut entries = rank.entries();
                for e in &mut entries {
                    e.1 = e.1.saturating_sub(shift);
                }
                rank.set(&entries);
            }
            self.base_ms = base;
        }
        (now_ms.saturating_sub(self.base_ms) / STAMP_MS).min(u64::from(u16::MAX)) as u16
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
        let alive_from = alive_from(self.base_ms, now_ms, ttl_ms);
        let Some(record) = self.rank_mut(rank) else {
            return false;
        };
        let mut new: Vec<(u32, u16)> = chains
            .iter()
            .flat_map(|chain| {
                chain.iter().enumerate().map(move |(depth, h)| {
                    let older = (depth as u16).min(MAX_DEPTH_OFFSET);
                    (key_of(*h), now.saturating_sub(older))
                })
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
                    if n.1 >= o.1.saturating_add((TOUCH_AFTER_MS / STAMP_MS) as u16) {
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
        merged.retain(|e| u32::from(e.1) >= alive_from);
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
    use crate::codec::{decode_view, encode};

    const NOW: u64 = 1_800_000_000_000;
    const TTL: u64 = 60_000;

    /// Block hashes that differ in their stored keys.
    fn c(ids: &[u32]) -> Vec<u32> {
        ids.iter().map(|i| i << 8).collect()
    }

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
        assert!(r.touch(2, &[&c(&[10, 20, 30, 40])], NOW, TTL, 100));
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 2, &c(&[10, 20, 30, 40, 50]), NOW), 4);
        assert_eq!(matched(&bytes, 2, &c(&[10, 20, 99, 40]), NOW), 2);
        assert_eq!(matched(&bytes, 2, &c(&[11, 20]), NOW), 0);
        assert_eq!(matched(&bytes, 0, &c(&[10, 20]), NOW), 0, "another rank");
        assert_eq!(matched(&bytes, 7, &c(&[10]), NOW), 0, "a rank never written");
        assert_eq!(matched(&bytes, 2, &c(&[]), NOW), 0);
    }

    #[test]
    fn fresh_blocks_are_not_written_again() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&c(&[1, 2, 3])], NOW, TTL, 100);
        assert!(
            !r.touch(0, &[&c(&[1, 2])], NOW + 500, TTL, 100),
            "fresh: no write"
        );
        assert!(r.touch(0, &[&c(&[1, 2])], NOW + 5000, TTL, 100), "refreshed");
        assert!(r.touch(0, &[&c(&[1, 2, 4])], NOW + 5001, TTL, 100), "a new block");
    }

    #[test]
    fn the_least_recently_routed_blocks_leave_first_deepest_first() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&c(&[1, 2, 3, 4])], NOW, TTL, 6);
        r.touch(0, &[&c(&[5, 6])], NOW + 10, TTL, 6);
        r.touch(0, &[&c(&[1])], NOW + 5000, TTL, 6);
        // Two more blocks: over capacity by two; 3 and 4 (old, deep) go.
        r.touch(0, &[&c(&[7, 8])], NOW + 6000, TTL, 6);
        assert_eq!(r.len(0), 6);
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 0, &c(&[1, 2, 3, 4]), NOW + 6000), 2);
        assert_eq!(matched(&bytes, 0, &c(&[5, 6]), NOW + 6000), 2);
        assert_eq!(matched(&bytes, 0, &c(&[7, 8]), NOW + 6000), 2);
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(1, &[&c(&[1, 2])], NOW, TTL, 100);
        r.touch(1, &[&c(&[3])], NOW + TTL / 2, TTL, 100);
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 1, &c(&[1, 2]), NOW + TTL - 100), 2);
        assert_eq!(matched(&bytes, 1, &c(&[1, 2]), NOW + TTL + 1), 0, "read as gone");
        assert_eq!(matched(&bytes, 1, &c(&[3]), NOW + TTL + 1), 1);
        // The next write drops them.
        assert!(r.touch(1, &[&c(&[3])], NOW + TTL + 1, TTL, 100));
        assert_eq!(r.len(1), 1);
    }

    #[test]
    fn shrinking_keeps_the_most_recent_share() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&c(&[1, 2])], NOW, TTL, 100);
        r.touch(0, &[&c(&[3, 4])], NOW + 2000, TTL, 100);
        assert!(r.shrink(0, 0.5));
        let bytes = view(&r);
        assert_eq!(matched(&bytes, 0, &c(&[1, 2]), NOW + 2000), 0);
        assert_eq!(matched(&bytes, 0, &c(&[3, 4]), NOW + 2000), 2);
        assert!(r.shrink(0, 0.0));
        assert_eq!(r.len(0), 0);
        assert!(!r.shrink(0, 0.0), "nothing left to give up");
        assert!(!r.shrink(5, 0.0));
    }

    #[test]
    fn another_block_size_or_a_damaged_value_reads_as_empty() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&c(&[1])], NOW, TTL, 100);
        let bytes = view(&r);
        let v: IndexView = decode_view(&bytes).unwrap();
        assert_eq!(IndexRecord::from_view(Some(&v), 512, NOW), r);
        assert_eq!(IndexRecord::from_view(Some(&v), 256, NOW).ranks.len(), 0);
        assert!(decode_view::<IndexView>(&bytes[..bytes.len() - 1]).is_none());
        let mut odd = r.clone();
        odd.ranks[0].stamps.push(0);
        assert!(decode_view::<IndexView>(&encode(&odd)).is_none(), "sizes differ");
    }

    #[test]
    fn stamps_are_rebased_before_they_overflow() {
        let mut r = IndexRecord::empty(512, NOW);
        let h = |i: u32| i << 8;
        r.touch(0, &[&[h(1)]], NOW, MAX_TTL_MS, 100);
        let mut at = NOW;
        // Hourly writes for a day: the stamps never wrap.
        for i in 2..26 {
            at += MAX_TTL_MS - 1000;
            r.touch(0, &[&[h(i), h(i - 1)]], at, MAX_TTL_MS, 100);
            let bytes = view(&r);
            assert_eq!(matched(&bytes, 0, &[h(i - 1)], at), 1, "write {i}");
            assert_eq!(matched(&bytes, 0, &[h(i)], at), 1, "write {i}");
        }
        assert!(r.base_ms > NOW);
        let bytes = view(&r);
        let v: IndexView = decode_view(&bytes).unwrap();
        let one = v.rank(0).unwrap();
        assert_eq!(one.len(), 3, "older ones expired");
        assert!(one.stamp(h(24)).unwrap() <= one.stamp(h(25)).unwrap());
        // A record not written for longer than any TTL reads as empty.
        assert_eq!(matched(&view(&r), 0, &[h(25)], at + 10 * MAX_TTL_MS), 0);
    }

    #[test]
    fn a_hole_in_a_chain_never_panics_and_gives_a_held_prefix() {
        let mut r = IndexRecord::empty(512, NOW);
        r.touch(0, &[&c(&[1, 2, 3, 4, 5, 6, 7, 8])], NOW, TTL, 100);
        let mut entries = r.ranks[0].entries();
        entries.retain(|e| e.0 != 3);
        r.ranks[0].set(&entries);
        let n = matched(&view(&r), 0, &c(&[1, 2, 3, 4, 5, 6, 7, 8]), NOW);
        assert!(n == 2 || n == 8, "{n}");
    }
}
