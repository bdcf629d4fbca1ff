//! Shortcut `bound`: when every scorer only adds to a rank's load (the load
//! scorer unweighted, `peers`: no prefix affinity), no cost a worker's ranks
//! can carry is below its least load (`LoadTable::least`; filters only remove).
//! A worker whose least load is above what the picker could still take and
//! whose ranks' loads are not below their bars in the alternates' collector
//! changes nothing when offered, so it is passed over before its steps run
//! (its state is not even read); one that can change only one of them is
//! offered to that one. Choices, alternates and tie-breaking are
//! those of the full pass (`equivalence.rs`); only the work differs. A
//! fleet of spread loads skips most workers once a few cheap ones are seen;
//! one of equal loads (idle) skips none: there every worker ties the pick,
//! so `tally` counts those whose ties the picker will not take, once the
//! alternates are full, from their loads after only their filters ran (no
//! slots zeroed or scored, no second walk in the picker).

use super::by_rank::ByRank;
use super::least_cost::ties;
use super::{offered_ranks, Context, Filter, Picker, Step, Steps, WorkerView};
use crate::state::LoadTable;

/// Whether every cost is at least its rank's load: without prefix
/// affinity the scorers are `LOAD_SCORERS` (`Steps::of`), the load
/// unweighted, and they only add.
pub(super) fn applies(ctx: &Context) -> bool {
    ctx.prefix.is_none()
}

/// Which of the picker and the alternates' collector offering a worker
/// could change: a worker that can change neither is passed over, and one
/// is offered only to the one it can change (on an idle fleet every worker
/// ties the pick, while the alternates are full after the first few).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reach {
    pub picker: bool,
    pub by_rank: bool,
}

impl Reach {
    /// Offered to both, as without the shortcut.
    pub const BOTH: Reach = Reach {
        picker: true,
        by_rank: true,
    };

    pub fn nothing(&self) -> bool {
        !self.picker && !self.by_rank
    }
}

/// What offering worker `at` (a `LoadTable` index) could change: the picker
/// unless its least load is above the picker's bound, `by_rank` unless no
/// rank's load is below that rank's bar.
#[inline(always)]
pub(super) fn reach(loads: &LoadTable, at: usize, picker: &impl Picker, by_rank: Option<&ByRank>) -> Reach {
    let least = loads.least(at);
    let reach = Reach {
        picker: least <= picker.bound(),
        by_rank: by_rank.is_some_and(|b| !b.refuses(least, loads.worker(at))),
    };
    #[cfg(test)]
    PASSED_OVER.set(PASSED_OVER.get() + usize::from(reach.nothing()));
    reach
}

/// Whether a worker's costs are exactly its offered ranks' loads unless a
/// filter drops it whole: no prefix affinity (`applies`), the load the only
/// scorer, and every filter in force whole-worker (`Filter::whole`: in
/// practice `fresh` alone, a healthy fleet without a constraint). Decided
/// once per choice.
pub(super) fn tallies(ctx: &Context, steps: &Steps) -> bool {
    applies(ctx) && steps.scorers() == [Step::Load] && steps.filters().iter().all(Filter::whole)
}

/// Counts worker `view` into the picker without scoring its slots, when
/// `tallies` holds and offering its slots could only add ties that the
/// picker will not take (`Picker::tally`); the caller has found that it
/// cannot enter the alternates (`reach`). True when the worker is done
/// with (counted, or dropped by a filter); false: offer it as usual.
#[inline(always)]
pub(super) fn tally(ctx: &Context, steps: &Steps, view: &WorkerView, picker: &mut impl Picker) -> bool {
    // Its filters look at the state only (`tallies`): run on no slots.
    if !steps.filters().iter().all(|f| f.filter(ctx, view, &mut [])) {
        return true;
    }
    let ranks = offered_ranks(view.worker, view.state);
    let loads = view.loads.get(..ranks).unwrap_or(view.loads);
    let (least, tied) = ties(picker.bound(), loads);
    let counted = picker.tally(least, tied);
    #[cfg(test)]
    TALLIED.set(TALLIED.get() + usize::from(counted));
    counted
}

#[cfg(test)]
thread_local! {
    /// Workers counted by `tally` on this thread, likewise.
    pub(super) static TALLIED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
thread_local! {
    /// Workers passed over on this thread, for the equivalence test to
    /// check it reached the shortcut.
    pub(super) static PASSED_OVER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
mod tests {
    use super::super::least_cost::LeastCost;
    use super::super::testing::{ctx, prefix_request, state, worker};
    use super::super::{Constraint, Pick, REMOVED};
    use super::*;

    #[test]
    fn passes_over_workers_that_cannot_enter_the_pick_or_the_alternates() {
        let loads = LoadTable::of(&[Some(state(&[5, 9], 1000)), Some(state(&[7, 8], 1000)), None]);
        let plain = ctx(Constraint::default());
        let passes_over = |at, picker: &LeastCost, by_rank| reach(&loads, at, picker, by_rank).nothing();
        let mut picker = LeastCost::new(&plain);
        assert!(!passes_over(1, &picker, None), "nothing picked yet");
        picker.offer(0, loads.worker(0));
        assert!(passes_over(1, &picker, None), "7 > 5");
        assert!(passes_over(2, &picker, None), "no loads at all");
        let mut by_rank = ByRank::default();
        by_rank.reset(1);
        by_rank.offer(0, loads.worker(0));
        assert_eq!(
            reach(&loads, 1, &picker, Some(&by_rank)),
            Reach {
                picker: false,
                by_rank: true
            },
            "8 < 9 for rank 1's alternates"
        );
        by_rank.offer(1, &[REMOVED, 6]);
        assert!(passes_over(1, &picker, Some(&by_rank)), "7 >= 5 and 8 >= 6");
        let mut tie = LeastCost::new(&plain);
        tie.offer(0, &[7]);
        assert_eq!(
            reach(&loads, 1, &tie, Some(&by_rank)),
            Reach {
                picker: true,
                by_rank: false
            },
            "a tie of the pick may be taken; the alternates are full"
        );
        assert!(
            Reach {
                picker: false,
                by_rank: false
            }
            .nothing()
                && !Reach::BOTH.nothing()
        );
    }

    #[test]
    fn tallies_only_where_costs_are_the_loads_of_whole_workers() {
        let plain = ctx(Constraint::default());
        let steps = |ctx: &Context| super::super::Steps::of(ctx);
        assert!(tallies(&plain, &steps(&plain)), "fresh, then the load");
        let peers = Context { gateways: 2, ..plain };
        assert!(!tallies(&peers, &steps(&peers)), "peers add to the loads");
        let only = ctx(Constraint {
            only_rank: Some(0),
            pin: None,
        });
        assert!(!tallies(&only, &steps(&only)), "only_rank clears ranks");
        let mut health = crate::health::Health::default();
        health.envoy_unhealthy.push(worker("a", 1, None).address);
        let unhealthy = Context {
            health: &health,
            ..plain
        };
        assert!(!tallies(&unhealthy, &steps(&unhealthy)), "healthy clears ranks");
        assert!(Filter::whole(&Step::Fresh));
        assert!(![Step::Healthy, Step::OnlyRank, Step::Pinned]
            .iter()
            .any(Filter::whole));
    }

    #[test]
    fn tally_counts_ties_the_picker_will_not_take_after_the_filters_only() {
        let plain = ctx(Constraint::default());
        let steps = super::super::Steps::of(&plain);
        let w = [worker("a", 1, None), worker("b", 2, Some(2))];
        let states = [state(&[4, 4, 4], 1000), state(&[4, 4, 4], 1000), state(&[4], 0)];
        let all: Vec<_> = states.iter().cloned().map(Some).collect();
        let loads = LoadTable::of(&all);
        let view = |i: usize, worker| WorkerView {
            index: i,
            worker,
            state: &states[i],
            loads: loads.worker(i),
        };
        // The same picks and counts as offering b's two slots (dp_size 2).
        let (mut counted, mut taken) = (0, 0);
        for t in 0..300 {
            let at = Context {
                tie_breaker: t,
                ..plain
            };
            let (mut tallied, mut offered) = (LeastCost::new(&at), LeastCost::new(&at));
            assert!(
                !tally(&at, &steps, &view(0, &w[0]), &mut tallied),
                "nothing picked yet"
            );
            for p in [&mut tallied, &mut offered] {
                p.offer(0, loads.worker(0));
            }
            if tally(&at, &steps, &view(1, &w[1]), &mut tallied) {
                counted += 1;
            } else {
                taken += 1;
                tallied.offer(1, &[4, 4]);
            }
            offered.offer(1, &[4, 4]);
            for p in [&mut tallied, &mut offered] {
                p.offer(2, &[4, 4, 4]);
            }
            assert_eq!(tallied.pick(), offered.pick(), "tie breaker {t}");
        }
        assert!(counted > 50 && taken > 20, "counted {counted}, taken {taken}");
        let stale = Context {
            now_ms: 10_000,
            ..plain
        };
        let mut p = LeastCost::new(&stale);
        p.offer(0, &[4]);
        assert!(
            tally(&stale, &steps, &view(2, &w[0]), &mut p),
            "dropped: done with"
        );
        let mut cheaper = LeastCost::new(&plain);
        cheaper.offer(0, &[5]);
        assert!(
            !tally(&plain, &steps, &view(0, &w[0]), &mut cheaper),
            "beats the pick"
        );
        assert_eq!(cheaper.pick().map(|c| c.cost), Some(5), "nothing counted");
    }

    #[test]
    fn applies_only_where_costs_are_at_least_the_loads() {
        let plain = ctx(Constraint::default());
        assert!(applies(&plain));
        let peers = super::super::Context {
            gateways: 3,
            pick: Pick::Headroom { choices: 2 },
            ..plain
        };
        assert!(applies(&peers));
        for ctx in [plain, peers] {
            let steps = super::super::Steps::of(&ctx);
            assert!(
                steps.scorers().contains(&super::super::Step::Load)
                    && steps
                        .scorers()
                        .iter()
                        .all(|s| super::super::LOAD_SCORERS.contains(s)),
                "the unweighted load, and scorers that only add"
            );
        }
        let config = crate::config::Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load_weight":0.5}"#,
        )
        .unwrap();
        let settings = config.prefix.clone().unwrap();
        let request = prefix_request(&settings, crate::prefix::PromptBlocks::default(), 0);
        let prefix = super::super::Context {
            prefix: Some(&request),
            ..plain
        };
        assert!(
            !applies(&prefix),
            "prefix affinity weights the load and adds other costs"
        );
    }
}
