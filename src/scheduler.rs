//! Choosing the (worker, rank) for a request, as small named steps. Each step
//! takes and returns candidates (lazily, one pass in all), so the order of
//! steps reads as the policy: `fresh_candidates` -> [`only_rank`] -> `pinned`
//! or `least_loaded`.

use crate::config::Worker;
use crate::state::WorkerState;

/// A (worker, rank) a request could be sent to, with its effective load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Candidate {
    pub worker: usize,
    pub rank: u32,
    /// Polled tokens plus estimates of requests the poll has not seen yet.
    pub load: u64,
}

/// Every known rank of every worker whose snapshot is within the stale limit.
/// A worker with a configured `dp_size` offers no rank at or beyond it, even
/// if its report lists more. Lazy: the steps after it run in the same pass.
pub fn fresh_candidates<'a>(
    workers: &'a [Worker],
    states: &'a [Option<WorkerState>],
    now_ms: u64,
    stale_after_ms: u64,
) -> impl Iterator<Item = Candidate> + 'a {
    workers
        .iter()
        .zip(states)
        .enumerate()
        .filter_map(move |(worker, (config, state))| {
            let state = state.as_ref().filter(|s| s.is_fresh(now_ms, stale_after_ms))?;
            let ranks = config
                .dp_size
                .map_or(state.ranks(), |dp| state.ranks().min(dp as usize));
            Some((worker, state, ranks))
        })
        .flat_map(|(worker, state, ranks)| {
            (0..ranks).filter_map(move |rank| {
                Some(Candidate {
                    worker,
                    rank: rank as u32,
                    load: state.effective_tokens(rank)?,
                })
            })
        })
}

/// With a rank, keeps only candidates of that rank (a client that pins its
/// rank, trusted by config); without, keeps all.
pub fn only_rank(
    candidates: impl Iterator<Item = Candidate>,
    rank: Option<u32>,
) -> impl Iterator<Item = Candidate> {
    candidates.filter(move |c| rank.is_none_or(|rank| c.rank == rank))
}

/// The candidate with the fewest tokens, in one pass. Among equal loads the
/// pick is uniform for a given `tie_breaker` (reservoir sampling), so equal
/// loads spread instead of all landing on the first rank.
pub fn least_loaded(candidates: impl Iterator<Item = Candidate>, tie_breaker: u64) -> Option<Candidate> {
    let mut best: Option<Candidate> = None;
    let mut ties = 0u64;
    for c in candidates {
        match best {
            Some(b) if c.load > b.load => {}
            Some(b) if c.load == b.load => {
                ties += 1;
                if mix(tie_breaker, ties).is_multiple_of(ties) {
                    best = Some(c);
                }
            }
            _ => {
                best = Some(c);
                ties = 1;
            }
        }
    }
    best
}

/// splitmix64 of the tie breaker and the tie's position: a cheap, well-spread hash.
fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Test-only choice from a pin header `<worker name or ip:port>/<rank>`; the
/// pinned pair must be a candidate (fresh, known rank).
pub fn pinned(
    mut candidates: impl Iterator<Item = Candidate>,
    workers: &[Worker],
    pin: &str,
) -> Option<Candidate> {
    let (worker, rank) = pin.rsplit_once('/')?;
    let rank: u32 = rank.trim().parse().ok()?;
    let worker = workers
        .iter()
        .position(|w| w.name == worker.trim() || w.endpoint() == worker.trim())?;
    candidates.find(|c| c.worker == worker && c.rank == rank)
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
        let got: Vec<_> = fresh_candidates(&workers, &states, 2000, 1500).collect();
        assert_eq!(got, vec![c(0, 0, 5), c(0, 1, 6)]);
    }

    #[test]
    fn fresh_candidates_respect_configured_dp_size() {
        let workers = [worker("a", 1, Some(2))];
        let states = [state(&[5, 6, 0, 0], 1000)];
        let got: Vec<_> = fresh_candidates(&workers, &states, 1000, 10).collect();
        assert_eq!(got, vec![c(0, 0, 5), c(0, 1, 6)]);
    }

    #[test]
    fn fresh_candidates_include_pending_estimates() {
        let workers = [worker("a", 1, None)];
        let mut s = state(&[5, 6], 1000).unwrap();
        s.add(0, 0, 10);
        assert_eq!(
            fresh_candidates(&workers, &[Some(s)], 1000, 10).collect::<Vec<_>>(),
            vec![c(0, 0, 15), c(0, 1, 6)]
        );
    }

    #[test]
    fn least_loaded_is_the_joint_minimum_across_workers() {
        let cands = [c(0, 0, 50), c(0, 1, 40), c(1, 0, 10), c(1, 1, 30)];
        assert_eq!(least_loaded(cands.into_iter(), 0), Some(c(1, 0, 10)));
        assert_eq!(least_loaded(std::iter::empty(), 0), None);
    }

    #[test]
    fn ties_spread_over_every_tied_candidate() {
        let cands = [c(0, 0, 1), c(0, 1, 1), c(1, 0, 9), c(1, 1, 1)];
        let mut picks = std::collections::HashMap::new();
        for t in 0..3000 {
            *picks
                .entry(least_loaded(cands.into_iter(), t).unwrap())
                .or_insert(0) += 1;
        }
        assert_eq!(picks.len(), 3, "never the loaded one: {picks:?}");
        assert!(picks.values().all(|n| *n > 800), "roughly uniform: {picks:?}");
        assert_eq!(
            least_loaded(cands.into_iter(), 7),
            least_loaded(cands.into_iter(), 7),
            "deterministic"
        );
    }

    #[test]
    fn only_rank_filters() {
        let cands = vec![c(0, 0, 1), c(0, 1, 1), c(1, 1, 0)];
        assert_eq!(only_rank(cands.clone().into_iter(), None).count(), 3);
        assert_eq!(
            only_rank(cands.clone().into_iter(), Some(1)).collect::<Vec<_>>(),
            vec![c(0, 1, 1), c(1, 1, 0)]
        );
    }

    #[test]
    fn pin_by_name_or_endpoint_must_be_a_candidate() {
        let workers = [worker("a", 1, None), worker("b", 2, None)];
        let cands = [c(0, 0, 9), c(1, 3, 9)];
        assert_eq!(pinned(cands.into_iter(), &workers, "b/3"), Some(c(1, 3, 9)));
        assert_eq!(
            pinned(cands.into_iter(), &workers, "127.0.0.1:1/0"),
            Some(c(0, 0, 9))
        );
        assert_eq!(pinned(cands.into_iter(), &workers, "a/3"), None);
        assert_eq!(pinned(cands.into_iter(), &workers, "zzz/0"), None);
        assert_eq!(pinned(cands.into_iter(), &workers, "a"), None);
    }
}
