//! Choosing the (worker, rank) for a request, as small named steps. Each step
//! takes and returns candidates, so the order of steps reads as the policy:
//! `fresh_candidates` -> [`only_rank`] -> `pinned` or `least_loaded`.

use crate::config::Worker;
use crate::state::WorkerState;

/// A (worker, rank) a request could be sent to, with its effective load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub worker: usize,
    pub rank: u32,
    /// Polled tokens plus estimates of requests the poll has not seen yet.
    pub load: u64,
}

/// Every known rank of every worker whose snapshot is within the stale limit.
/// A worker with a configured `dp_size` offers no rank at or beyond it, even
/// if its report lists more.
pub fn fresh_candidates(
    workers: &[Worker],
    states: &[Option<WorkerState>],
    now_ms: u64,
    stale_after_ms: u64,
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (worker, (config, state)) in workers.iter().zip(states).enumerate() {
        let Some(state) = state.as_ref().filter(|s| s.is_fresh(now_ms, stale_after_ms)) else {
            continue;
        };
        let ranks = match config.dp_size {
            Some(dp) => state.ranks().min(dp as usize),
            None => state.ranks(),
        };
        let loads = state.effective_loads();
        out.extend(
            loads
                .into_iter()
                .take(ranks)
                .enumerate()
                .filter_map(|(rank, load)| {
                    Some(Candidate {
                        worker,
                        rank: rank as u32,
                        load: load?,
                    })
                }),
        );
    }
    out
}

/// Keeps only candidates of one rank (a client that pins its rank, trusted by config).
pub fn only_rank(candidates: Vec<Candidate>, rank: u32) -> Vec<Candidate> {
    candidates.into_iter().filter(|c| c.rank == rank).collect()
}

/// The candidate with the fewest tokens. Ties are broken by `tie_breaker`
/// modulo the number of tied candidates, so equal loads spread instead of all
/// landing on the first rank.
pub fn least_loaded(candidates: &[Candidate], tie_breaker: u64) -> Option<Candidate> {
    let min = candidates.iter().map(|c| c.load).min()?;
    let tied = candidates.iter().filter(|c| c.load == min).count() as u64;
    let nth = (tie_breaker % tied.max(1)) as usize;
    candidates.iter().filter(|c| c.load == min).nth(nth).copied()
}

/// Test-only choice from a pin header `<worker name or ip:port>/<rank>`; the
/// pinned pair must be a candidate (fresh, known rank).
pub fn pinned(candidates: &[Candidate], workers: &[Worker], pin: &str) -> Option<Candidate> {
    let (worker, rank) = pin.rsplit_once('/')?;
    let rank: u32 = rank.trim().parse().ok()?;
    let worker = workers
        .iter()
        .position(|w| w.name == worker.trim() || w.endpoint() == worker.trim())?;
    candidates
        .iter()
        .find(|c| c.worker == worker && c.rank == rank)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(name: &str, port: u16, dp_size: Option<u32>) -> Worker {
        Worker {
            name: name.into(),
            address: format!("127.0.0.1:{port}").parse().unwrap(),
            dp_size,
            bootstrap_port: None,
        }
    }

    fn state(tokens: &[u64], at: u64) -> Option<WorkerState> {
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, at, &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>());
        Some(s)
    }

    fn c(worker: usize, rank: u32, load: u64) -> Candidate {
        Candidate { worker, rank, load }
    }

    #[test]
    fn fresh_candidates_skip_stale_and_unpolled_workers() {
        let workers = [worker("a", 1, None), worker("b", 2, None), worker("c", 3, None)];
        let states = [state(&[5, 6], 1000), state(&[1], 100), None];
        let got = fresh_candidates(&workers, &states, 2000, 1500);
        assert_eq!(got, vec![c(0, 0, 5), c(0, 1, 6)]);
    }

    #[test]
    fn fresh_candidates_respect_configured_dp_size() {
        let workers = [worker("a", 1, Some(2))];
        let got = fresh_candidates(&workers, &[state(&[5, 6, 0, 0], 1000)], 1000, 10);
        assert_eq!(got, vec![c(0, 0, 5), c(0, 1, 6)]);
    }

    #[test]
    fn fresh_candidates_include_pending_estimates() {
        let workers = [worker("a", 1, None)];
        let mut s = state(&[5, 6], 1000).unwrap();
        s.add(0, 0, 10);
        assert_eq!(
            fresh_candidates(&workers, &[Some(s)], 1000, 10),
            vec![c(0, 0, 15), c(0, 1, 6)]
        );
    }

    #[test]
    fn least_loaded_is_the_joint_minimum_across_workers() {
        let cands = [c(0, 0, 50), c(0, 1, 40), c(1, 0, 10), c(1, 1, 30)];
        assert_eq!(least_loaded(&cands, 0), Some(c(1, 0, 10)));
        assert_eq!(least_loaded(&[], 0), None);
    }

    #[test]
    fn ties_rotate_instead_of_always_taking_the_first() {
        let cands = [c(0, 0, 1), c(0, 1, 1), c(1, 0, 9), c(1, 1, 1)];
        let picks: Vec<_> = (0..3).map(|t| least_loaded(&cands, t).unwrap()).collect();
        assert_eq!(picks, vec![c(0, 0, 1), c(0, 1, 1), c(1, 1, 1)]);
    }

    #[test]
    fn only_rank_filters() {
        let cands = vec![c(0, 0, 1), c(0, 1, 1), c(1, 1, 0)];
        assert_eq!(only_rank(cands, 1), vec![c(0, 1, 1), c(1, 1, 0)]);
    }

    #[test]
    fn pin_by_name_or_endpoint_must_be_a_candidate() {
        let workers = [worker("a", 1, None), worker("b", 2, None)];
        let cands = [c(0, 0, 9), c(1, 3, 9)];
        assert_eq!(pinned(&cands, &workers, "b/3"), Some(c(1, 3, 9)));
        assert_eq!(pinned(&cands, &workers, "127.0.0.1:1/0"), Some(c(0, 0, 9)));
        assert_eq!(pinned(&cands, &workers, "a/3"), None);
        assert_eq!(pinned(&cands, &workers, "zzz/0"), None);
        assert_eq!(pinned(&cands, &workers, "a"), None);
    }
}
