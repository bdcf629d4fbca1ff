//! Picker `least_cost`: the candidate with the lowest cost, in one pass.
//! Among equal costs the pick is uniform for a given tie breaker (reservoir
//! sampling, skipping ahead between takes: `next_take`), so equal loads
//! spread instead of all landing on rank 0, and an idle fleet's thousands of
//! ties cost a count each rather than a draw each.

use crate::cost::{Slot, REMOVED};
use crate::scheduler::{Candidate, Context, Picker};

/// The least cost offered so far, ties sampled uniformly.
pub struct LeastCost {
    tie_breaker: u64,
    /// The pick's cost (u64::MAX before the first offer).
    cost: u64,
    pick: Option<Candidate>,
    /// How many candidates share the pick's cost so far.
    ties: u64,
    /// The tie (counted as `ties` counts) that replaces the pick next.
    next_take: u64,
}

impl Picker for LeastCost {
    fn new(ctx: &Context) -> LeastCost {
        LeastCost {
            tie_breaker: ctx.tie_breaker,
            cost: u64::MAX,
            pick: None,
            ties: 0,
            next_take: 0,
        }
    }

    fn offer(&mut self, worker: usize, costs: &[Slot]) {
        if self.only_ties(costs) {
            return;
        }
        for (rank, &cost) in costs.iter().enumerate() {
            // Most candidates cost more than the pick so far: one comparison.
            if cost <= self.cost && cost != REMOVED {
                self.consider(worker, rank, cost);
            }
        }
    }

    /// Only a cost up to the pick's, a tie, can change it.
    fn max_useful_cost(&self) -> Slot {
        self.cost
    }

    /// Nothing below the pick's cost and none of the ties the next taken:
    /// the ties are only counted.
    #[inline(always)]
    fn count_ties(&mut self, least: Slot, tied: u64) -> bool {
        let counted = self.pick.is_some()
            && (least > self.cost || (least == self.cost && self.ties + tied < self.next_take));
        if counted {
            self.ties += tied;
        }
        counted
    }

    fn pick(self) -> Option<Candidate> {
        self.pick
    }
}

impl LeastCost {
    /// Counts a worker at once when it has nothing below the pick's cost and
    /// none of its ties is the next taken (most workers of an idle fleet):
    /// branch-free over its slots, instead of a turn per tie.
    #[inline(always)]
    fn only_ties(&mut self, costs: &[Slot]) -> bool {
        if self.pick.is_none() {
            return false;
        }
        let (least, tied) = ties(self.cost, costs);
        self.count_ties(least, tied)
    }

    #[inline]
    fn consider(&mut self, worker: usize, rank: usize, cost: u64) {
        if cost > self.cost {
            return;
        }
        if cost < self.cost || self.pick.is_none() {
            self.ties = 1;
        } else {
            // Most ties are not taken: an increment and a comparison.
            self.ties += 1;
            if self.ties != self.next_take {
                return;
            }
        }
        self.next_take = next_take(self.tie_breaker, self.ties);
        self.cost = cost;
        self.pick = Some(Candidate {
            worker,
            rank: rank as u32,
            cost,
        });
    }
}

/// The least of `costs` and how many of them are `cost`, branch-free.
#[inline(always)]
pub(in crate::scheduler) fn ties(cost: Slot, costs: &[Slot]) -> (Slot, u64) {
    costs.iter().fold((REMOVED, 0u64), |(least, tied), &c| {
        (least.min(c), tied + u64::from(c == cost))
    })
}

/// Reservoir sampling by skips: when the `taken`-th tie has just become the
/// pick, the position of the next tie to replace it, J, is drawn at once.
/// The n-th tie replacing the pick with chance 1/n means no replacement
/// among ties `taken + 1..=m` with chance `taken / m`, so P(J > m) =
/// `taken / m`, and J = floor(`taken` / u) + 1 for u uniform in (0, 1]
/// (here in steps of 2^-32, from one `mix`). About ln(n) draws for n ties.
pub(in crate::scheduler) fn next_take(seed: u64, taken: u64) -> u64 {
    // u = (draw + 1) / 2^32.
    let draw = (mix(seed, taken) >> 32) + 1;
    let skip = match taken.checked_mul(1 << 32) {
        Some(scaled) => scaled / draw,
        // Past 2^32 ties (never, in practice): the same in 128 bits.
        None => u64::try_from((u128::from(taken) << 32) / u128::from(draw)).unwrap_or(u64::MAX),
    };
    skip.saturating_add(1)
}

/// splitmix64 of the tie breaker and the tie's position: a cheap, well-spread hash.
pub(in crate::scheduler) fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testing::ctx;
    use crate::scheduler::Constraint;

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
        assert_eq!(picker.max_useful_cost(), 2, "a tie may still be taken");
        assert_eq!(picker.pick(), Some(c(3, 1, 2)));
        assert_eq!(LeastCost::new(&ctx(Constraint::default())).pick(), None);
    }

    fn c(worker: usize, rank: u32, cost: u64) -> Candidate {
        Candidate { worker, rank, cost }
    }

    #[test]
    fn a_worker_of_ties_only_is_counted_at_once() {
        // The same picks as considering each slot in turn.
        for t in 0..500 {
            let mut by_worker = LeastCost::new(&Context {
                tie_breaker: t,
                ..ctx(Constraint::default())
            });
            let mut by_slot = LeastCost::new(&Context {
                tie_breaker: t,
                ..ctx(Constraint::default())
            });
            let workers: [&[Slot]; 5] = [&[4, 4], &[4, REMOVED, 4, 4], &[9], &[4; 8], &[3, 4, 3]];
            for (w, costs) in workers.iter().enumerate() {
                by_worker.offer(w, costs);
                for (r, &cost) in costs.iter().enumerate().filter(|(_, c)| **c != REMOVED) {
                    by_slot.consider(w, r, cost);
                }
            }
            assert_eq!(by_worker.ties, 2, "the 3s of the last worker");
            assert_eq!(by_worker.pick(), by_slot.pick(), "tie breaker {t}");
        }
    }

    #[test]
    fn counting_ties_unscored_counts_what_offering_would_only_count() {
        for t in 0..500 {
            let plain = Context {
                tie_breaker: t,
                ..ctx(Constraint::default())
            };
            let mut tallied = LeastCost::new(&plain);
            let mut offered = LeastCost::new(&plain);
            assert!(!tallied.count_ties(4, 2), "nothing picked yet");
            let workers: [&[Slot]; 6] = [&[4, 4], &[4, REMOVED, 4, 4], &[9], &[4; 8], &[3, 4, 3], &[3; 5]];
            for (w, costs) in workers.iter().enumerate() {
                let (least, tied) = ties(tallied.max_useful_cost(), costs);
                if !tallied.count_ties(least, tied) {
                    tallied.offer(w, costs);
                }
                offered.offer(w, costs);
                assert_eq!(tallied.ties, offered.ties, "tie breaker {t}, worker {w}");
            }
            assert_eq!(tallied.pick(), offered.pick(), "tie breaker {t}");
        }
        let mut picker = LeastCost::new(&ctx(Constraint::default()));
        picker.offer(0, &[4]);
        assert!(!picker.count_ties(3, 0), "below the pick");
        let room = picker.next_take - picker.ties - 1;
        assert!(!picker.count_ties(4, room + 1), "reaches the next take");
        assert!(
            picker.count_ties(9, 0) && picker.count_ties(4, room),
            "dearer, or ties short of it"
        );
        assert_eq!(picker.ties, 1 + room);
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

    /// Pearson's chi-square of `counts` against equal shares.
    fn chi_square(counts: &[u64]) -> f64 {
        let total: u64 = counts.iter().sum();
        let expected = total as f64 / counts.len() as f64;
        counts
            .iter()
            .map(|&n| (n as f64 - expected).powi(2) / expected)
            .sum()
    }

    #[test]
    fn ties_are_uniform_over_runs_of_any_length() {
        for n in [1usize, 2, 7, 100] {
            // The run follows dearer candidates and ties of a dearer cost
            // (a restart), and dearer ones are mixed in.
            let mut cands = vec![c(0, 0, 9), c(0, 1, 9)];
            for i in 0..n {
                cands.push(c(1 + i, 0, 3));
                cands.push(c(1 + i, 1, 4));
            }
            let trials = 200 * n.max(20) as u64;
            let mut counts = vec![0u64; n];
            for t in 0..trials {
                let pick = least_cost(cands.iter().copied(), t).unwrap();
                assert_eq!(pick.cost, 3, "only the least cost: {pick:?}");
                counts[pick.worker - 1] += 1;
            }
            // Well past the 1-in-10^5 tail of chi-square with n - 1 degrees
            // of freedom; one candidate twice as likely as the others fails.
            let dof = (n - 1) as f64;
            let limit = dof + 5.0 * (2.0 * dof).sqrt() + 10.0;
            let chi = chi_square(&counts);
            assert!(
                chi <= limit,
                "{n} ties: chi-square {chi:.1} > {limit:.1}: {counts:?}"
            );
        }
    }

    #[test]
    fn the_next_take_follows_the_reservoirs_odds() {
        // After the 3rd tie is taken, none of ties 4..=m replaces it with chance 3/m.
        let draws: Vec<u64> = (0..40_000).map(|seed| next_take(seed, 3)).collect();
        assert!(draws.iter().all(|j| *j > 3), "always a later tie");
        for (m, share) in [(4, 0.75), (6, 0.5), (30, 0.1), (300, 0.01)] {
            let later = draws.iter().filter(|j| **j > m).count() as f64 / draws.len() as f64;
            assert!(
                (later - share).abs() < 0.01,
                "P(J > {m}) = {later:.4}, not {share}"
            );
        }
        assert_eq!(next_take(5, 3), next_take(5, 3), "deterministic");
        assert!(next_take(5, u64::MAX / 2) > u64::MAX / 2, "no overflow");
        assert_eq!(next_take(5, u64::MAX), u64::MAX, "saturates");
    }
}
