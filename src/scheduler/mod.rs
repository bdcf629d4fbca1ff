//! Choosing the (worker, rank) for a request, as a pipeline of small named
//! steps in the manner of the Gateway API Inference Extension's scheduler:
//! filters remove candidates, scorers add to the cost of those left, and the
//! picker takes one. Each step has its own file; the lists below are the
//! policy, in order. Adding a step is adding a file, a `Step` variant and a
//! line here.
//!
//! Candidates are every rank a worker's last report listed (below its
//! configured `dp_size`, if any). Steps work one worker at a time on a slice
//! with one cost slot per rank (`REMOVED` = removed), and the picker is offered
//! each worker's slots as soon as they are scored: a fleet of thousands of
//! ranks costs a tight loop per worker and step (steps are dispatched
//! statically, and those with nothing to do for a request are left out once
//! per choice), and no candidate list. The retry alternates of the rank
//! chosen are collected from the same slots (`by_rank`) where their costs
//! are the choice's, rather than in a second pass. Under load-only scoring a
//! worker whose loads can neither be picked nor enter any rank's alternates
//! is passed over before its steps run (`bound`), and one that could only
//! add ties the picker will not take is counted after its filters alone
//! (`bound::tally`: an idle fleet's workers, where every rank ties).

mod bound;
mod by_rank;
#[cfg(test)]
mod equivalence;
mod fresh;
mod headroom;
mod healthy;
mod home;
mod kv;
mod least_cost;
mod load;
mod only_rank;
mod peers;
mod pinned;
mod prefix;
mod queue;

use crate::config::{Pick, Worker};
use crate::cost::{Slot, REMOVED};
use crate::health::Health;
use crate::prefix::RequestPrefix;
use crate::state::{LoadTable, WorkerState};

/// Filters, in order: the first that drops a worker ends its turn.
const FILTERS: &[Step] = &[Step::Fresh, Step::Healthy, Step::OnlyRank, Step::Pinned];
/// Scorers: each adds its cost to every candidate left. Load only
/// (`prefix_affinity: false`, and PD's decode pool), then, with `gateways`
/// > 1, the other gateways' likely requests since the poll:
const LOAD_SCORERS: &[Step] = &[Step::Load, Step::Peers];
/// Prefix affinity: the work queued ahead, the request's own uncached
/// prefill, the rank's load and the KV it lacks (weighted, `config/prefix.rs`);
/// with `gateways` > 1, the others' likely requests and a lean shared by
/// every gateway toward the same ranks for a prompt (`home`).
const PREFIX_SCORERS: &[Step] = &[
    Step::Queue,
    Step::Prefix,
    Step::Load,
    Step::Kv,
    Step::Peers,
    Step::Home,
];

/// The steps by name, dispatched with a `match` rather than through `dyn`:
/// the pipeline calls a step once per worker, and a static call lets each
/// step's loop be compiled into the worker's turn (`choose` at thousands of
/// ranks). Adding a step is adding a file, a variant and its arms here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Fresh,
    Healthy,
    OnlyRank,
    Pinned,
    Queue,
    Prefix,
    Load,
    Kv,
    Peers,
    Home,
}

impl Filter for Step {
    #[inline]
    fn applies(&self, ctx: &Context) -> bool {
        match self {
            Step::Fresh => fresh::Fresh.applies(ctx),
            Step::Healthy => healthy::Healthy.applies(ctx),
            Step::OnlyRank => only_rank::OnlyRank.applies(ctx),
            Step::Pinned => pinned::Pinned.applies(ctx),
            // Not a filter: removes nothing.
            _ => false,
        }
    }

    #[inline(always)]
    fn filter(&self, ctx: &Context, worker: &WorkerView, ranks: &mut [Slot]) -> bool {
        match self {
            Step::Fresh => fresh::Fresh.filter(ctx, worker, ranks),
            Step::Healthy => healthy::Healthy.filter(ctx, worker, ranks),
            Step::OnlyRank => only_rank::OnlyRank.filter(ctx, worker, ranks),
            Step::Pinned => pinned::Pinned.filter(ctx, worker, ranks),
            _ => true,
        }
    }

    fn whole(&self) -> bool {
        match self {
            Step::Fresh => fresh::Fresh.whole(),
            Step::Healthy => healthy::Healthy.whole(),
            Step::OnlyRank => only_rank::OnlyRank.whole(),
            Step::Pinned => pinned::Pinned.whole(),
            // Not a filter: removes nothing.
            _ => true,
        }
    }
}

impl Scorer for Step {
    #[inline]
    fn applies(&self, ctx: &Context) -> bool {
        match self {
            Step::Queue => Scorer::applies(&queue::Queue, ctx),
            Step::Prefix => Scorer::applies(&prefix::Prefix, ctx),
            Step::Load => Scorer::applies(&load::Load, ctx),
            Step::Kv => Scorer::applies(&kv::Kv, ctx),
            Step::Peers => Scorer::applies(&peers::Peers, ctx),
            Step::Home => Scorer::applies(&home::Home, ctx),
            // Not a scorer: adds nothing.
            _ => false,
        }
    }

    #[inline(always)]
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        match self {
            Step::Queue => queue::Queue.score(ctx, worker, costs),
            Step::Prefix => prefix::Prefix.score(ctx, worker, costs),
            Step::Load => load::Load.score(ctx, worker, costs),
            Step::Kv => kv::Kv.score(ctx, worker, costs),
            Step::Peers => peers::Peers.score(ctx, worker, costs),
            Step::Home => home::Home.score(ctx, worker, costs),
            _ => {}
        }
    }
}
// The picker takes one candidate from those left, as `pick` says:
// `least_cost`, or `headroom` among the few cheapest (`choose`).

/// A (worker, rank) a request could be sent to, with its cost (for now, the
/// rank's effective tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Candidate {
    /// Index in the pool (`choose` turns it into a `Config::all_workers` index).
    pub worker: usize,
    pub rank: u32,
    pub cost: u64,
}

/// The workers one choice is made among, with their shared states.
#[derive(Debug, Clone, Copy)]
pub struct Pool<'a> {
    pub workers: &'a [Worker],
    /// One per worker (None: no state yet).
    pub states: &'a [Option<WorkerState>],
    /// The loads derived from the states, indexed like `Config::all_workers`
    /// (`workers[0]` is at `offset`).
    pub loads: &'a LoadTable,
    /// Index of `workers[0]` in `Config::all_workers`.
    pub offset: usize,
}

/// What a request asks of the choice beyond the least cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Constraint<'a> {
    /// Only this rank (a trusted client's own rank field).
    pub only_rank: Option<u32>,
    /// Test-only pin `<worker name or ip:port>/<rank>`.
    pub pin: Option<&'a str>,
}

/// Everything a step may look at besides the worker itself.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub now_ms: u64,
    pub stale_after_ms: u64,
    pub constraint: Constraint<'a>,
    /// Varies per request so that equal costs spread.
    pub tie_breaker: u64,
    /// Workers and ranks out of rotation (passive health, Envoy's view).
    pub health: &'a Health,
    /// This request may go to a worker or rank whose cooldown is over (a probe).
    pub admit_probing: bool,
    /// Prefix affinity for this request and pool (None: load only), its
    /// candidates' indexes read before the choice.
    pub prefix: Option<&'a RequestPrefix<'a>>,
    /// The picker in force.
    pub pick: Pick,
    /// Gateways sharing the fleet (`peers`, `home`).
    pub gateways: u32,
}

/// One worker as the steps see it.
#[derive(Debug, Clone, Copy)]
pub struct WorkerView<'a> {
    /// Index in the pool.
    pub index: usize,
    pub worker: &'a Worker,
    pub state: &'a WorkerState,
    /// Effective tokens per rank its state lists (`LoadTable`; `REMOVED` for a
    /// rank without a usable figure).
    pub loads: &'a [Slot],
}

pub trait Filter {
    /// Whether the filter can remove anything for this request; checked once
    /// per choice, so a filter with nothing to do costs nothing per worker.
    fn applies(&self, _ctx: &Context) -> bool {
        true
    }
    /// Clears the slots of ranks that may not be chosen; false drops the
    /// whole worker (the cheap way to remove every rank).
    fn filter(&self, ctx: &Context, worker: &WorkerView, ranks: &mut [Slot]) -> bool;
    /// Whether the filter only keeps or drops whole workers, never reading
    /// or clearing a rank's slot (it may then be run without slots,
    /// `bound::tally`).
    fn whole(&self) -> bool {
        false
    }
}

pub trait Scorer {
    /// Whether the scorer can add anything for this request; checked once
    /// per choice, like `Filter::applies`.
    fn applies(&self, _ctx: &Context) -> bool {
        true
    }
    /// Adds this step's cost to every slot left (saturating at `MAX_COST`); a
    /// rank it cannot score is set to `REMOVED`.
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]);
}

pub trait Picker {
    fn new(ctx: &Context) -> Self;
    /// Offers one worker's candidates: its pool index and one slot per rank.
    fn offer(&mut self, worker: usize, costs: &[Slot]);
    /// A cost above which an offer changes nothing (`bound.rs`); `Slot::MAX`
    /// while any may.
    fn bound(&self) -> Slot;
    /// Counts a worker whose candidates cost at least `least`, `tied` of
    /// them exactly the bound, without its slots, when offering them could
    /// change nothing but the picker's count of ties (`bound::tally`); false
    /// (and nothing counted) when it might, or when the picker does not count.
    fn tally(&mut self, _least: Slot, _tied: u64) -> bool {
        false
    }
    /// The candidate taken among all those offered.
    fn pick(self) -> Option<Candidate>;
}

/// The ranks a worker offers: those its last report listed, below its
/// configured `dp_size` (a report listing more is not trusted beyond it).
fn offered_ranks(worker: &Worker, state: &WorkerState) -> usize {
    worker
        .dp_size
        .map_or(state.ranks(), |dp| state.ranks().min(dp as usize))
}

thread_local! {
    /// The cost slots of the worker being scored, reused across choices (each
    /// VM is one thread).
    static SLOTS: std::cell::RefCell<Vec<Slot>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The alternates' collector of `choose_with_alternates`, reused likewise.
    static BY_RANK: std::cell::RefCell<by_rank::ByRank> = std::cell::RefCell::new(by_rank::ByRank::default());
}

/// The steps that can change anything for `ctx` (`Filter::applies`,
/// `Scorer::applies`), in order, decided once per choice: a step with
/// nothing to do for a request costs nothing per worker.
struct Steps {
    filters: [Step; FILTERS.len()],
    filter_count: usize,
    scorers: [Step; PREFIX_SCORERS.len()],
    scorer_count: usize,
}

impl Steps {
    fn of(ctx: &Context) -> Steps {
        let scorers = if ctx.prefix.is_some() {
            PREFIX_SCORERS
        } else {
            LOAD_SCORERS
        };
        let (filters, filter_count) = kept(FILTERS, |f| Filter::applies(f, ctx));
        let (scorers, scorer_count) = kept(scorers, |s| Scorer::applies(s, ctx));
        Steps {
            filters,
            filter_count,
            scorers,
            scorer_count,
        }
    }

    fn filters(&self) -> &[Step] {
        self.filters.get(..self.filter_count).unwrap_or_default()
    }

    fn scorers(&self) -> &[Step] {
        self.scorers.get(..self.scorer_count).unwrap_or_default()
    }
}

/// The steps of `list` that `keep`, in order, at the front of an array
/// (no allocation per choice), and how many they are.
fn kept<const N: usize>(list: &[Step], keep: impl Fn(&Step) -> bool) -> ([Step; N], usize) {
    let mut out = [Step::Load; N];
    let mut count = 0;
    for step in list.iter().filter(|s| keep(s)) {
        if let Some(slot) = out.get_mut(count) {
            *slot = *step;
            count += 1;
        }
    }
    (out, count)
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

/// `choose` with `ctx`'s picker, offering every worker's slots to `by_rank` too.
fn choose_offering(pool: &Pool, ctx: &Context, by_rank: Option<&mut by_rank::ByRank>) -> Option<Candidate> {
    match ctx.pick {
        Pick::LeastCost => choose_by::<least_cost::LeastCost>(pool, ctx, by_rank),
        Pick::Headroom { .. } => choose_by::<headroom::Headroom>(pool, ctx, by_rank),
    }
}

/// `choose`, and up to `max` retry alternates for the candidate chosen:
/// `alternates` under the same context without prefix affinity (a retry
/// goes by load) and without the request's constraint. When the choice's
/// costs are the alternates' (`folds`), both come from one pass over the
/// pool; else the alternates take a second.
pub fn choose_with_alternates(pool: &Pool, ctx: &Context, max: usize) -> Option<(Candidate, Vec<Candidate>)> {
    let by_load = Context {
        constraint: Constraint::default(),
        prefix: None,
        ..*ctx
    };
    if max == 0 || !folds(ctx) {
        let chosen = choose(pool, ctx)?;
        return Some((chosen, alternates(pool, &by_load, &chosen, max)));
    }
    BY_RANK.with_borrow_mut(|by_rank| {
        // One more than wanted: the chosen worker may be among a rank's cheapest.
        by_rank.reset(max + 1);
        let chosen = choose_offering(pool, ctx, Some(by_rank))?;
        let found = by_rank.alternates(chosen.rank, chosen.worker, pool.offset, max);
        Some((chosen, found))
    })
}

/// Whether every slot of the choice's pass, on every rank, holds what
/// `alternates` computes for it: the same scorers (load only), no pin, and
/// no worker or rank admitted only as a probe. `only_rank` may stay: the
/// choice then has that rank, and its slots are computed alike.
fn folds(ctx: &Context) -> bool {
    ctx.prefix.is_none() && ctx.constraint.pin.is_none() && (!ctx.admit_probing || ctx.health.is_empty())
}

fn choose_by<P: Picker>(
    pool: &Pool,
    ctx: &Context,
    mut by_rank: Option<&mut by_rank::ByRank>,
) -> Option<Candidate> {
    let steps = Steps::of(ctx);
    let bounded = bound::applies(ctx);
    let tallied = bound::tallies(ctx, &steps);
    let mut picker = P::new(ctx);
    with_scratch(|scratch| {
        for (index, (worker, state)) in pool.workers.iter().zip(pool.states).enumerate() {
            let at = index + pool.offset;
            let reach = if bounded {
                bound::reach(pool.loads, at, &picker, by_rank.as_deref())
            } else {
                bound::Reach::BOTH
            };
            if reach.nothing() {
                continue;
            }
            // Only now is the state looked at (a cache miss per worker on a large fleet).
            let Some(state) = state else { continue };
            let view = view(pool, index, worker, state);
            if tallied && !reach.by_rank && bound::tally(ctx, &steps, &view, &mut picker) {
                continue;
            }
            if let Some(slots) = run_steps(ctx, &steps, &view, scratch) {
                if reach.picker {
                    picker.offer(view.index, slots);
                }
                if let Some(by_rank) = by_rank.as_deref_mut().filter(|_| reach.by_rank) {
                    by_rank.offer(view.index, slots);
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
pub(crate) mod testing {
    //! Workers and states for the steps' tests.
    use super::*;

    pub fn worker(name: &str, port: u16, dp_size: Option<u32>) -> Worker {
        Worker {
            name: name.into(),
            address: format!("127.0.0.1:{port}").parse().unwrap(),
            dp_size,
            bootstrap_port: None,
        }
    }

    /// A state polled at `at` with these tokens.
    pub fn state(tokens: &[u64], at: u64) -> WorkerState {
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, at, &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>());
        s
    }

    pub fn ctx(constraint: Constraint<'_>) -> Context<'_> {
        Context {
            now_ms: 1000,
            stale_after_ms: 3000,
            constraint,
            tie_breaker: 0,
            health: &crate::health::NO_HEALTH,
            admit_probing: false,
            prefix: None,
            pick: Pick::LeastCost,
            gateways: 1,
        }
    }

    /// Prefix affinity for a streamed request of `prompt` at t = 1000 s,
    /// no index read yet.
    pub fn prefix_request(
        settings: &crate::config::Prefix,
        prompt: crate::prefix::PromptBlocks,
        output: u64,
    ) -> RequestPrefix<'_> {
        RequestPrefix::new(settings, prompt, true, output, 1_000_000)
    }

    /// Passive health that ejects after 3 failures for 1 s, doubling to 4 s.
    pub fn policy() -> crate::config::PassiveHealth {
        crate::config::PassiveHealth {
            consecutive_failures: 3,
            cooldown_ms: 1000,
            max_cooldown_ms: 4000,
            probe_share: 0.05,
        }
    }

    /// Takes `target` out of rotation at `at_ms`: `policy()`'s failures in a row.
    pub fn eject(health: &mut Health, target: crate::health::Target, at_ms: u64) {
        let policy = policy();
        for _ in 0..policy.consecutive_failures {
            health.observe(&policy, target, crate::health::Outcome::Failure, at_ms, at_ms);
        }
    }

    /// The loads of a pool whose first worker sits at `offset`.
    pub fn loads_at(offset: usize, states: &[Option<WorkerState>]) -> LoadTable {
        let mut all = vec![None; offset];
        all.extend_from_slice(states);
        LoadTable::of(&all)
    }

    /// Runs one filter on a worker with `ranks` slots; None if it dropped the worker.
    pub fn run_filter(
        f: &dyn Filter,
        ctx: &Context,
        index: usize,
        worker: &Worker,
        state: &WorkerState,
    ) -> Option<Vec<Slot>> {
        let mut ranks = vec![0; state.ranks()];
        let loads = LoadTable::of(std::slice::from_ref(&Some(state.clone())));
        let view = WorkerView {
            index,
            worker,
            state,
            loads: loads.worker(0),
        };
        f.filter(ctx, &view, &mut ranks).then_some(ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

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
    fn steps_with_nothing_to_do_are_left_out_once_per_choice() {
        let plain = ctx(Constraint::default());
        let steps = Steps::of(&plain);
        assert_eq!(steps.filters(), [Step::Fresh], "a healthy fleet, no constraint");
        assert_eq!(steps.scorers(), [Step::Load], "one gateway: no peers");
        let mut health = Health::default();
        health.envoy_unhealthy.push(worker("a", 1, None).address);
        let busy = Context {
            constraint: Constraint {
                only_rank: Some(1),
                pin: Some("a/1"),
            },
            health: &health,
            gateways: 3,
            ..plain
        };
        let steps = Steps::of(&busy);
        assert_eq!(steps.filters(), FILTERS);
        assert_eq!(steps.scorers(), LOAD_SCORERS);
        assert!(
            !Scorer::applies(&Step::Home, &busy),
            "no prefix affinity: no lean"
        );
        assert!(!Filter::applies(&Step::Load, &busy) && !Scorer::applies(&Step::Fresh, &busy));
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
