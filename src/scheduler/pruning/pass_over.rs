//! Passing over a worker: under the rule (`pruning/mod.rs`) a worker whose
//! least load is above what the picker could still take, and whose ranks'
//! loads are not below their bars in the alternates' collector, changes
//! nothing when offered; it is passed over before its steps run (its state
//! is not even read). One that can change only one of them is offered to
//! that one. A fleet of spread loads skips most workers once a few cheap
//! ones are seen; one of equal loads (idle) skips none (`count_ties.rs`).

use crate::scheduler::pickers::alternates::AlternatesCollector;
use crate::scheduler::Picker;
use crate::worker_state::LoadTable;

/// Which of the picker and the alternates' collector offering a worker
/// could change: a worker that can change neither is passed over, and one
/// is offered only to the one it can change (on an idle fleet every worker
/// ties the pick, while the alternates are full after the first few).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::scheduler) struct OfferTo {
    pub picker: bool,
    pub alternates: bool,
}

impl OfferTo {
    /// Offered to both, as without the shortcut.
    pub const BOTH: OfferTo = OfferTo {
        picker: true,
        alternates: true,
    };

    pub fn nothing(&self) -> bool {
        !self.picker && !self.alternates
    }
}

/// What offering worker `at` (a `LoadTable` index) could change: the picker
/// unless its least load is above the picker's `max_useful_cost`, the
/// alternates unless no rank's load is below that rank's bar.
#[inline(always)]
pub(in crate::scheduler) fn offer_to(
    loads: &LoadTable,
    at: usize,
    picker: &impl Picker,
    collector: Option<&AlternatesCollector>,
) -> OfferTo {
    let least = loads.least(at);
    let offer_to = OfferTo {
        picker: least <= picker.max_useful_cost(),
        alternates: collector.is_some_and(|c| !c.refuses(least, loads.worker(at))),
    };
    #[cfg(test)]
    super::PASSED_OVER.set(super::PASSED_OVER.get() + usize::from(offer_to.nothing()));
    offer_to
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::REMOVED;
    use crate::scheduler::pickers::least_cost::LeastCost;
    use crate::scheduler::testing::{ctx, state};
    use crate::scheduler::Constraint;

    #[test]
    fn passes_over_workers_that_cannot_enter_the_pick_or_the_alternates() {
        let loads = LoadTable::of(&[Some(state(&[5, 9], 1000)), Some(state(&[7, 8], 1000)), None]);
        let plain = ctx(Constraint::default());
        let passes_over =
            |at, picker: &LeastCost, collector| offer_to(&loads, at, picker, collector).nothing();
        let mut picker = LeastCost::new(&plain);
        assert!(!passes_over(1, &picker, None), "nothing picked yet");
        picker.offer(0, loads.worker(0));
        assert!(passes_over(1, &picker, None), "7 > 5");
        assert!(passes_over(2, &picker, None), "no loads at all");
        let mut collector = AlternatesCollector::default();
        collector.reset(1);
        collector.offer(0, loads.worker(0));
        assert_eq!(
            offer_to(&loads, 1, &picker, Some(&collector)),
            OfferTo {
                picker: false,
                alternates: true
            },
            "8 < 9 for rank 1's alternates"
        );
        collector.offer(1, &[REMOVED, 6]);
        assert!(passes_over(1, &picker, Some(&collector)), "7 >= 5 and 8 >= 6");
        let mut tie = LeastCost::new(&plain);
        tie.offer(0, &[7]);
        assert_eq!(
            offer_to(&loads, 1, &tie, Some(&collector)),
            OfferTo {
                picker: true,
                alternates: false
            },
            "a tie of the pick may be taken; the alternates are full"
        );
        assert!(
            OfferTo {
                picker: false,
                alternates: false
            }
            .nothing()
                && !OfferTo::BOTH.nothing()
        );
    }
}
