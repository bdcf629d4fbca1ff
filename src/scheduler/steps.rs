//! The steps dispatched by name with a `match` rather than through `dyn`:
//! the runner calls a step once per worker, and a static call lets each
//! step's loop be compiled into the worker's turn. Also the steps that
//! apply to one choice, decided once per choice.

use super::filters::{fresh, healthy, only_rank, pinned, unsaturated};
use super::profile::{FilterStep, ScorerStep, FILTERS, LOAD_SCORERS, PREFIX_SCORERS};
use super::scorers::{kv, load, lockstep, other_gateways, prefix, queue, rendezvous};
use super::{Context, Filter, Scorer, WorkerView};
use crate::cost::Slot;

impl Filter for FilterStep {
    #[inline]
    fn applies(&self, ctx: &Context) -> bool {
        match self {
            FilterStep::Fresh => fresh::Fresh.applies(ctx),
            FilterStep::Healthy => healthy::Healthy.applies(ctx),
            FilterStep::OnlyRank => only_rank::OnlyRank.applies(ctx),
            FilterStep::Pinned => pinned::Pinned.applies(ctx),
            FilterStep::Unsaturated => unsaturated::Unsaturated.applies(ctx),
        }
    }

    #[inline(always)]
    fn filter(&self, ctx: &Context, worker: &WorkerView, ranks: &mut [Slot]) -> bool {
        match self {
            FilterStep::Fresh => fresh::Fresh.filter(ctx, worker, ranks),
            FilterStep::Healthy => healthy::Healthy.filter(ctx, worker, ranks),
            FilterStep::OnlyRank => only_rank::OnlyRank.filter(ctx, worker, ranks),
            FilterStep::Pinned => pinned::Pinned.filter(ctx, worker, ranks),
            FilterStep::Unsaturated => unsaturated::Unsaturated.filter(ctx, worker, ranks),
        }
    }

    fn drops_whole_workers_only(&self) -> bool {
        match self {
            FilterStep::Fresh => fresh::Fresh.drops_whole_workers_only(),
            FilterStep::Healthy => healthy::Healthy.drops_whole_workers_only(),
            FilterStep::OnlyRank => only_rank::OnlyRank.drops_whole_workers_only(),
            FilterStep::Pinned => pinned::Pinned.drops_whole_workers_only(),
            FilterStep::Unsaturated => unsaturated::Unsaturated.drops_whole_workers_only(),
        }
    }
}

impl Scorer for ScorerStep {
    #[inline]
    fn applies(&self, ctx: &Context) -> bool {
        match self {
            ScorerStep::Queue => queue::Queue.applies(ctx),
            ScorerStep::Prefix => prefix::Prefix.applies(ctx),
            ScorerStep::Load => load::Load.applies(ctx),
            ScorerStep::Lockstep => lockstep::Lockstep.applies(ctx),
            ScorerStep::Kv => kv::Kv.applies(ctx),
            ScorerStep::OtherGateways => other_gateways::OtherGateways.applies(ctx),
            ScorerStep::Rendezvous => rendezvous::Rendezvous.applies(ctx),
        }
    }

    #[inline(always)]
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        match self {
            ScorerStep::Queue => queue::Queue.score(ctx, worker, costs),
            ScorerStep::Prefix => prefix::Prefix.score(ctx, worker, costs),
            ScorerStep::Load => load::Load.score(ctx, worker, costs),
            ScorerStep::Lockstep => lockstep::Lockstep.score(ctx, worker, costs),
            ScorerStep::Kv => kv::Kv.score(ctx, worker, costs),
            ScorerStep::OtherGateways => other_gateways::OtherGateways.score(ctx, worker, costs),
            ScorerStep::Rendezvous => rendezvous::Rendezvous.score(ctx, worker, costs),
        }
    }
}

/// The steps that can change anything for `ctx` (`Filter::applies`,
/// `Scorer::applies`), in order, decided once per choice: a step with
/// nothing to do for a request costs nothing per worker.
pub(super) struct Steps {
    filters: [FilterStep; FILTERS.len()],
    filter_count: usize,
    scorers: [ScorerStep; PREFIX_SCORERS.len()],
    scorer_count: usize,
}

impl Steps {
    pub fn of(ctx: &Context) -> Steps {
        let scorers = if ctx.prefix.is_some() {
            PREFIX_SCORERS
        } else {
            LOAD_SCORERS
        };
        let (filters, filter_count) = kept(FILTERS, FilterStep::Fresh, |f| f.applies(ctx));
        let (scorers, scorer_count) = kept(scorers, ScorerStep::Load, |s| s.applies(ctx));
        Steps {
            filters,
            filter_count,
            scorers,
            scorer_count,
        }
    }

    pub fn filters(&self) -> &[FilterStep] {
        self.filters.get(..self.filter_count).unwrap_or_default()
    }

    pub fn scorers(&self) -> &[ScorerStep] {
        self.scorers.get(..self.scorer_count).unwrap_or_default()
    }
}

/// The steps of `list` that `keep`, in order, at the front of an array
/// (no allocation per choice; `fill` pads the rest), and how many they are.
fn kept<T: Copy, const N: usize>(list: &[T], fill: T, keep: impl Fn(&T) -> bool) -> ([T; N], usize) {
    let mut out = [fill; N];
    let mut count = 0;
    for step in list.iter().filter(|s| keep(s)) {
        if let Some(slot) = out.get_mut(count) {
            *slot = *step;
            count += 1;
        }
    }
    (out, count)
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::Constraint;
    use super::*;
    use crate::health::Health;

    #[test]
    fn steps_with_nothing_to_do_are_left_out_once_per_choice() {
        let plain = ctx(Constraint::default());
        let steps = Steps::of(&plain);
        assert_eq!(
            steps.filters(),
            [FilterStep::Fresh],
            "a healthy fleet, no constraint"
        );
        assert_eq!(
            steps.scorers(),
            [ScorerStep::Load],
            "one gateway: no other gateways to count"
        );
        let mut health = Health::default();
        health.envoy_unhealthy.push(worker("a", 1, None).address);
        let busy = Context {
            constraint: Constraint {
                only_rank: Some(1),
                pin: Some("a/1"),
            },
            health: &health,
            gateways: 3,
            room: Some(crate::worker_state::saturation::Room {
                limits: crate::worker_state::saturation::Limits {
                    max_wait_ms: 1,
                    max_kv_usage: None,
                    max_requests: None,
                    slo: None,
                },
                prior_tokens_per_s: 1.0,
                learn: false,
            }),
            ..plain
        };
        let steps = Steps::of(&busy);
        assert_eq!(steps.filters(), FILTERS);
        assert_eq!(steps.scorers(), LOAD_SCORERS);
        assert!(
            !Scorer::applies(&ScorerStep::Rendezvous, &busy),
            "no prefix affinity: no lean"
        );
    }
}
