//! Every worker's effective tokens per rank (polled figure plus pending
//! estimates; `REMOVED` for a rank the report gave no usable figure for), laid
//! out flat and derived once per state change: the `load` scorer then reads
//! one contiguous array per choice instead of walking each state's buckets.
//! Each worker's least load is kept beside them: a lower bound on any cost
//! the load-only pipeline gives its ranks (the scheduler's `pruning/`).

use crate::cost::{Slot, MAX_COST, REMOVED};
use crate::worker_state::WorkerState;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTable {
    values: Vec<Slot>,
    /// Where each worker's ranks start in `values`; one more entry than workers.
    starts: Vec<usize>,
    /// Per worker, the least of its `values` (`REMOVED` when it has none).
    least: Vec<Slot>,
}

impl LoadTable {
    /// The loads of these states (indexed like them).
    pub fn of(states: &[Option<WorkerState>]) -> LoadTable {
        let mut loads = LoadTable::default();
        loads.rebuild(states);
        loads
    }

    /// Derives every worker's loads afresh.
    pub fn rebuild(&mut self, states: &[Option<WorkerState>]) {
        self.values.clear();
        self.starts.clear();
        self.least.clear();
        self.starts.push(0);
        for state in states {
            let mut least = REMOVED;
            if let Some(state) = state {
                let at = self.values.len();
                self.values.resize(at + state.ranks(), 0);
                if let Some(slots) = self.values.get_mut(at..) {
                    least = derive(state, slots);
                }
            }
            self.starts.push(self.values.len());
            self.least.push(least);
        }
    }

    /// Derives worker `index`'s loads again after its state changed; false
    /// when its rank count changed (then `rebuild` is needed).
    pub fn update(&mut self, index: usize, state: Option<&WorkerState>) -> bool {
        let ranks = state.map_or(0, WorkerState::ranks);
        let (Some(&start), Some(&end)) = (self.starts.get(index), self.starts.get(index + 1)) else {
            return false;
        };
        let Some(slots) = self.values.get_mut(start..end).filter(|s| s.len() == ranks) else {
            return false;
        };
        let least = state.map_or(REMOVED, |state| derive(state, slots));
        if let Some(slot) = self.least.get_mut(index) {
            *slot = least;
        }
        true
    }

    /// The least of worker `index`'s loads (`REMOVED` when it has none).
    #[inline]
    pub fn least(&self, index: usize) -> Slot {
        self.least.get(index).copied().unwrap_or(REMOVED)
    }

    /// Worker `index`'s loads, one per rank its state lists.
    pub fn worker(&self, index: usize) -> &[Slot] {
        match (self.starts.get(index), self.starts.get(index + 1)) {
            (Some(&start), Some(&end)) => self.values.get(start..end).unwrap_or_default(),
            _ => &[],
        }
    }
}

/// One slot per rank of `state`: its effective tokens, `REMOVED` if unknown;
/// returns the least.
fn derive(state: &WorkerState, slots: &mut [Slot]) -> Slot {
    let mut least = REMOVED;
    for (rank, slot) in slots.iter_mut().enumerate() {
        *slot = state.effective_tokens(rank).map_or(REMOVED, |t| t.min(MAX_COST));
        least = least.min(*slot);
    }
    least
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(tokens: &[u64], at: u64) -> WorkerState {
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, at, &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>());
        s
    }

    #[test]
    fn loads_follow_their_states() {
        let mut busy = state(&[5, 6], 1000);
        busy.add(0, 1, 10).unwrap();
        let states = vec![Some(busy.clone()), None, Some(state(&[1, 2, 3], 1000))];
        let mut loads = LoadTable::of(&states);
        assert_eq!(loads.worker(0), [5, 16]);
        assert_eq!((loads.least(0), loads.least(1), loads.least(2)), (5, REMOVED, 1));
        assert_eq!(loads.least(3), REMOVED, "past the workers");
        assert!(loads.worker(1).is_empty());
        assert_eq!(loads.worker(2), [1, 2, 3]);
        assert!(loads.worker(3).is_empty());
        busy.add(0, 0, 1).unwrap();
        assert!(loads.update(0, Some(&busy)));
        assert_eq!(loads.worker(0), [6, 16]);
        assert_eq!(loads.least(0), 6, "follows an update");
        assert!(!loads.update(1, Some(&busy)), "a new rank count needs a rebuild");
        assert!(loads.update(1, None));
        assert!(!loads.update(2, None));
        let mut grown = states.clone();
        grown[1] = Some(busy);
        loads.rebuild(&grown);
        assert_eq!(loads, LoadTable::of(&grown));
        assert_eq!(loads.worker(1), [6, 16]);
    }
}
