//! Picker `headroom` (`pick: "headroom"`): one of the `pick_choices` lowest
//! costs, drawn with chance proportional to its headroom, the gap between
//! its cost and the next cost above the choices. Gateways that share a fleet
//! each see only their own requests between polls; with `least_cost` all of
//! them send to the same stale minimum, with this they spread over the near
//! minima while a clearly cheaper candidate still takes nearly every request.

use super::least_cost::mix;
use crate::config::gateways::MAX_CHOICES;
use crate::config::Pick;
use crate::cost::{Slot, REMOVED};
use crate::scheduler::{Candidate, Context, Picker};

/// Salt for the draw, apart from `least_cost`'s tie sampling.
const DRAW_SALT: u64 = 0xA076_1D64_78BD_642F;

#[derive(Debug, Clone, Copy, Default)]
struct Kept {
    cost: u64,
    /// Orders equal costs by a per-request hash so ties spread.
    order: u64,
    worker: usize,
    rank: u32,
}

/// The `choices` + 1 lowest costs offered so far, cheapest first.
pub struct Headroom {
    tie_breaker: u64,
    choices: usize,
    kept: [Kept; MAX_CHOICES as usize + 1],
    len: usize,
}

impl Picker for Headroom {
    fn new(ctx: &Context) -> Headroom {
        let choices = match ctx.pick {
            Pick::Headroom { choices } => choices.clamp(1, MAX_CHOICES) as usize,
            Pick::LeastCost => 1,
        };
        Headroom {
            tie_breaker: ctx.tie_breaker,
            choices,
            kept: [Kept::default(); MAX_CHOICES as usize + 1],
            len: 0,
        }
    }

    fn offer(&mut self, worker: usize, costs: &[Slot]) {
        for (rank, &cost) in costs.iter().enumerate() {
            if cost != REMOVED {
                self.consider(worker, rank as u32, cost);
            }
        }
    }

    /// Full, only a cost up to the dearest kept's can enter (a tie by its order).
    fn max_useful_cost(&self) -> Slot {
        match self.kept.get(self.choices) {
            Some(dearest) if self.len > self.choices => dearest.cost,
            _ => Slot::MAX,
        }
    }

    fn pick(self) -> Option<Candidate> {
        let kept = self.kept.get(..self.len)?;
        let first = kept.first()?;
        let drawn = kept.get(..self.choices.min(kept.len()))?;
        // The reference: the next cost above the choices, or one above the
        // dearest when there are no more candidates.
        let reference = match kept.get(self.choices) {
            Some(next) => u128::from(next.cost),
            None => drawn.last().map_or(0, |k| u128::from(k.cost) + 1),
        };
        let weight = |k: &Kept| reference.saturating_sub(u128::from(k.cost));
        let total: u128 = drawn.iter().map(weight).sum();
        let chosen = if total == 0 {
            // Every choice costs as much as the next: uniform among them.
            let n = drawn.len() as u64;
            drawn.get((mix(self.tie_breaker, DRAW_SALT) % n) as usize)
        } else {
            let mut u = u128::from(mix(self.tie_breaker, DRAW_SALT)) % total;
            drawn.iter().find(|k| {
                let w = weight(k);
                if u < w {
                    return true;
                }
                u -= w;
                false
            })
        };
        let k = chosen.unwrap_or(first);
        Some(Candidate {
            worker: k.worker,
            rank: k.rank,
            cost: k.cost,
        })
    }
}

impl Headroom {
    #[inline]
    fn consider(&mut self, worker: usize, rank: u32, cost: u64) {
        let order = mix(self.tie_breaker, (worker as u64) << 32 | u64::from(rank));
        let key = (cost, order);
        let cap = self.choices + 1;
        if self.len == cap && self.kept.get(cap - 1).is_some_and(|k| (k.cost, k.order) <= key) {
            return;
        }
        // Insertion into the short sorted list, dropping the dearest when full.
        let mut at = self.len.min(cap - 1);
        while at > 0 && self.kept.get(at - 1).is_some_and(|k| (k.cost, k.order) > key) {
            if let Some(prev) = self.kept.get(at - 1).copied() {
                if let Some(slot) = self.kept.get_mut(at) {
                    *slot = prev;
                }
            }
            at -= 1;
        }
        if let Some(slot) = self.kept.get_mut(at) {
            *slot = Kept {
                cost,
                order,
                worker,
                rank,
            };
        }
        self.len = (self.len + 1).min(cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testing::ctx;
    use crate::scheduler::Constraint;
    use std::collections::HashMap;

    fn draws(choices: u32, offers: &[(usize, &[Slot])], n: u64) -> HashMap<(usize, u32), u64> {
        let mut picks = HashMap::new();
        for t in 0..n {
            let mut p = Headroom::new(&Context {
                tie_breaker: t,
                pick: Pick::Headroom { choices },
                ..ctx(Constraint::default())
            });
            for (w, costs) in offers {
                p.offer(*w, costs);
            }
            let c = p.pick().unwrap();
            *picks.entry((c.worker, c.rank)).or_insert(0) += 1;
        }
        picks
    }

    #[test]
    fn draws_among_the_cheapest_in_proportion_to_headroom() {
        // Costs 10, 20 and 40 (the reference): weights 30 and 20, never 40 or 90.
        let picks = draws(2, &[(0, &[40, 10]), (1, &[90, REMOVED, 20])], 5000);
        assert_eq!(picks.len(), 2, "{picks:?}");
        let (a, b) = (picks[&(0, 1)], picks[&(1, 2)]);
        assert!((2700..3300).contains(&a) && a + b == 5000, "about 3:2: {picks:?}");
    }

    #[test]
    fn a_clearly_cheaper_candidate_takes_nearly_everything() {
        // Weights 1001, 1 and 1 below the reference 1001; the fourth is never drawn.
        let picks = draws(3, &[(0, &[0, 1000, 1000, 1001])], 2000);
        assert!(picks[&(0, 0)] >= 1980, "{picks:?}");
        assert!(!picks.contains_key(&(0, 3)), "{picks:?}");
    }

    #[test]
    fn equal_costs_spread_and_few_candidates_still_pick() {
        let picks = draws(2, &[(0, &[5; 4])], 4000);
        assert_eq!(picks.len(), 4, "ties ordered per request: {picks:?}");
        assert!(picks.values().all(|n| *n > 700), "{picks:?}");
        assert_eq!(draws(4, &[(2, &[REMOVED, 7])], 10).get(&(2, 1)), Some(&10));
        let none = Headroom::new(&Context {
            pick: Pick::Headroom { choices: 2 },
            ..ctx(Constraint::default())
        });
        assert_eq!(none.pick(), None);
    }

    #[test]
    fn max_useful_cost_is_the_dearest_kept_once_full() {
        let mut p = Headroom::new(&Context {
            pick: Pick::Headroom { choices: 2 },
            ..ctx(Constraint::default())
        });
        p.offer(0, &[9, REMOVED, 4]);
        assert_eq!(p.max_useful_cost(), Slot::MAX, "room for one more");
        p.offer(1, &[6, 1]);
        assert_eq!(p.max_useful_cost(), 6, "keeps 1, 4 and 6");
    }

    #[test]
    fn deterministic_for_a_tie_breaker() {
        let offers: &[(usize, &[Slot])] = &[(0, &[3, 4, 6])];
        assert_eq!(draws(2, offers, 1), draws(2, offers, 1));
    }
}
