//! Workers and states for the steps' tests.

use super::*;
pub fn worker(name: &str, port: u16, dp_size: Option<u32>) -> Worker {
    Worker {
        name: name.into(),
        address: format!("127.0.0.1:{port}").parse().unwrap(),
        dp_size,
        bootstrap_port: None,
        rank_numbering: None,
        rank_ports: false,
        loads_address: None,
    }
}

/// A state polled at `at` with these tokens.
pub fn state(tokens: &[u64], at: u64) -> WorkerState {
    let mut s = WorkerState::default();
    let seq = s.begin_poll();
    s.apply_snapshot(seq, at, &tokens.iter().map(|t| Some(*t)).collect::<Vec<_>>());
    s
}

pub fn ctx(constraint: Constraint<'_>) -> Context<'_> {
    Context {
        now_ms: 1000,
        stale_after_ms: 3000,
        constraint,
        tie_breaker: 0,
        health: &crate::health::NO_HEALTH,
        admit_probing: false,
        prefix: None,
        pick: Pick::LeastCost,
        gateways: 1,
        room: None,
    }
}

/// Prefix affinity for a streamed request of `prompt` at t = 1000 s,
/// no index read yet.
pub fn prefix_request(
    settings: &crate::config::Prefix,
    prompt: crate::prefix::PromptBlocks,
    output: u64,
) -> RequestPrefix<'_> {
    RequestPrefix::new(settings, prompt, true, output, 1_000_000)
}

/// Passive health that ejects after 3 failures for 1 s, doubling to 4 s.
pub fn policy() -> crate::config::PassiveHealth {
    crate::config::PassiveHealth {
        consecutive_failures: 3,
        cooldown_ms: 1000,
        max_cooldown_ms: 4000,
        probe_share: 0.05,
    }
}

/// Takes `target` out of rotation at `at_ms`: `policy()`'s failures in a row.
pub fn eject(health: &mut Health, target: crate::health::Target, at_ms: u64) {
    let policy = policy();
    for _ in 0..policy.consecutive_failures {
        health.observe(&policy, target, crate::health::Outcome::Failure, at_ms, at_ms);
    }
}

/// The loads of a pool whose first worker sits at `offset`.
pub fn loads_at(offset: usize, states: &[Option<WorkerState>]) -> LoadTable {
    let mut all = vec![None; offset];
    all.extend_from_slice(states);
    LoadTable::of(&all)
}

/// Runs one filter on a worker with `ranks` slots; None if it dropped the worker.
pub fn run_filter(
    f: &dyn Filter,
    ctx: &Context,
    index: usize,
    worker: &Worker,
    state: &WorkerState,
) -> Option<Vec<Slot>> {
    let mut ranks = vec![0; state.ranks()];
    let loads = LoadTable::of(std::slice::from_ref(&Some(state.clone())));
    let view = WorkerView {
        index,
        worker,
        state,
        loads: loads.worker(0),
    };
    f.filter(ctx, &view, &mut ranks).then_some(ranks)
}
