//! Filter `unsaturated`: with admission on, clears the ranks whose expected
//! wait is past the request's limit (`worker_state::saturation`), so a
//! request admission let in goes to a rank with room, not to one a scorer
//! prefers whose queue is long (the choose stage falls back to the choice
//! without it should it leave nothing).

use crate::cost::{Slot, REMOVED};
use crate::scheduler::{Context, Filter, WorkerView};

pub struct Unsaturated;

impl Filter for Unsaturated {
    fn applies(&self, ctx: &Context) -> bool {
        ctx.room.is_some()
    }

    fn filter(&self, ctx: &Context, worker: &WorkerView, ranks: &mut [Slot]) -> bool {
        let Some(room) = ctx.room else {
            return true;
        };
        for (rank, slot) in ranks.iter_mut().enumerate() {
            if *slot != REMOVED && !room.has_room(worker.state, rank) {
                *slot = REMOVED;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::RankLoad;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;
    use crate::worker_state::saturation::{Limits, Room};

    #[test]
    fn clears_the_ranks_without_room_only_when_admission_asks() {
        let w = worker("a", 1, None);
        let mut s = state(&[1, 1, 1], 1000);
        let ranks: Vec<RankLoad> = [0, 5000, 200]
            .iter()
            .map(|t| RankLoad {
                tokens: Some(1),
                waiting_uncached_tokens: Some(*t),
                ..RankLoad::default()
            })
            .collect();
        s.apply_drain(0, &ranks, 1);
        let figures: Vec<_> = ranks.iter().map(crate::worker_state::RankFigures::from).collect();
        s.apply_figures(s.snapshot_seq, &figures);
        let plain = ctx(Constraint::default());
        assert!(!Unsaturated.applies(&plain));
        let room = Room {
            limits: Limits {
                max_wait_ms: 500,
                max_kv_usage: None,
                max_requests: None,
                slo: None,
            },
            prior_tokens_per_s: 1000.0,
            learn: true,
        };
        let admitting = Context {
            room: Some(room),
            ..plain
        };
        assert!(Unsaturated.applies(&admitting));
        assert_eq!(
            run_filter(&Unsaturated, &admitting, 0, &w, &s),
            Some(vec![0, REMOVED, 0]),
            "5 s of wait on rank 1"
        );
    }
}
