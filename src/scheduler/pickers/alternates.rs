//! Collector `collector`: offered the same slots as the picker, keeps for
//! every rank the few cheapest workers (by cost, then worker), so that
//! `choose_with_alternates` finds the retry alternates of the rank it picks
//! in the pass that picks it, instead of a second pass over the fleet.

use crate::cost::{Slot, REMOVED};
use crate::scheduler::Candidate;

/// An empty place in a rank's list: dearer than any cost offered.
const EMPTY: (Slot, usize) = (REMOVED, 0);

/// Per rank, the `keep` cheapest (cost, worker) offered.
#[derive(Debug, Default)]
pub struct AlternatesCollector {
    keep: usize,
    /// Per rank, the cost a worker must be below to be kept: the dearest of
    /// its list (`REMOVED` while the list has room, so a removed slot never is).
    bars: Vec<Slot>,
    /// `keep` entries per rank, cheapest first, then `EMPTY`.
    kept: Vec<(Slot, usize)>,
    /// The dearest of `bars`: a worker costing at least this on every rank
    /// there is a bar for is kept nowhere (`refuses`).
    dearest: Slot,
}

impl AlternatesCollector {
    /// Empties it to keep `keep` (at least one) per rank; the buffers stay.
    pub fn reset(&mut self, keep: usize) {
        self.keep = keep.max(1);
        self.bars.clear();
        self.kept.clear();
        self.dearest = REMOVED;
    }

    /// Whether a worker whose slots cost at least `floors` (one per rank,
    /// the least of them `least`) would be kept nowhere if offered: every
    /// rank it has already has a bar, and no floor is below its rank's bar
    /// (`least` not below the dearest bar says so in one comparison).
    #[inline(always)]
    pub fn refuses(&self, least: Slot, floors: &[Slot]) -> bool {
        floors.len() <= self.bars.len()
            && (least >= self.dearest || floors.iter().zip(&self.bars).all(|(floor, bar)| floor >= bar))
    }

    /// Offers one worker's slots. Workers must be offered in increasing
    /// order: a worker that only ties the dearest kept is then not kept.
    #[inline(always)]
    pub fn offer(&mut self, worker: usize, costs: &[Slot]) {
        if self.bars.len() < costs.len() {
            self.bars.resize(costs.len(), REMOVED);
            self.kept.resize(costs.len() * self.keep, EMPTY);
            self.dearest = REMOVED;
        }
        let keep = self.keep;
        // Only lowering the dearest bar can lower `dearest`.
        let mut stale = false;
        for (r, (&cost, bar)) in costs.iter().zip(&mut self.bars).enumerate() {
            // Most slots cost more than the rank's dearest kept: one comparison.
            if cost < *bar {
                if let Some(kept) = self.kept.get_mut(r * keep..(r + 1) * keep) {
                    stale |= *bar == self.dearest;
                    *bar = insert(kept, (cost, worker));
                }
            }
        }
        if stale {
            self.dearest = self.bars.iter().fold(0, |dearest, bar| dearest.max(*bar));
        }
    }

    /// Up to `max` of `rank`'s kept workers other than `except`, cheapest
    /// first, as candidates (`offset` added to the worker).
    pub fn alternates(&self, rank: u32, except: usize, offset: usize, max: usize) -> Vec<Candidate> {
        let at = rank as usize * self.keep;
        let kept = self.kept.get(at..at + self.keep).unwrap_or_default();
        kept.iter()
            .take_while(|k| **k != EMPTY)
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

/// Puts `new` into its place in the sorted `kept` (the dearest falls out)
/// and returns the dearest kept now. Each place keeps the lesser of itself
/// and what is carried down: no search, and no branch to mispredict.
#[inline(never)]
fn insert(kept: &mut [(Slot, usize)], new: (Slot, usize)) -> Slot {
    let mut carried = new;
    for place in kept.iter_mut() {
        let lesser = carried.min(*place);
        carried = carried.max(*place);
        *place = lesser;
    }
    kept.last().map_or(REMOVED, |k| k.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(worker: usize, rank: u32, cost: u64) -> Candidate {
        Candidate { worker, rank, cost }
    }

    #[test]
    fn keeps_the_cheapest_workers_of_each_rank_in_order() {
        let mut collector = AlternatesCollector::default();
        collector.reset(3);
        collector.offer(0, &[5, 9]);
        collector.offer(1, &[REMOVED, 4, 7]);
        collector.offer(2, &[5, 4]);
        collector.offer(3, &[1, 4, 8]);
        collector.offer(4, &[2]);
        // Rank 0: 1 (w3), 2 (w4), 5 (w0); w2 ties w0 and comes later.
        assert_eq!(
            collector.alternates(0, 99, 0, 5),
            vec![c(3, 0, 1), c(4, 0, 2), c(0, 0, 5)]
        );
        // Rank 1: the ties stay in worker order; w0 (9) falls out.
        assert_eq!(
            collector.alternates(1, 99, 10, 5),
            vec![c(11, 1, 4), c(12, 1, 4), c(13, 1, 4)]
        );
        assert_eq!(
            collector.alternates(1, 12, 10, 5),
            vec![c(11, 1, 4), c(13, 1, 4)],
            "all but the chosen"
        );
        assert_eq!(collector.alternates(2, 1, 0, 1), vec![c(3, 2, 8)]);
        assert!(
            collector.alternates(3, 99, 0, 5).is_empty(),
            "a rank nobody offered"
        );
        collector.reset(1);
        collector.offer(0, &[REMOVED]);
        assert!(
            collector.alternates(0, 99, 0, 5).is_empty(),
            "removed slots are never kept"
        );
        collector.reset(0);
        assert!(!collector.refuses(5, &[5]), "no bar yet");
        collector.offer(7, &[3]);
        assert!(
            collector.refuses(3, &[3]),
            "a tie of the dearest kept is not kept"
        );
        assert!(!collector.refuses(2, &[2]), "cheaper");
        assert!(!collector.refuses(3, &[3, 3]), "a rank without a bar");
        collector.offer(8, &[4, 9]);
        assert!(collector.refuses(5, &[5, 9]), "at least each rank's bar (3, 9)");
        assert!(!collector.refuses(5, &[5, 8]), "below rank 1's");
        assert_eq!(
            collector.alternates(0, 99, 0, 5),
            vec![c(7, 0, 3)],
            "keeps one at least"
        );
    }
}
