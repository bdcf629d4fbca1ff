//! Filter `pinned` (test-only): with a pin `<worker name or ip:port>/<rank>`
//! in the constraint, keeps only that (worker, rank). The router treats a pin
//! as a preference: when nothing is left it chooses again without the pin.

use crate::cost::{Slot, REMOVED};
use crate::scheduler::{Context, Filter, WorkerView};

pub struct Pinned;

impl Filter for Pinned {
    fn applies(&self, ctx: &Context) -> bool {
        ctx.constraint.pin.is_some()
    }

    fn filter(&self, ctx: &Context, worker: &WorkerView, ranks: &mut [Slot]) -> bool {
        let Some(pin) = ctx.constraint.pin else {
            return true;
        };
        let Some((name, rank)) = pin.rsplit_once('/') else {
            return false;
        };
        let (name, rank) = (name.trim(), rank.trim().parse::<usize>().ok());
        if worker.worker.name != name && worker.worker.endpoint() != name {
            return false;
        }
        let Some(kept) = rank.and_then(|r| ranks.get(r).copied()) else {
            return false;
        };
        ranks.fill(REMOVED);
        if let Some(slot) = rank.and_then(|r| ranks.get_mut(r)) {
            *slot = kept;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;

    #[test]
    fn a_pin_by_name_or_endpoint_keeps_one_candidate() {
        let (a, b) = (worker("a", 1, None), worker("b", 2, None));
        let s = state(&[9, 9, 9, 9], 1000);
        let pin = |p| {
            ctx(Constraint {
                only_rank: None,
                pin: Some(p),
            })
        };
        assert_eq!(
            run_filter(&Pinned, &pin("b/3"), 1, &b, &s),
            Some(vec![REMOVED, REMOVED, REMOVED, 0])
        );
        assert_eq!(
            run_filter(&Pinned, &pin("b/3"), 0, &a, &s),
            None,
            "another worker"
        );
        assert!(run_filter(&Pinned, &pin(" 127.0.0.1:1 / 0"), 0, &a, &s).is_some());
        assert_eq!(run_filter(&Pinned, &pin("a/4"), 0, &a, &s), None, "no such rank");
        assert_eq!(run_filter(&Pinned, &pin("a"), 0, &a, &s), None, "not a pin");
        assert_eq!(run_filter(&Pinned, &pin("zzz/0"), 0, &a, &s), None);
        assert!(run_filter(&Pinned, &ctx(Constraint::default()), 0, &a, &s).is_some());
    }
}
