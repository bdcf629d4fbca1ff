//! The runner: one pass over the pool per choice, worker by worker. Each
//! worker's steps work on a slice of cost slots, one per rank, reused from
//! choice to choice, and the picker (and the retry alternates' collector)
//! is offered the worker's slots as soon as they are scored: no candidate
//! list, a tight loop per worker and step. Workers the pruning finds
//! useless are passed over before their steps run.

use super::offered_ranks;
use super::pickers::alternates::AlternatesCollector;
use super::pickers::headroom::Headroom;
use super::pickers::least_cost::LeastCost;
use super::pruning::{self, OfferTo};
use super::steps::Steps;
use super::{Candidate, Constraint, Context, Filter, Picker, Pool, Scorer, WorkerView};
use crate::config::{Pick, Worker};
use crate::cost::{Slot, REMOVED};
use crate::worker_state::WorkerState;

thread_local! {
    /// The cost slots of the worker being scored, reused across choices (each
    /// VM is one thread).
    static SLOTS: std::cell::RefCell<Vec<Slot>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The alternates' collector of `choose_with_alternates`, reused likewise.
    static ALTERNATES: std::cell::RefCell<AlternatesCollector> = std::cell::RefCell::new(AlternatesCollector::default());
}

/// The pool's workers that have a state, as the steps see them.
fn views<'a>(pool: &'a Pool) -> impl Iterator<Item = WorkerView<'a>> {
    let states = pool.workers.iter().zip(pool.states).enumerate();
    states.filter_map(|(index, (worker, state))| Some(view(pool, index, worker, state.as_ref()?)))
}

/// Pool worker `index` with its state, as the steps see it.
#[inline(always)]
fn view<'a>(pool: &'a Pool, index: usize, worker: &'a Worker, state: &'a WorkerState) -> WorkerView<'a> {
    WorkerView {
        index,
        worker,
        state,
        loads: pool.loads.worker(index + pool.offset),
    }
}

/// Workers with at most this many ranks (an 8-GPU node) are scored in a
/// fixed-size array: zeroing it takes a few stores where a slice of any
/// length calls `memset`, once per worker.
const SMALL: usize = 8;

/// Where one worker's slots are written: `small` when they fit, else `buffer`.
struct Scratch<'a> {
    small: [Slot; SMALL],
    buffer: &'a mut Vec<Slot>,
}

/// Runs `f` with this thread's scratch for one worker's slots.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SLOTS.with_borrow_mut(|buffer| {
        f(&mut Scratch {
            small: [0; SMALL],
            buffer,
        })
    })
}

impl Scratch<'_> {
    /// `n` slots, zeroed.
    #[inline(always)]
    fn zeroed(&mut self, n: usize) -> &mut [Slot] {
        if n <= SMALL {
            self.small = [0; SMALL];
            if let Some(slots) = self.small.get_mut(..n) {
                return slots;
            }
        }
        self.buffer.clear();
        self.buffer.resize(n, 0);
        self.buffer.as_mut_slice()
    }
}

/// Runs the filters on one worker in `scratch`: its slots (one per rank,
/// `REMOVED`: removed) with nothing scored yet; None when a filter dropped
/// the whole worker.
#[inline(always)]
fn run_filters<'s>(
    ctx: &Context,
    steps: &Steps,
    view: &WorkerView,
    scratch: &'s mut Scratch,
) -> Option<&'s mut [Slot]> {
    let mut ranks = offered_ranks(view.worker, view.state);
    if let Some(only) = ctx.constraint.only_rank {
        // The slots past the one rank allowed would only be removed.
        ranks = ranks.min(only as usize + 1);
    }
    let slots = scratch.zeroed(ranks);
    steps
        .filters()
        .iter()
        .all(|f| f.filter(ctx, view, slots))
        .then_some(slots)
}

/// Runs the filters and scorers on one worker in `scratch`: its cost slots
/// (one per rank, `REMOVED`: removed); None when a filter dropped the whole
/// worker. Inlined into the loop over the workers: it runs once per
/// worker, and a call per worker costs as much as a scorer's loop.
#[inline(always)]
fn run_steps<'s>(
    ctx: &Context,
    steps: &Steps,
    view: &WorkerView,
    scratch: &'s mut Scratch,
) -> Option<&'s [Slot]> {
    let slots = run_filters(ctx, steps, view, scratch)?;
    for scorer in steps.scorers() {
        scorer.score(ctx, view, slots);
    }
    Some(slots)
}

/// The pool index of every worker `choose` would score under `ctx`: those
/// with a state that the filters keep. Under prefix affinity the router
/// reads these workers' indexes before the choice (and no others).
pub fn scored_workers(pool: &Pool, ctx: &Context, mut f: impl FnMut(usize)) {
    let steps = Steps::of(ctx);
    with_scratch(|scratch| {
        for view in views(pool) {
            if run_filters(ctx, &steps, &view, scratch).is_some() {
                f(view.index);
            }
        }
    });
}

/// Runs the pipeline over `pool`; the candidate's `worker` is a
/// `Config::all_workers` index. The constraint is strict: a pin that names
/// no candidate leaves none (the router then retries without it).
pub fn choose(pool: &Pool, ctx: &Context) -> Option<Candidate> {
    choose_offering(pool, ctx, None)
}

/// `choose` with `ctx`'s picker, offering every worker's slots to `collector` too.
fn choose_offering(
    pool: &Pool,
    ctx: &Context,
    collector: Option<&mut AlternatesCollector>,
) -> Option<Candidate> {
    match ctx.pick {
        Pick::LeastCost => choose_by::<LeastCost>(pool, ctx, collector),
        Pick::Headroom { .. } => choose_by::<Headroom>(pool, ctx, collector),
    }
}

/// `choose`, and up to `max` retry alternates for the candidate chosen:
/// `alternates` under the same context without prefix affinity (a retry
/// goes by load) and without the request's constraint. When the choice's
/// costs are the alternates' (`alternates_in_same_pass`), both come from
/// one pass over the pool; else the alternates take a second.
pub fn choose_with_alternates(pool: &Pool, ctx: &Context, max: usize) -> Option<(Candidate, Vec<Candidate>)> {
    let by_load = Context {
        constraint: Constraint::default(),
        prefix: None,
        ..*ctx
    };
    if max == 0 || !alternates_in_same_pass(ctx) {
        let chosen = choose(pool, ctx)?;
        return Some((chosen, alternates(pool, &by_load, &chosen, max)));
    }
    ALTERNATES.with_borrow_mut(|collector| {
        // One more than wanted: the chosen worker may be among a rank's cheapest.
        collector.reset(max + 1);
        let chosen = choose_offering(pool, ctx, Some(collector))?;
        let found = collector.alternates(chosen.rank, chosen.worker, pool.offset, max);
        Some((chosen, found))
    })
}

/// Whether every slot of the choice's pass, on every rank, holds what
/// `alternates` computes for it: the same scorers (load only), no pin, and
/// no worker or rank admitted only as a probe. `only_rank` may stay: the
/// choice then has that rank, and its slots are computed alike.
pub(super) fn alternates_in_same_pass(ctx: &Context) -> bool {
    ctx.prefix.is_none() && ctx.constraint.pin.is_none() && (!ctx.admit_probing || ctx.health.is_empty())
}

/// The pass over the pool: each worker's steps run and its slots offered to
/// the picker (and `collector`), unless the pruning finds that offering
/// them could change nothing (`pruning/`).
fn choose_by<P: Picker>(
    pool: &Pool,
    ctx: &Context,
    mut collector: Option<&mut AlternatesCollector>,
) -> Option<Candidate> {
    let steps = Steps::of(ctx);
    let prunes = pruning::applies(ctx);
    let counts_ties = pruning::counts_ties(ctx, &steps);
    let mut picker = P::new(ctx);
    with_scratch(|scratch| {
        for (index, (worker, state)) in pool.workers.iter().zip(pool.states).enumerate() {
            let at = index + pool.offset;
            let offer_to = if prunes {
                pruning::offer_to(pool.loads, at, &picker, collector.as_deref())
            } else {
                OfferTo::BOTH
            };
            if offer_to.nothing() {
                continue;
            }
            // Only now is the state looked at (a cache miss per worker on a large fleet).
            let Some(state) = state else { continue };
            let view = view(pool, index, worker, state);
            if counts_ties && !offer_to.alternates && pruning::count_ties(ctx, &steps, &view, &mut picker) {
                continue;
            }
            if let Some(slots) = run_steps(ctx, &steps, &view, scratch) {
                if offer_to.picker {
                    picker.offer(view.index, slots);
                }
                if let Some(collector) = collector.as_deref_mut().filter(|_| offer_to.alternates) {
                    collector.offer(view.index, slots);
                }
            }
        }
    });
    let chosen = picker.pick()?;
    Some(Candidate {
        worker: chosen.worker + pool.offset,
        ..chosen
    })
}

/// Up to `max` other workers of the pool that could serve `chosen`'s rank,
/// cheapest first: each passes every filter with only that rank (and no
/// probing), and its cost is that rank's. Envoy retries a request on them,
/// in this order, when the chosen worker fails before answering (the route
/// header lists them after it), so a retry never carries a rank the worker
/// it lands on lacks.
pub fn alternates(pool: &Pool, ctx: &Context, chosen: &Candidate, max: usize) -> Vec<Candidate> {
    if max == 0 {
        return Vec::new();
    }
    let strict = Context {
        constraint: Constraint {
            only_rank: Some(chosen.rank),
            pin: None,
        },
        admit_probing: false,
        ..*ctx
    };
    let steps = Steps::of(&strict);
    let mut found = Vec::new();
    with_scratch(|scratch| {
        for view in views(pool) {
            let worker = view.index + pool.offset;
            if worker == chosen.worker {
                continue;
            }
            let Some(slots) = run_steps(&strict, &steps, &view, scratch) else {
                continue;
            };
            if let Some(&cost) = slots.get(chosen.rank as usize).filter(|c| **c != REMOVED) {
                found.push(Candidate {
                    worker,
                    rank: chosen.rank,
                    cost,
                });
            }
        }
    });
    found.sort_by_key(|c| (c.cost, c.worker));
    found.truncate(max);
    found
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{Constraint, Pool};
    use super::*;
    use crate::health::Health;
    use crate::worker_state::LoadTable;

    fn c(worker: usize, rank: u32, cost: u64) -> Candidate {
        Candidate { worker, rank, cost }
    }

    #[test]
    fn the_pipeline_picks_the_joint_minimum_of_fresh_ranks_across_workers() {
        let workers = [worker("a", 1, None), worker("b", 2, None), worker("c", 3, None)];
        let states = [Some(state(&[50, 40], 1000)), Some(state(&[1], 0)), None];
        let none: [Option<WorkerState>; 3] = [None, None, None];
        let (loads, no_loads) = (loads_at(3, &states), loads_at(3, &none));
        fn pool<'a>(
            workers: &'a [Worker],
            states: &'a [Option<WorkerState>],
            loads: &'a LoadTable,
        ) -> Pool<'a> {
            Pool {
                workers,
                states,
                loads,
                offset: 3,
            }
        }
        let at = |now_ms| Context {
            now_ms,
            ..ctx(Constraint::default())
        };
        assert_eq!(
            choose(&pool(&workers, &states, &loads), &at(1000)),
            Some(c(4, 0, 1)),
            "the joint minimum"
        );
        assert_eq!(
            choose(&pool(&workers, &states, &loads), &at(3500)),
            Some(c(3, 1, 40)),
            "b is stale"
        );
        assert_eq!(choose(&pool(&workers, &none, &no_loads), &at(1000)), None);
    }

    #[test]
    fn configured_dp_size_caps_the_offered_ranks() {
        let workers = [worker("a", 1, Some(2))];
        let states = [Some(state(&[5, 6, 0, 0], 1000))];
        let loads = LoadTable::of(&states);
        let pool = Pool {
            workers: &workers,
            states: &states,
            loads: &loads,
            offset: 0,
        };
        assert_eq!(choose(&pool, &ctx(Constraint::default())), Some(c(0, 0, 5)));
    }

    #[test]
    fn constraints_are_strict() {
        let workers = [worker("a", 1, None), worker("b", 2, None)];
        let states = [Some(state(&[9, 1], 1000)), Some(state(&[5, 7], 1000))];
        let loads = LoadTable::of(&states);
        let pool = Pool {
            workers: &workers,
            states: &states,
            loads: &loads,
            offset: 0,
        };
        let only = |rank| {
            ctx(Constraint {
                only_rank: Some(rank),
                pin: None,
            })
        };
        assert_eq!(choose(&pool, &only(0)), Some(c(1, 0, 5)));
        assert_eq!(choose(&pool, &only(7)), None);
        let pin = |p| {
            ctx(Constraint {
                only_rank: None,
                pin: Some(p),
            })
        };
        assert_eq!(choose(&pool, &pin("a/0")), Some(c(0, 0, 9)));
        assert_eq!(choose(&pool, &pin("a/5")), None);
    }

    #[test]
    fn alternates_have_the_chosen_rank_are_healthy_and_ordered_by_its_cost() {
        let workers = [
            worker("a", 1, None),
            worker("b", 2, None),
            worker("c", 3, None),
            worker("d", 4, None),
            worker("e", 5, None),
            worker("f", 6, None),
            worker("g", 7, Some(2)),
        ];
        let states = [
            Some(state(&[9, 9, 9, 0], 1000)),     // a: chosen (rank 3)
            Some(state(&[1, 1], 1000)),           // b: no rank 3
            Some(state(&[50, 50, 50, 70], 1000)), // c: rank 3 at 70
            Some(state(&[50, 50, 50, 5], 0)),     // d: rank 3 at 5, but stale at 3500
            Some(state(&[50, 50, 50, 30], 1000)), // e: rank 3 at 30
            Some(state(&[50, 50, 50, 1], 1000)),  // f: cheapest, but ejected
            Some(state(&[50, 50, 50, 0], 1000)),  // g: reports 4 ranks, dp_size 2
        ];
        let loads = loads_at(10, &states);
        let pool = Pool {
            workers: &workers,
            states: &states,
            loads: &loads,
            offset: 10,
        };
        let mut health = Health::default();
        let f = crate::health::Target {
            worker: workers[5].address,
            rank: None,
        };
        eject(&mut health, f, 3000);
        let ctx = Context {
            now_ms: 3500,
            health: &health,
            // Probing is never offered as an alternate, even to a probe.
            admit_probing: true,
            ..ctx(Constraint::default())
        };
        let chosen = choose(&pool, &ctx).unwrap();
        assert_eq!(chosen, c(10, 3, 0));
        let alts = alternates(&pool, &ctx, &chosen, 5);
        assert_eq!(alts, vec![c(14, 3, 30), c(12, 3, 70)]);
        assert_eq!(alternates(&pool, &ctx, &chosen, 1), vec![c(14, 3, 30)]);
        assert!(alternates(&pool, &ctx, &chosen, 0).is_empty());
        // Past f's cooldown (1 s): still not an alternate.
        let probing = Context { now_ms: 4200, ..ctx };
        assert!(!alternates(&pool, &probing, &chosen, 5).contains(&c(15, 3, 1)));
        let rank_0 = c(11, 0, 1);
        assert_eq!(
            alternates(&pool, &ctx, &rank_0, 9).len(),
            4,
            "a, c, e and g: fresh, in rotation, with rank 0"
        );
    }
}
