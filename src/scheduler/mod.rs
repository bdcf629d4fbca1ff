//! Choosing the (worker, rank) for a request: filters remove candidates
//! (every rank a worker's last report listed, below its `dp_size`), scorers
//! add to the cost of those left, a picker takes one. Here the types and
//! interfaces; the policy in `profile.rs`, the pass over the pool in
//! `runner.rs`, the steps in `filters/`, `scorers/`, `pickers/`, shortcuts
//! that change no choice in `pruning/` (docs/architecture.md). Steps read
//! only the `Context` and the `WorkerView`: data read before the choice.
//!
//! Adding a scorer:
//! 1. `scorers/<name>.rs`: a unit struct implementing [`Scorer`]. `applies`
//!    says, once per choice, whether it can add anything; `score` adds its
//!    cost to each slot of one worker (`cost::add_cost`, saturating) and sets
//!    `REMOVED` for a rank it cannot score. Two scorers that cost the same
//!    thing two ways split the requests by `applies` (`load` and
//!    `lockstep`, as `prefix_load` says).
//!    Its weights and tuned constants are configuration, beside the others
//!    (`config/prefix.rs`, read from `ctx.prefix`'s settings), not constants
//!    in its file.
//! 2. A `ScorerStep` variant in `profile.rs` and its two arms in `steps.rs`
//!    (the compiler names the `match`es that miss it); a `mod` line below.
//! 3. Its place in `profile.rs`: `PREFIX_SCORERS`, `LOAD_SCORERS`, or both.
//! 4. The pruning's rule, for a scorer in `LOAD_SCORERS`: it only adds to a
//!    slot (never lowers a cost, never brings back a removed rank), so that
//!    every load-only cost is at least the rank's load in the `LoadTable`,
//!    which the `load` scorer adds unweighted (filters only remove). The
//!    pruning passes over a worker whose least load is above what the
//!    picker and the alternates could still take, and counts an idle
//!    fleet's ties from the loads alone when `load` is the only scorer.
//!    `pruning::tests::load_only_scorers_only_add_to_the_load` fails for a
//!    scorer that breaks the rule; one that must belongs in
//!    `PREFIX_SCORERS` only.
//! 5. Tests: its own, beside it; for a load-only scorer, its cost in
//!    `equivalence.rs`'s straightforward implementation.

mod filters {
    pub(super) mod fresh;
    pub(super) mod healthy;
    pub(super) mod only_rank;
    pub(super) mod pinned;
    pub(super) mod unsaturated;
}
mod pickers {
    pub(super) mod alternates;
    pub(super) mod headroom;
    pub(super) mod least_cost;
}
mod profile;
mod pruning;
mod runner;
mod scorers {
    pub(super) mod kv;
    pub(super) mod load;
    pub(super) mod lockstep;
    pub(super) mod other_gateways;
    pub(super) mod prefix;
    pub(super) mod queue;
    pub(super) mod rendezvous;
}
mod steps;

#[cfg(test)]
mod equivalence;
#[cfg(test)]
pub(crate) mod testing;

pub use runner::{alternates, choose, choose_with_alternates, scored_workers};

use crate::config::{Pick, Worker};
use crate::cost::Slot;
use crate::health::Health;
use crate::prefix::RequestPrefix;
use crate::worker_state::{LoadTable, WorkerState};

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
    /// Gateways sharing the fleet (`other_gateways`, `rendezvous`).
    pub gateways: u32,
    /// Admission let the request in: only ranks with room by this rule
    /// are candidates (`unsaturated`); None: every rank.
    pub room: Option<crate::worker_state::saturation::Room>,
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
    /// or clearing a rank's slot (it may then be run without slots:
    /// `pruning::count_ties`).
    fn drops_whole_workers_only(&self) -> bool {
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
    /// A cost above which an offer changes nothing (the pruning's bar);
    /// `Slot::MAX` while any may.
    fn max_useful_cost(&self) -> Slot;
    /// Counts a worker whose candidates cost at least `least`, `tied` of
    /// them exactly `max_useful_cost`, without its slots, when offering them
    /// could change nothing but the picker's count of ties
    /// (`pruning::count_ties`); false (and nothing counted) when it might,
    /// or when the picker does not count.
    fn count_ties(&mut self, _least: Slot, _tied: u64) -> bool {
        false
    }
    /// The candidate taken among all those offered.
    fn pick(self) -> Option<Candidate>;
}

/// The ranks a worker offers: those its last report listed, below its
/// configured `dp_size` (a report listing more is not trusted beyond it).
pub(crate) fn offered_ranks(worker: &Worker, state: &WorkerState) -> usize {
    worker
        .dp_size
        .map_or(state.ranks(), |dp| state.ranks().min(dp as usize))
}
