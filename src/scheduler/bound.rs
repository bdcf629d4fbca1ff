//! Shortcut `bound`: when every scorer only adds to a rank's load (the load
//! scorer unweighted, `peers`: no prefix affinity), no cost a worker's ranks
//! can carry is below its least load (`Loads::least`; filters only remove).
//! A worker whose least load is above what the picker could still take and
//! whose ranks' loads are not below their bars in the alternates' collector
//! changes nothing when offered, so it is passed over before its steps run
//! (its state is not even read); one that can change only one of them is
//! offered to that one. Choices, alternates and tie-breaking are
//! those of the full pass (`equivalence.rs`); only the work differs. A
//! fleet of spread loads skips most workers once a few cheap ones are seen;
//! one of equal loads (idle) skips none.

use super::by_rank::ByRank;
use super::{Context, Loads, Picker};

/// Whether every cost is at least its rank's load: without prefix
/// affinity the scorers are `LOAD_SCORERS` (`Steps::of`), the load
/// unweighted, and they only add.
pub(super) fn applies(ctx: &Context) -> bool {
    ctx.affinity.is_none()
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

/// What offering worker `at` (a `Loads` index) could change: the picker
/// unless its least load is above the picker's bound, `by_rank` unless no
/// rank's load is below that rank's bar.
#[inline(always)]
pub(super) fn reach(loads: &Loads, at: usize, picker: &impl Picker, by_rank: Option<&ByRank>) -> Reach {
    let least = loads.least(at);
    let reach = Reach {
        picker: least <= picker.bound(),
        by_rank: by_rank.is_some_and(|b| !b.refuses(least, loads.worker(at))),
    };
    #[cfg(test)]
    PASSED_OVER.set(PASSED_OVER.get() + usize::from(reach.nothing()));
    reach
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
    use super::super::testing::{ctx, prefix_affinity, state};
    use super::super::{Constraint, Pick, REMOVED};
    use super::*;

    #[test]
    fn passes_over_workers_that_cannot_enter_the_pick_or_the_alternates() {
        let loads = Loads::of(&[Some(state(&[5, 9], 1000)), Some(state(&[7, 8], 1000)), None]);
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
        let host = crate::host::fake::FakeHost::default();
        let affinity = prefix_affinity(
            &config,
            &settings,
            &host,
            crate::prefix::PromptBlocks::default(),
            0,
        );
        let prefix = super::super::Context {
            affinity: Some(&affinity),
            ..plain
        };
        assert!(
            !applies(&prefix),
            "prefix affinity weights the load and adds other costs"
        );
    }
}
