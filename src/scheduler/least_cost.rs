//! Picker `least_cost`: the candidate with the lowest cost, in one pass.
//! Among equal costs the pick is uniform for a given tie breaker (reservoir
//! sampling), so equal loads spread instead of all landing on rank 0.

use super::{Candidate, Context, Picker, Slot, REMOVED};

/// The least cost offered so far, ties sampled uniformly.
pub struct LeastCost {
    tie_breaker: u64,
    /// The pick's cost (u64::MAX before the first offer).
    cost: u64,
    pick: Option<Candidate>,
    /// How many candidates share the pick's cost so far.
    ties: u64,
}

impl Picker for LeastCost {
    fn new(ctx: &Context) -> LeastCost {
        LeastCost {
            tie_breaker: ctx.tie_breaker,
            cost: u64::MAX,
            pick: None,
            ties: 0,
        }
    }

    fn offer(&mut self, worker: usize, costs: &[Slot]) {
        for (rank, &cost) in costs.iter().enumerate() {
            // Most candidates cost more than the pick so far: one comparison.
            if cost <= self.cost && cost != REMOVED {
                self.consider(worker, rank, cost);
            }
        }
    }

    /// Only a cost up to the pick's, a tie, can change it.
    fn bound(&self) -> Slot {
        self.cost
    }

    fn pick(self) -> Option<Candidate> {
        self.pick
    }
}

impl LeastCost {
    #[inline]
    fn consider(&mut self, worker: usize, rank: usize, cost: u64) {
        if cost > self.cost {
            return;
        }
        if cost < self.cost || self.pick.is_none() {
            self.ties = 1;
        } else {
            // Reservoir sampling: the n-th tie replaces the pick with chance 1/n.
            self.ties += 1;
            if !mix(self.tie_breaker, self.ties).is_multiple_of(self.ties) {
                return;
            }
        }
        self.cost = cost;
        self.pick = Some(Candidate {
            worker,
            rank: rank as u32,
            cost,
        });
    }
}

/// splitmix64 of the tie breaker and the tie's position: a cheap, well-spread hash.
pub(super) fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::super::testing::ctx;
    use super::super::Constraint;
    use super::*;

    fn least_cost(candidates: impl Iterator<Item = Candidate>, tie_breaker: u64) -> Option<Candidate> {
        let mut picker = LeastCost::new(&Context {
            tie_breaker,
            ..ctx(Constraint::default())
        });
        for c in candidates {
            picker.consider(c.worker, c.rank as usize, c.cost);
        }
        picker.pick()
    }

    #[test]
    fn workers_are_offered_slot_by_slot() {
        let mut picker = LeastCost::new(&ctx(Constraint::default()));
        picker.offer(0, &[5, REMOVED, 7]);
        picker.offer(3, &[REMOVED, 2]);
        picker.offer(4, &[]);
        assert_eq!(picker.bound(), 2, "a tie may still be taken");
        assert_eq!(picker.pick(), Some(c(3, 1, 2)));
        assert_eq!(LeastCost::new(&ctx(Constraint::default())).pick(), None);
    }

    fn c(worker: usize, rank: u32, cost: u64) -> Candidate {
        Candidate { worker, rank, cost }
    }

    #[test]
    fn the_joint_minimum_across_workers() {
        let cands = [c(0, 0, 50), c(0, 1, 40), c(1, 0, 10), c(1, 1, 30)];
        assert_eq!(least_cost(cands.into_iter(), 0), Some(c(1, 0, 10)));
        assert_eq!(least_cost(std::iter::empty(), 0), None);
    }

    #[test]
    fn ties_spread_over_every_tied_candidate() {
        let cands = [c(0, 0, 1), c(0, 1, 1), c(1, 0, 9), c(1, 1, 1)];
        let mut picks = std::collections::HashMap::new();
        for t in 0..3000 {
            *picks
                .entry(least_cost(cands.into_iter(), t).unwrap())
                .or_insert(0) += 1;
        }
        assert_eq!(picks.len(), 3, "never the loaded one: {picks:?}");
        assert!(picks.values().all(|n| *n > 800), "roughly uniform: {picks:?}");
        assert_eq!(
            least_cost(cands.into_iter(), 7),
            least_cost(cands.into_iter(), 7),
            "deterministic"
        );
    }
}
