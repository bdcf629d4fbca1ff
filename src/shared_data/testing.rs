//! Fleets with polled states in shared data, for the tests of the state
//! cache, the router and the request lifecycle.

use super::{create_index, update_worker, IfMissing};
use crate::config::{Config, LoadMeasure};
use crate::host::fake::FakeHost;
use crate::host::Host;
use crate::worker_state::{PrefillTicket, Ticket};
use std::rc::Rc;

/// Two workers `a` (127.0.0.1:1) and `b` (127.0.0.1:2), plus `extra` keys.
/// These fleets test the routing mechanics against the joint minimum of
/// tokens, so with affinity on each rank costs its own tokens
/// (`prefix_load: "rank"`) unless `extra` names `prefix_load`; the lockstep
/// default has its own tests (scheduler/scorers/load.rs).
pub fn config(extra: &str) -> Rc<Config> {
    let mut c = Config::from_json(
        format!(
            r#"{{"workers":[{{"address":"127.0.0.1:1","name":"a"}},{{"address":"127.0.0.1:2","name":"b"}}]{extra}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    if let Some(prefix) = c.prefix.as_mut().filter(|_| !extra.contains("prefix_load\"")) {
        prefix.load = LoadMeasure::Rank;
    }
    Rc::new(c)
}

/// Installs a snapshot for worker `i` as the poller would.
pub fn poll(config: &Config, host: &FakeHost, i: usize, tokens: &[u64]) {
    let now = host.now_ms();
    let tokens: Vec<Option<u64>> = tokens.iter().map(|t| Some(*t)).collect();
    update_worker(config, host, i, IfMissing::Create, |s| {
        let seq = s.begin_poll();
        s.apply_snapshot(seq, now, &tokens).then_some(())
    })
    .unwrap();
    create_index(config, host, i);
}

/// `config(extra)` at t = 10 s with a: [100, 50, 100, 100], b: [100, 100, 20, 100].
pub fn fleet(extra: &str) -> (Rc<Config>, FakeHost) {
    let c = config(extra);
    let h = FakeHost::default();
    h.now.set(10_000);
    poll(&c, &h, 0, &[100, 50, 100, 100]);
    poll(&c, &h, 1, &[100, 100, 20, 100]);
    (c, h)
}

/// PD: prefill p0 (10.0.0.1:30000, bootstrap port 8998) and p1, decode d0 and
/// d1; the lowest ranks are d1/1 and p0/1.
pub fn pd_fleet(extra: &str) -> (Rc<Config>, FakeHost) {
    let c = Config::from_json(
        format!(
            r#"{{"prefill_workers":[{{"address":"10.0.0.1:30000","name":"p0","bootstrap_port":8998}},{{"address":"10.0.0.2:30000","name":"p1"}}],
                "decode_workers":[{{"address":"10.0.1.1:30000","name":"d0"}},{{"address":"10.0.1.2:30000","name":"d1"}}]{extra}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    let c = Rc::new(c);
    let h = FakeHost::default();
    h.now.set(10_000);
    poll(&c, &h, 0, &[50, 50]); // d0
    poll(&c, &h, 1, &[50, 5]); // d1: rank 1 lowest
    poll(&c, &h, 2, &[9, 1]); // p0: rank 1 lowest
    poll(&c, &h, 3, &[30, 30]); // p1
    (c, h)
}

pub fn json(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes).unwrap()
}

/// Admission on: every rank of every worker reports `waiting` uncached
/// prompt tokens queued (a new snapshot with the same tokens).
pub fn queue_prefill(config: &Config, host: &FakeHost, waiting: u64) {
    for i in 0..config.all_workers().count() {
        queue_prefill_on(config, host, i, &|_| waiting);
    }
}

/// Worker `i`'s ranks report `waiting(rank)` uncached prompt tokens
/// waiting, at unchanged tokens, as a new poll.
pub fn queue_prefill_on(config: &Config, host: &FakeHost, i: usize, waiting: &dyn Fn(usize) -> u64) {
    report_on(config, host, i, &|r| crate::load::RankLoad {
        waiting_uncached_tokens: Some(waiting(r)),
        waiting_requests: Some(u64::from(waiting(r) > 0)),
        ..crate::load::RankLoad::default()
    });
}

/// Worker `i`'s ranks report `load(rank)` (its tokens kept as polled), as
/// a new poll.
pub fn report_on(config: &Config, host: &FakeHost, i: usize, load: &dyn Fn(usize) -> crate::load::RankLoad) {
    use crate::load::RankLoad;
    use crate::worker_state::RankFigures;
    let now = host.now_ms();
    update_worker(config, host, i, IfMissing::Skip, |s| {
        let tokens: Vec<Option<u64>> = (0..s.ranks()).map(|r| s.polled_tokens(r)).collect();
        let ranks: Vec<RankLoad> = tokens
            .iter()
            .enumerate()
            .map(|(r, t)| RankLoad {
                tokens: *t,
                ..load(r)
            })
            .collect();
        let figures: Vec<RankFigures> = ranks.iter().map(RankFigures::from).collect();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, now, &tokens).then_some(())?;
        s.apply_drain(0, &ranks, config.gateways);
        s.apply_figures(seq, &figures);
        Some(())
    })
    .unwrap();
}

/// A routed request ended: its estimate leaves its rank's state (what the
/// request lifecycle's end does, `request/teardown.rs`).
pub fn give_back(config: &Config, host: &dyn Host, estimate: &Ticket) {
    update_worker(config, host, estimate.worker, IfMissing::Skip, |s| {
        s.release(estimate).then_some(())
    });
}

/// A routed request's prefill is over: its queued prompt leaves its rank.
pub fn prefill_over(config: &Config, host: &dyn Host, queued: &PrefillTicket) {
    update_worker(config, host, queued.worker, IfMissing::Skip, |s| {
        s.prefill_started(queued);
        Some(())
    });
}
