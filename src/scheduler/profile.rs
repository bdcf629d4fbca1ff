//! The policy: every step by name, and the lists that run, in order. A
//! filter removes candidates, a scorer adds to the cost of those left, the
//! picker takes one (`pick`: `least_cost`, or `headroom` among the few
//! cheapest). Steps with nothing to do for a request are left out once per
//! choice (`Filter::applies`, `Scorer::applies`).

/// Every filter (`filters/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FilterStep {
    Fresh,
    Healthy,
    OnlyRank,
    Pinned,
    Unsaturated,
}

/// Every scorer (`scorers/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ScorerStep {
    Queue,
    Prefix,
    Load,
    Lockstep,
    Kv,
    OtherGateways,
    Rendezvous,
}

use FilterStep::*;
use ScorerStep::*;

/// Filters, in order: the first that drops a worker ends its turn.
pub(super) const FILTERS: &[FilterStep] = &[Fresh, Healthy, OnlyRank, Pinned, Unsaturated];

/// Scorers without prefix affinity (`prefix_affinity: false`, and PD's
/// decode pool): the rank's load, then, with `gateways` > 1, the other
/// gateways' likely requests since the poll. Every one only adds to the
/// load: the pruning relies on it (`pruning/`, tested there).
pub(super) const LOAD_SCORERS: &[ScorerStep] = &[Load, OtherGateways];

/// Scorers under prefix affinity: the work queued ahead, the request's own
/// uncached prefill, the rank's load (or, where `prefix_load` says, its
/// worker's lockstep instead: `load` and `lockstep` never both apply) and
/// the KV it lacks (weighted, `config/prefix.rs`); with `gateways` > 1, the
/// others' likely requests and a lean shared by every gateway toward the
/// same ranks for a prompt.
pub(super) const PREFIX_SCORERS: &[ScorerStep] =
    &[Queue, Prefix, Load, Lockstep, Kv, OtherGateways, Rendezvous];
