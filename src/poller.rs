//! Load polling: one poller per Envoy process, elected through a lease in
//! shared data, sends one load request per worker per interval and stores the
//! parsed snapshots where every thread's router reads them.

use crate::config::{Config, Discovery, LoadEndpoint, Worker};
use crate::discovery;
use crate::host::{Callout, Host};
use crate::load::{parse_load_report, RankTokens};
use crate::metrics::{self, PerWorker};
use crate::store::{self, IfMissing, Members};
use hashbrown::HashMap;
use std::net::SocketAddr;

/// Header that tells the ORIGINAL_DST poll cluster which host to connect to.
pub const POLL_DESTINATION_HEADER: &str = "x-envoy-original-dst-host";
const V1_LOADS_PATH: &str = "/v1/loads?include=core";
const GET_LOAD_PATH: &str = "/get_load";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    V1Loads,
    GetLoad,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::V1Loads => V1_LOADS_PATH,
            Endpoint::GetLoad => GET_LOAD_PATH,
        }
    }
}

/// A load poll in flight.
#[derive(Debug, Clone, Copy)]
struct LoadCall {
    worker: SocketAddr,
    seq: u64,
    endpoint: Endpoint,
}

#[derive(Debug, Clone, Copy)]
enum Call {
    Load(LoadCall),
    /// The admin API's cluster listing (workers taken from a cluster).
    Membership,
}

/// Per-VM poller state. Workers are keyed by address, so a membership change
/// between a poll and its answer cannot misfile the answer.
pub struct Poller {
    /// This VM's identity in the lease (0 until assigned).
    vm_id: u64,
    /// When this poller's configuration was applied (ms since the epoch).
    generation: u64,
    outstanding: HashMap<u32, Call>,
    /// Whether the last poll of each worker succeeded, to log changes only.
    healthy: HashMap<SocketAddr, bool>,
}

/// How often every thread's root context ticks: fine enough for sub-second
/// intervals and quick lease takeover, coarse enough to cost nothing.
pub fn tick_period_ms(config: &Config) -> u64 {
    (config.poll_interval_ms / 4).clamp(25, 250)
}

fn lease_ttl_ms(config: &Config) -> u64 {
    4 * tick_period_ms(config)
}

impl Poller {
    /// `configured_at_ms`: when the plugin configuration was applied; the
    /// newest configuration's pollers take over the lease from older ones.
    pub fn new(configured_at_ms: u64) -> Poller {
        Poller {
            vm_id: 0,
            generation: configured_at_ms,
            outstanding: HashMap::new(),
            healthy: HashMap::new(),
        }
    }

    /// A number unique to this VM among those sharing the data (also a tie-break salt).
    pub fn vm_id(&mut self, config: &Config, host: &dyn Host) -> u64 {
        if self.vm_id == 0 {
            self.vm_id = store::next_vm_id(config, host);
        }
        self.vm_id
    }

    /// Takes or renews the lease; true when this VM holds it and a round is due.
    fn lease_round_due(&mut self, config: &Config, host: &dyn Host) -> bool {
        let me = self.vm_id(config, host);
        me != 0 && store::claim_poll_round(config, host, me, self.generation, lease_ttl_ms(config))
    }

    pub fn on_tick(&mut self, config: &Config, host: &dyn Host) {
        if !self.lease_round_due(config, host) {
            return;
        }
        if let Some(discovery) = config.discovery() {
            self.dispatch_membership(config, discovery, host);
        }
        let now = host.now_ms();
        let states = store::read_worker_states(config, host);
        for ((index, w), state) in config.all_workers().enumerate().zip(&states) {
            let age = state
                .as_ref()
                .filter(|s| s.snapshot_seq > 0)
                .map(|s| now.saturating_sub(s.snapshot_at_ms))
                .unwrap_or(u64::MAX >> 1);
            host.gauge(&PerWorker::SnapshotAgeMs.of(&w.name), age);
            if self
                .outstanding
                .values()
                .any(|c| matches!(c, Call::Load(call) if call.worker == w.address))
            {
                host.count(&PerWorker::PollSkipped.of(&w.name), 1);
                continue;
            }
            self.dispatch(config, host, index);
        }
        // So an operator (and the soak) can see it stay bounded.
        host.gauge(metrics::SHARED_DATA_BYTES, store::shared_bytes(config, host));
    }

    fn dispatch_membership(&mut self, config: &Config, discovery: &Discovery, host: &dyn Host) {
        if self.outstanding.values().any(|c| matches!(c, Call::Membership)) {
            return;
        }
        let path = discovery::admin_clusters_path(&discovery.cluster);
        let call = Callout {
            cluster: &discovery.admin_cluster,
            headers: &[
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", "dprank-admin"),
            ],
            body: None,
            timeout_ms: config.poll_timeout_ms,
        };
        match host.http_call(&call) {
            Ok(token) => {
                self.outstanding.insert(token, Call::Membership);
            }
            Err(e) => {
                host.count(metrics::MEMBERSHIP_FAILED, 1);
                log::warn!(
                    "cannot read cluster membership through `{}`: {e}",
                    discovery.admin_cluster
                );
            }
        }
    }

    fn dispatch(&mut self, config: &Config, host: &dyn Host, index: usize) {
        let Some(w) = config.worker(index) else {
            return;
        };
        let polled = store::update_worker(config, host, index, IfMissing::Create, |state| {
            Some((state.begin_poll(), state.get_load_only))
        });
        let Some((seq, get_load_only)) = polled else {
            return;
        };
        let endpoint = match config.load_endpoint {
            LoadEndpoint::GetLoad => Endpoint::GetLoad,
            LoadEndpoint::V1Loads => Endpoint::V1Loads,
            LoadEndpoint::Auto if get_load_only => Endpoint::GetLoad,
            LoadEndpoint::Auto => Endpoint::V1Loads,
        };
        let authority = w.endpoint();
        let call = Callout {
            cluster: &config.poll_cluster,
            headers: &[
                (":method", "GET"),
                (":path", endpoint.path()),
                (":authority", authority.as_str()),
                (POLL_DESTINATION_HEADER, authority.as_str()),
                ("accept", "application/json"),
            ],
            body: None,
            timeout_ms: config.poll_timeout_ms,
        };
        match host.http_call(&call) {
            Ok(token) => {
                let worker = w.address;
                self.outstanding.insert(
                    token,
                    Call::Load(LoadCall {
                        worker,
                        seq,
                        endpoint,
                    }),
                );
            }
            Err(e) => {
                host.count(&PerWorker::PollFailed.of(&w.name), 1);
                log::warn!(
                    "cannot poll {} through cluster `{}`: {e}",
                    authority,
                    config.poll_cluster
                );
            }
        }
    }

    /// Handles a callout response; `status` is None when the call failed (timeout, reset).
    pub fn on_response(
        &mut self,
        config: &Config,
        host: &dyn Host,
        token: u32,
        status: Option<u32>,
        body: &[u8],
    ) {
        match self.outstanding.remove(&token) {
            Some(Call::Load(call)) => self.on_load_response(config, host, call, status, body),
            Some(Call::Membership) => on_membership_response(config, host, status, body),
            None => {}
        }
    }

    fn on_load_response(
        &mut self,
        config: &Config,
        host: &dyn Host,
        call: LoadCall,
        status: Option<u32>,
        body: &[u8],
    ) {
        // The worker may have left the cluster since the poll was sent.
        let Some((index, w)) = config
            .all_workers()
            .enumerate()
            .find(|(_, w)| w.address == call.worker)
        else {
            return;
        };
        let outcome = match status {
            Some(200) => parse_load_report(body).map_err(|e| e.to_string()),
            Some(404) if call.endpoint == Endpoint::V1Loads && config.load_endpoint == LoadEndpoint::Auto => {
                log::info!("{} has no /v1/loads; polling /get_load from now on", w.endpoint());
                // Kept with the worker's state, so whichever thread polls next knows.
                store::update_worker(config, host, index, IfMissing::Create, |state| {
                    state.get_load_only = true;
                    Some(())
                });
                self.dispatch(config, host, index);
                return;
            }
            Some(code) => Err(format!("HTTP {code} from {}", call.endpoint.path())),
            None => Err("no response (timeout or connection failure)".to_string()),
        };
        let ok = match outcome {
            Ok(tokens) => {
                apply_report(config, host, index, w, call.seq, tokens);
                true
            }
            Err(reason) => {
                host.count(&PerWorker::PollFailed.of(&w.name), 1);
                if self.healthy.get(&call.worker) != Some(&false) {
                    log::warn!(
                        "load poll of {} failed: {reason}; keeping its last snapshot",
                        w.endpoint()
                    );
                }
                false
            }
        };
        if self.healthy.insert(call.worker, ok) == Some(false) && ok {
            log::info!("load poll of {} recovered", w.endpoint());
        }
    }
}

/// Stores a good report as worker `index`'s snapshot (poll `seq`), trimmed
/// to a configured `dp_size`, and publishes its figures.
fn apply_report(
    config: &Config,
    host: &dyn Host,
    index: usize,
    w: &Worker,
    seq: u64,
    mut tokens: RankTokens,
) {
    if let Some(dp) = w.dp_size {
        if tokens.len() != dp as usize {
            host.count(&PerWorker::DpSizeMismatch.of(&w.name), 1);
            log::warn!(
                "{} reports {} ranks but dp_size is {dp}; using ranks below {dp}",
                w.endpoint(),
                tokens.len()
            );
            tokens.truncate(dp as usize);
        }
    }
    let now = host.now_ms();
    store::update_worker(config, host, index, IfMissing::Create, |state| {
        state.apply_snapshot(seq, now, &tokens).then_some(())
    });
    for (rank, t) in tokens.iter().enumerate() {
        if let Some(t) = t {
            host.gauge(&metrics::tokens(&w.name, rank), *t);
        }
    }
    host.count(&PerWorker::PollOk.of(&w.name), 1);
}

/// Stores a new membership for every thread; workers that left lose their state.
fn on_membership_response(config: &Config, host: &dyn Host, status: Option<u32>, body: &[u8]) {
    let Some(discovery) = config.discovery() else {
        return;
    };
    let members = match status {
        Some(200) => discovery::cluster_members(body, &discovery.cluster),
        Some(code) => Err(format!("admin answered HTTP {code}")),
        None => Err("admin did not answer".to_string()),
    };
    let members = match members {
        Ok(m) => Members(m),
        Err(e) => {
            host.count(metrics::MEMBERSHIP_FAILED, 1);
            log::warn!("cannot read the members of cluster `{}`: {e}", discovery.cluster);
            return;
        }
    };
    if store::publish_members(config, host, &members).is_none() {
        return;
    }
    host.count(metrics::MEMBERSHIP_CHANGES, 1);
    let list: Vec<String> = members.0.iter().map(|a| a.to_string()).collect();
    log::info!(
        "cluster `{}` now has {} worker(s): {}",
        discovery.cluster,
        members.0.len(),
        list.join(", ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::store::{read_worker_states, Keys};

    fn config(extra: &str) -> Config {
        Config::from_json(
            format!(r#"{{"workers":[{{"address":"127.0.0.1:1","name":"a"}},{{"address":"127.0.0.1:2","name":"b","dp_size":2}}]{extra}}}"#)
                .as_bytes(),
        )
        .unwrap()
    }

    /// A poller that has dispatched its first round of polls at t = 9,000 s.
    fn first_round(extra: &str) -> (Config, FakeHost, Poller) {
        let c = config(extra);
        let h = FakeHost::default();
        h.now.set(9_000_000);
        let mut p = Poller::new(0);
        p.on_tick(&c, &h);
        (c, h, p)
    }

    fn header<'a>(calls: &'a [crate::host::fake::Call], i: usize, name: &str) -> &'a str {
        calls[i]
            .1
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap()
    }

    #[test]
    fn only_one_of_several_vms_polls_and_once_per_interval() {
        let c = config("");
        let h = FakeHost::default();
        h.now.set(1_000_000);
        let mut vms: Vec<Poller> = (0..3).map(|_| Poller::new(0)).collect();
        for step in 0..40 {
            h.now.set(1_000_000 + step * tick_period_ms(&c));
            for vm in &mut vms {
                vm.on_tick(&c, &h);
            }
            // Answer every call immediately so none stays outstanding.
            let calls: Vec<_> = h.calls.borrow_mut().drain(..).collect();
            for (_, _, token) in calls {
                for vm in &mut vms {
                    vm.on_response(&c, &h, token, Some(200), br#"[{"dp_rank":0,"num_tokens":1}]"#);
                }
            }
        }
        // 40 ticks of 250 ms = 10 s: 10 rounds of 2 workers.
        assert_eq!(h.counter("dprank.poll_ok.a"), 10);
        assert_eq!(h.counter("dprank.poll_ok.b"), 10);
        // Lease (24) + VM counter (8) + two worker states of one rank.
        let state_bytes: u64 = h.shared.borrow().values().map(|(b, _)| b.len() as u64).sum();
        assert_eq!(h.gauge_value("dprank.shared_data_bytes"), Some(state_bytes));
    }

    #[test]
    fn a_dead_leader_is_replaced_after_its_lease_expires() {
        let c = config("");
        let h = FakeHost::default();
        h.now.set(5_000_000);
        let mut first = Poller::new(0);
        let mut second = Poller::new(0);
        first.on_tick(&c, &h);
        second.on_tick(&c, &h);
        assert_eq!(h.calls.borrow().len(), 2, "first polls both workers");
        // `first` dies: no more ticks from it.
        h.now.set(5_000_000 + lease_ttl_ms(&c) + 1);
        second.on_tick(&c, &h);
        assert_eq!(h.calls.borrow().len(), 4, "second took over");
    }

    #[test]
    fn poll_requests_target_the_worker_through_the_poll_cluster() {
        let c = config(r#","poll_cluster":"polls""#);
        let h = FakeHost::default();
        h.now.set(9_000_000);
        Poller::new(0).on_tick(&c, &h);
        let calls = h.calls.borrow();
        assert_eq!(calls[0].0, "polls");
        assert_eq!(header(&calls, 0, ":path"), "/v1/loads?include=core");
        assert_eq!(header(&calls, 1, POLL_DESTINATION_HEADER), "127.0.0.1:2");
        assert_eq!(header(&calls, 1, ":authority"), "127.0.0.1:2");
    }

    #[test]
    fn auto_falls_back_to_get_load_on_404() {
        let (c, h, mut p) = first_round("");
        p.on_response(&c, &h, 1, Some(404), b"not found");
        let calls = h.calls.borrow();
        assert_eq!(calls.len(), 3);
        assert_eq!(header(&calls, 2, ":path"), "/get_load");
        assert_eq!(header(&calls, 2, POLL_DESTINATION_HEADER), "127.0.0.1:1");
    }

    #[test]
    fn the_fallback_is_shared_with_every_poller() {
        let c = config("");
        let h = FakeHost::default();
        h.now.set(9_000_000);
        let mut first = Poller::new(0);
        first.on_tick(&c, &h);
        first.on_response(&c, &h, 1, Some(404), b"");
        // A newer configuration (or thread) takes over polling.
        let mut second = Poller::new(1);
        h.now.set(9_001_000);
        second.on_tick(&c, &h);
        let to_a: Vec<String> = h
            .calls
            .borrow()
            .iter()
            .filter(|call| {
                call.1
                    .iter()
                    .any(|(k, v)| k == POLL_DESTINATION_HEADER && v == "127.0.0.1:1")
            })
            .map(|call| call.1.iter().find(|(k, _)| k == ":path").unwrap().1.clone())
            .collect();
        assert_eq!(to_a, vec!["/v1/loads?include=core", "/get_load", "/get_load"]);
    }

    #[test]
    fn fixed_v1_endpoint_does_not_fall_back() {
        let (c, h, mut p) = first_round(r#","load_endpoint":"v1_loads""#);
        p.on_response(&c, &h, 1, Some(404), b"");
        assert_eq!(h.calls.borrow().len(), 2);
        assert_eq!(h.counter("dprank.poll_failed.a"), 1);
    }

    #[test]
    fn failures_keep_the_last_good_snapshot() {
        let (c, h, mut p) = first_round("");
        p.on_response(
            &c,
            &h,
            1,
            Some(200),
            br#"[{"dp_rank":0,"num_tokens":7},{"dp_rank":1,"num_tokens":3}]"#,
        );
        p.on_response(&c, &h, 2, Some(200), br#"[{"dp_rank":0,"num_tokens":1}]"#);
        h.now.set(9_000_000 + 1000);
        p.on_tick(&c, &h);
        let tokens: Vec<u32> = h.calls.borrow().iter().map(|c| c.2).collect();
        p.on_response(&c, &h, tokens[2], Some(500), b"oops");
        p.on_response(&c, &h, tokens[3], None, b"");
        let states = read_worker_states(&c, &h);
        let a = states[0].as_ref().unwrap();
        assert_eq!((a.polled_tokens(0), a.polled_tokens(1)), (Some(7), Some(3)));
        assert_eq!(a.snapshot_at_ms, 9_000_000);
        assert_eq!(h.counter("dprank.poll_failed.a"), 1);
        assert_eq!(h.counter("dprank.poll_failed.b"), 1);
        assert_eq!(h.gauge_value("dprank.tokens.a.rank_0"), Some(7));
    }

    #[test]
    fn malformed_reports_count_as_failures() {
        let (c, h, mut p) = first_round("");
        p.on_response(&c, &h, 1, Some(200), b"{\"loads\":[{\"dp_rank\":0,");
        assert_eq!(h.counter("dprank.poll_failed.a"), 1);
        assert!(read_worker_states(&c, &h)[0].as_ref().unwrap().snapshot_seq == 0);
    }

    #[test]
    fn configured_dp_size_trims_a_larger_report() {
        let (c, h, mut p) = first_round("");
        p.on_response(
            &c,
            &h,
            2,
            Some(200),
            br#"[{"num_tokens":1},{"num_tokens":2},{"num_tokens":3}]"#,
        );
        assert_eq!(read_worker_states(&c, &h)[1].as_ref().unwrap().ranks(), 2);
        assert_eq!(h.counter("dprank.dp_size_mismatch.b"), 1);
    }

    #[test]
    fn a_hanging_worker_is_not_polled_twice_at_once() {
        let (c, h, mut p) = first_round("");
        h.now.set(9_001_000);
        p.on_tick(&c, &h);
        assert_eq!(h.calls.borrow().len(), 2);
        assert_eq!(h.counter("dprank.poll_skipped.a"), 1);
    }

    #[test]
    fn unknown_tokens_are_ignored() {
        let c = config("");
        let h = FakeHost::default();
        let mut p = Poller::new(0);
        p.on_response(&c, &h, 77, Some(200), b"[]");
        assert_eq!(h.counters.borrow().len(), 0);
    }

    #[test]
    fn pd_mode_polls_both_pools() {
        let c = Config::from_json(
            br#"{"prefill_workers":[{"address":"127.0.0.1:1"}],"decode_workers":[{"address":"127.0.0.1:2"},{"address":"127.0.0.1:3"}]}"#,
        )
        .unwrap();
        let h = FakeHost::default();
        h.now.set(9_000_000);
        let mut p = Poller::new(0);
        p.on_tick(&c, &h);
        let targets: Vec<String> = (0..3)
            .map(|i| header(&h.calls.borrow(), i, POLL_DESTINATION_HEADER).to_string())
            .collect();
        assert_eq!(targets, vec!["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:1"]);
        p.on_response(&c, &h, 3, Some(200), br#"[{"num_tokens":4}]"#);
        assert_eq!(
            read_worker_states(&c, &h)[2].as_ref().unwrap().polled_tokens(0),
            Some(4)
        );
    }

    #[test]
    fn membership_is_read_from_the_admin_api_and_published() {
        use crate::discovery::Membership;
        use std::rc::Rc;
        let base = Rc::new(Config::from_json(br#"{"workers_from_cluster":{"cluster":"sglang"}}"#).unwrap());
        let h = FakeHost::default();
        h.now.set(9_000_000);
        let mut membership = Membership::new(base.clone());
        let mut p = Poller::new(0);
        p.on_tick(&membership.current(&h), &h);
        assert_eq!(h.calls.borrow()[0].0, "dprank_admin");
        assert_eq!(
            header(&h.calls.borrow(), 0, ":path"),
            "/clusters?format=json&filter=%5Esglang%24"
        );
        let admin = |hosts: &[&str]| {
            let hosts: Vec<String> = hosts
                .iter()
                .map(|a| {
                    let (ip, port) = a.split_once(':').unwrap();
                    format!(r#"{{"address":{{"socket_address":{{"address":"{ip}","port_value":{port}}}}}}}"#)
                })
                .collect();
            format!(
                r#"{{"cluster_statuses":[{{"name":"sglang","host_statuses":[{}]}}]}}"#,
                hosts.join(",")
            )
        };
        p.on_response(
            &membership.current(&h),
            &h,
            1,
            Some(200),
            admin(&["10.0.0.1:1", "10.0.0.2:1"]).as_bytes(),
        );
        let config = membership.current(&h);
        assert_eq!(config.routed().len(), 2);
        // The next round polls the members.
        h.now.set(9_001_000);
        p.on_tick(&config, &h);
        let polled: Vec<String> = h.calls.borrow()[1..]
            .iter()
            .filter(|c| c.0 == "dprank_poll")
            .map(|c| {
                c.1.iter()
                    .find(|(k, _)| k == POLL_DESTINATION_HEADER)
                    .unwrap()
                    .1
                    .clone()
            })
            .collect();
        assert_eq!(polled, vec!["10.0.0.1:1", "10.0.0.2:1"]);
        let gone: SocketAddr = "10.0.0.1:1".parse().unwrap();
        assert!(h
            .shared_get(&Keys::of(&base).worker(&gone))
            .is_some_and(|(b, _)| !b.is_empty()));
        // A worker leaves: its state is dropped.
        let admin_token = h
            .calls
            .borrow()
            .iter()
            .rev()
            .find(|c| c.0 == "dprank_admin")
            .unwrap()
            .2;
        p.on_response(
            &config,
            &h,
            admin_token,
            Some(200),
            admin(&["10.0.0.2:1"]).as_bytes(),
        );
        assert_eq!(membership.current(&h).routed().len(), 1);
        assert!(h
            .shared_get(&Keys::of(&base).worker(&gone))
            .is_some_and(|(b, _)| b.is_empty()));
        let published = h.shared_get(&Keys::of(&base).members()).unwrap().0;
        assert_eq!(
            store::decode(&published),
            Some(Members(vec!["10.0.0.2:1".parse().unwrap()]))
        );
        assert_eq!(h.counter("dprank.membership_changes"), 2);
    }

    #[test]
    fn a_reloaded_configuration_takes_the_lease_at_once() {
        let old = config("");
        let new = config(r#","poll_interval_ms":500"#);
        let h = FakeHost::default();
        h.now.set(5_000_000);
        let mut old_poller = Poller::new(1_000);
        let mut new_poller = Poller::new(2_000);
        old_poller.on_tick(&old, &h);
        assert_eq!(h.calls.borrow().len(), 2, "the old config polls first");
        h.now.set(5_000_100);
        new_poller.on_tick(&new, &h);
        assert_eq!(
            h.calls.borrow().len(),
            2,
            "its round is not due yet, but it holds the lease now"
        );
        h.now.set(5_000_600);
        old_poller.on_tick(&old, &h);
        assert_eq!(h.calls.borrow().len(), 2, "the old config backs off");
        new_poller.on_tick(&new, &h);
        assert_eq!(h.calls.borrow().len(), 4, "the new one polls at its interval");
    }
}
