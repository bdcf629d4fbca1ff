//! Counting a worker's ties without its slots: on an idle fleet every rank
//! ties the pick, so no worker can be passed over (`pass_over.rs`). When a
//! worker's costs are exactly its offered ranks' loads (the `load` scorer
//! alone, and every filter in force keeps or drops whole workers) and
//! offering it could only add ties the picker will not take, the picker
//! counts them from the loads, once the alternates are full: no slots
//! zeroed or scored, no second walk in the picker.

use crate::scheduler::pickers::least_cost::ties;
use crate::scheduler::profile::ScorerStep;
use crate::scheduler::steps::Steps;
use crate::scheduler::{offered_ranks, Context, Filter, Picker, WorkerView};

/// Whether a worker's costs are exactly its offered ranks' loads unless a
/// filter drops it whole: the rule applies (`super::applies`), the load is
/// the only scorer, and every filter in force keeps or drops whole workers
/// (in practice `fresh` alone, a healthy fleet without a constraint).
/// Decided once per choice.
pub(in crate::scheduler) fn counts_ties(ctx: &Context, steps: &Steps) -> bool {
    super::applies(ctx)
        && steps.scorers() == [ScorerStep::Load]
        && steps.filters().iter().all(Filter::drops_whole_workers_only)
}

/// Counts worker `view` into the picker without scoring its slots, when
/// `counts_ties` holds and offering its slots could only add ties that the
/// picker will not take (`Picker::count_ties`); the caller has found that
/// it cannot enter the alternates. True when the worker is done with
/// (counted, or dropped by a filter); false: offer it as usual.
#[inline(always)]
pub(in crate::scheduler) fn count_ties(
    ctx: &Context,
    steps: &Steps,
    view: &WorkerView,
    picker: &mut impl Picker,
) -> bool {
    // Its filters look at the state only (`counts_ties`): run on no slots.
    if !steps.filters().iter().all(|f| f.filter(ctx, view, &mut [])) {
        return true;
    }
    let ranks = offered_ranks(view.worker, view.state);
    let loads = view.loads.get(..ranks).unwrap_or(view.loads);
    let (least, tied) = ties(picker.max_useful_cost(), loads);
    let counted = picker.count_ties(least, tied);
    #[cfg(test)]
    super::COUNTED_UNSCORED.set(super::COUNTED_UNSCORED.get() + usize::from(counted));
    counted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::pickers::least_cost::LeastCost;
    use crate::scheduler::profile::FilterStep;
    use crate::scheduler::testing::{ctx, state, worker};
    use crate::scheduler::Constraint;
    use crate::worker_state::LoadTable;

    #[test]
    fn counts_ties_only_where_costs_are_the_loads_of_whole_workers() {
        let plain = ctx(Constraint::default());
        assert!(counts_ties(&plain, &Steps::of(&plain)), "fresh, then the load");
        let others = Context { gateways: 2, ..plain };
        assert!(
            !counts_ties(&others, &Steps::of(&others)),
            "other gateways' requests add to the loads"
        );
        let only = ctx(Constraint {
            only_rank: Some(0),
            pin: None,
        });
        assert!(!counts_ties(&only, &Steps::of(&only)), "only_rank clears ranks");
        let mut health = crate::health::Health::default();
        health.envoy_unhealthy.push(worker("a", 1, None).address);
        let unhealthy = Context {
            health: &health,
            ..plain
        };
        assert!(
            !counts_ties(&unhealthy, &Steps::of(&unhealthy)),
            "healthy clears ranks"
        );
        assert!(FilterStep::Fresh.drops_whole_workers_only());
        assert!(![FilterStep::Healthy, FilterStep::OnlyRank, FilterStep::Pinned]
            .iter()
            .any(Filter::drops_whole_workers_only));
    }

    #[test]
    fn counts_ties_the_picker_will_not_take_after_the_filters_only() {
        let plain = ctx(Constraint::default());
        let steps = Steps::of(&plain);
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
            let (mut unscored, mut offered) = (LeastCost::new(&at), LeastCost::new(&at));
            assert!(
                !count_ties(&at, &steps, &view(0, &w[0]), &mut unscored),
                "nothing picked yet"
            );
            for p in [&mut unscored, &mut offered] {
                p.offer(0, loads.worker(0));
            }
            if count_ties(&at, &steps, &view(1, &w[1]), &mut unscored) {
                counted += 1;
            } else {
                taken += 1;
                unscored.offer(1, &[4, 4]);
            }
            offered.offer(1, &[4, 4]);
            for p in [&mut unscored, &mut offered] {
                p.offer(2, &[4, 4, 4]);
            }
            assert_eq!(unscored.pick(), offered.pick(), "tie breaker {t}");
        }
        assert!(counted > 50 && taken > 20, "counted {counted}, taken {taken}");
        let stale = Context {
            now_ms: 10_000,
            ..plain
        };
        let mut p = LeastCost::new(&stale);
        p.offer(0, &[4]);
        assert!(
            count_ties(&stale, &steps, &view(2, &w[0]), &mut p),
            "dropped: done with"
        );
        let mut cheaper = LeastCost::new(&plain);
        cheaper.offer(0, &[5]);
        assert!(
            !count_ties(&plain, &steps, &view(0, &w[0]), &mut cheaper),
            "beats the pick"
        );
        assert_eq!(cheaper.pick().map(|c| c.cost), Some(5), "nothing counted");
    }
}
