//! Shortcuts that skip work without changing a choice (`equivalence.rs`
//! checks that choices, alternates and tie-breaking are those of the full
//! pass). Both rest on one rule: without prefix affinity, every scorer in
//! `LOAD_SCORERS` only adds to a slot and the `load` scorer adds each
//! rank's load unweighted, while filters only remove; so no cost a
//! worker's ranks can carry is below its least load (`LoadTable::least`).
//! `pass_over.rs` passes over a worker whose loads can neither be picked
//! nor enter any rank's alternates, before its steps run; `count_ties.rs`
//! counts a worker that could only add ties the picker will not take from
//! its loads alone (an idle fleet, where every rank ties). The test below
//! holds every load-only scorer to the rule.

mod count_ties;
mod pass_over;

pub(super) use count_ties::{count_ties, counts_ties};
pub(super) use pass_over::{offer_to, OfferTo};

use super::Context;

/// Whether the rule holds for `ctx`: without prefix affinity the scorers
/// are `LOAD_SCORERS` (`Steps::of`), the load unweighted.
pub(super) fn applies(ctx: &Context) -> bool {
    ctx.prefix.is_none()
}

#[cfg(test)]
thread_local! {
    /// Workers passed over on this thread, for the equivalence test to
    /// check it reached the shortcut.
    pub(super) static PASSED_OVER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Workers counted without their slots on this thread, likewise.
    pub(super) static COUNTED_UNSCORED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Pick;
    use crate::cost::{Slot, MAX_COST, REMOVED};
    use crate::health::Health;
    use crate::scheduler::pickers::least_cost::mix;
    use crate::scheduler::profile::{FilterStep, ScorerStep, FILTERS, LOAD_SCORERS};
    use crate::scheduler::steps::Steps;
    use crate::scheduler::testing::{ctx, eject, prefix_request, worker};
    use crate::scheduler::{Constraint, Filter, Scorer, WorkerView};
    use crate::worker_state::{LoadTable, WorkerState};

    /// A state with tokens (some unknown) and pending estimates on most ranks.
    fn drawn_state(seed: u64, ranks: usize) -> WorkerState {
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        let tokens: Vec<Option<u64>> = (0..ranks as u64)
            .map(|r| match mix(seed, r) % 10 {
                0 => None,
                1 => Some(u64::MAX - 1),
                n => Some(mix(seed, r + 100) % (n * 1000)),
            })
            .collect();
        s.apply_snapshot(seq, 1000, &tokens);
        for r in 0..ranks as u32 {
            let _ = s.add(0, r, mix(seed, u64::from(r) + 200) % 500);
        }
        s
    }

    /// Slots as a step may find them: zero, a cost so far, near the top, removed.
    fn drawn_slots(seed: u64, ranks: usize) -> Vec<Slot> {
        (0..ranks as u64)
            .map(|r| match mix(seed, r + 300) % 5 {
                0 => 0,
                1 => REMOVED,
                2 => MAX_COST - mix(seed, r) % 3,
                _ => mix(seed, r + 400) % 100_000,
            })
            .collect()
    }

    /// The contexts the rule is claimed for: every one without prefix
    /// affinity (gateways, picker, constraint and health drawn).
    fn load_only_contexts<'a>(health: &'a Health) -> Vec<Context<'a>> {
        let mut out = Vec::new();
        for gateways in [1, 2, 5, 1024] {
            for pick in [Pick::LeastCost, Pick::Headroom { choices: 3 }] {
                for only_rank in [None, Some(1)] {
                    for h in [&crate::health::NO_HEALTH, health] {
                        out.push(Context {
                            gateways,
                            pick,
                            health: h,
                            ..ctx(Constraint { only_rank, pin: None })
                        });
                    }
                }
            }
        }
        out
    }

    #[test]
    fn load_only_scorers_only_add_to_the_load() {
        let w = worker("a", 1, None);
        let mut health = Health::default();
        eject(
            &mut health,
            crate::health::Target {
                worker: w.address,
                rank: Some(2),
            },
            900,
        );
        let contexts = load_only_contexts(&health);
        assert!(
            LOAD_SCORERS.contains(&ScorerStep::Load),
            "the load is the floor of every cost"
        );
        for seed in 0..200u64 {
            let ranks = 1 + (seed % 9) as usize;
            let state = drawn_state(seed, ranks);
            let loads = LoadTable::of(std::slice::from_ref(&Some(state.clone())));
            let view = WorkerView {
                index: 0,
                worker: &w,
                state: &state,
                loads: loads.worker(0),
            };
            for ctx in &contexts {
                assert!(applies(ctx));
                // Each load-only scorer alone: it only adds.
                for scorer in LOAD_SCORERS {
                    let before = drawn_slots(seed, ranks);
                    let mut after = before.clone();
                    scorer.score(ctx, &view, &mut after);
                    for (rank, (b, a)) in before.iter().zip(&after).enumerate() {
                        assert!(
                            a >= b && (*b != REMOVED || *a == REMOVED),
                            "{scorer:?} lowered rank {rank} from {b} to {a} (seed {seed})"
                        );
                    }
                }
                // The whole load-only pass: every cost at least the rank's load.
                let steps = Steps::of(ctx);
                let mut slots = vec![0; ranks];
                if !steps.filters().iter().all(|f| f.filter(ctx, &view, &mut slots)) {
                    continue;
                }
                for scorer in steps.scorers() {
                    scorer.score(ctx, &view, &mut slots);
                }
                for (rank, (cost, load)) in slots.iter().zip(view.loads).enumerate() {
                    assert!(
                        cost >= load,
                        "rank {rank}: cost {cost} below its load {load} (seed {seed})"
                    );
                }
                if counts_ties(ctx, &steps) {
                    assert_eq!(
                        slots, view.loads,
                        "costs are the loads where ties are counted from them"
                    );
                }
            }
        }
    }

    #[test]
    fn filters_only_remove_and_whole_worker_filters_touch_no_slot() {
        let w = worker("a", 1, None);
        let mut health = Health::default();
        eject(
            &mut health,
            crate::health::Target {
                worker: w.address,
                rank: Some(0),
            },
            900,
        );
        let pinned = Context {
            constraint: Constraint {
                only_rank: Some(1),
                pin: Some("a/1"),
            },
            health: &health,
            ..ctx(Constraint::default())
        };
        for seed in 0..100u64 {
            let ranks = 2 + (seed % 7) as usize;
            let state = drawn_state(seed, ranks);
            let view = WorkerView {
                index: 0,
                worker: &w,
                state: &state,
                loads: &[],
            };
            for filter in FILTERS {
                let before = drawn_slots(seed, ranks);
                let mut after = before.clone();
                let kept = filter.filter(&pinned, &view, &mut after);
                for (b, a) in before.iter().zip(&after) {
                    assert!(a == b || *a == REMOVED, "{filter:?} changed a cost: {b} -> {a}");
                }
                if filter.drops_whole_workers_only() && kept {
                    assert_eq!(after, before, "{filter:?} claims to keep whole workers");
                }
            }
        }
        assert!(FilterStep::Fresh.drops_whole_workers_only());
    }

    #[test]
    fn prefix_affinity_is_outside_the_rule() {
        let plain = ctx(Constraint::default());
        let settings = crate::config::Prefix {
            load_weight: 0.5,
            ..crate::config::Prefix::default()
        };
        let request = prefix_request(&settings, crate::prefix::PromptBlocks::default(), 0);
        let prefix = Context {
            prefix: Some(&request),
            ..plain
        };
        assert!(applies(&plain));
        assert!(
            !applies(&prefix),
            "prefix affinity weights the load and adds other costs"
        );
    }
}
