//! Collector `by_rank`: offered the same slots as the picker, keeps for
//! every rank the few cheapest workers (by cost, then worker), so that
//! `choose_with_alternates` finds the retry alternates of the rank it picks
//! in the pass that picks it, instead of a second pass over the fleet.

use super::{Candidate, Slot, REMOVED};

/// One rank's cheapest workers so far.
#[derive(Debug, Clone, Copy)]
struct Rank {
    /// The cost a worker must be below to be kept: the dearest kept once
    /// `keep` are, else `REMOVED` (so a removed slot never is).
    bar: Slot,
    /// How many of the rank's `keep` entries are filled.
    len: usize,
}

const EMPTY: Rank = Rank { bar: REMOVED, len: 0 };

/// Per rank, the `keep` cheapest (cost, worker) offered.
#[derive(Debug, Default)]
pub struct ByRank {
    keep: usize,
    ranks: Vec<Rank>,
    /// `keep` entries per rank, cheapest first.
    kept: Vec<(Slot, usize)>,
}

impl ByRank {
    /// Empties it to keep `keep` (at least one) per rank; the buffers stay.
    pub fn reset(&mut self, keep: usize) {
        self.keep = keep.max(1);
        self.ranks.clear();
        self.kept.clear();
    }

    /// Offers one worker's slots. Workers must be offered in increasing
    /// order: a worker that only ties the dearest kept is then not kept.
    #[inline(always)]
    pub fn offer(&mut self, worker: usize, costs: &[Slot]) {
        if self.ranks.len() < costs.len() {
            self.ranks.resize(costs.len(), EMPTY);
            self.kept.resize(costs.len() * self.keep, (REMOVED, 0));
        }
        for (r, (&cost, rank)) in costs.iter().zip(&mut self.ranks).enumerate() {
            // Most slots cost more than the rank's dearest kept: one comparison.
            if cost < rank.bar {
                let at = r * self.keep;
                if let Some(kept) = self.kept.get_mut(at..at + self.keep) {
                    insert(rank, kept, cost, worker);
                }
            }
        }
    }

    /// Up to `max` of `rank`'s kept workers other than `except`, cheapest
    /// first, as candidates (`offset` added to the worker).
    pub fn alternates(&self, rank: u32, except: usize, offset: usize, max: usize) -> Vec<Candidate> {
        let r = rank as usize;
        let (Some(entry), Some(kept)) = (self.ranks.get(r), self.kept.get(r * self.keep..)) else {
            return Vec::new();
        };
        kept.iter()
            .take(entry.len)
            .map(|&(cost, worker)| Candidate {
                worker: worker + offset,
                rank,
                cost,
            })
            .filter(|c| c.worker != except)
            .take(max)
            .collect()
    }
}

/// Puts (cost, worker) into its place in `kept`, dropping the dearest when full.
#[inline(never)]
fn insert(rank: &mut Rank, kept: &mut [(Slot, usize)], cost: Slot, worker: usize) {
    let new = (cost, worker);
    let mut at = rank.len.min(kept.len().saturating_sub(1));
    // Shift the dearer ones up by one (the last falls out when full).
    while at > 0 {
        match kept.get(at - 1).copied() {
            Some(prev) if prev > new => {
                if let Some(slot) = kept.get_mut(at) {
                    *slot = prev;
                }
                at -= 1;
            }
            _ => break,
        }
    }
    if let Some(slot) = kept.get_mut(at) {
        *slot = new;
    }
    rank.len = (rank.len + 1).min(kept.len());
    rank.bar = match kept.get(rank.len.wrapping_sub(1)) {
        Some(dearest) if rank.len == kept.len() => dearest.0,
        _ => REMOVED,
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(worker: usize, rank: u32, cost: u64) -> Candidate {
        Candidate { worker, rank, cost }
    }

    #[test]
    fn keeps_the_cheapest_workers_of_each_rank_in_order() {
        let mut by_rank = ByRank::default();
        by_rank.reset(3);
        by_rank.offer(0, &[5, 9]);
        by_rank.offer(1, &[REMOVED, 4, 7]);
        by_rank.offer(2, &[5, 4]);
        by_rank.offer(3, &[1, 4, 8]);
        by_rank.offer(4, &[2]);
        // Rank 0: 1 (w3), 2 (w4), 5 (w0); w2 ties w0 and comes later.
        assert_eq!(
            by_rank.alternates(0, 99, 0, 5),
            vec![c(3, 0, 1), c(4, 0, 2), c(0, 0, 5)]
        );
        // Rank 1: the ties stay in worker order; w0 (9) falls out.
        assert_eq!(
            by_rank.alternates(1, 99, 10, 5),
            vec![c(11, 1, 4), c(12, 1, 4), c(13, 1, 4)]
        );
        assert_eq!(
            by_rank.alternates(1, 12, 10, 5),
            vec![c(11, 1, 4), c(13, 1, 4)],
            "all but the chosen"
        );
        assert_eq!(by_rank.alternates(2, 1, 0, 1), vec![c(3, 2, 8)]);
        assert!(
            by_rank.alternates(3, 99, 0, 5).is_empty(),
            "a rank nobody offered"
        );
        by_rank.reset(1);
        by_rank.offer(0, &[REMOVED]);
        assert!(
            by_rank.alternates(0, 99, 0, 5).is_empty(),
            "removed slots are never kept"
        );
        by_rank.reset(0);
        by_rank.offer(7, &[3]);
        assert_eq!(
            by_rank.alternates(0, 99, 0, 5),
            vec![c(7, 0, 3)],
            "keeps one at least"
        );
    }
}
