use super::*;
use crate::host::fake::FakeHost;
use crate::shared_data::{read_worker_states, Keys};
use crate::worker_state::WorkerState;

/// A callout answered with `status` and `body`.
fn answer(status: u32, body: &[u8]) -> Result<CalloutResponse, CalloutError> {
    Ok(CalloutResponse {
        status,
        body: body.to_vec(),
    })
}

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
                vm.on_response(&c, &h, token, &answer(200, br#"[{"dp_rank":0,"num_tokens":1}]"#));
            }
        }
    }
    // 40 ticks of 250 ms = 10 s: 10 rounds of 2 workers.
    assert_eq!(h.counter("dprank.poll_ok.a"), 10);
    assert_eq!(h.counter("dprank.poll_ok.b"), 10);
    // Lease (24) + VM counter (8) + two worker states of one rank.
    let state_bytes: u64 = h.shared.bytes();
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
    p.on_response(&c, &h, 1, &answer(404, b"not found"));
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
    first.on_response(&c, &h, 1, &answer(404, b""));
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
    p.on_response(&c, &h, 1, &answer(404, b""));
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
        &answer(
            200,
            br#"[{"dp_rank":0,"num_tokens":7},{"dp_rank":1,"num_tokens":3}]"#,
        ),
    );
    p.on_response(&c, &h, 2, &answer(200, br#"[{"dp_rank":0,"num_tokens":1}]"#));
    h.now.set(9_000_000 + 1000);
    p.on_tick(&c, &h);
    let tokens: Vec<u32> = h.calls.borrow().iter().map(|c| c.2).collect();
    p.on_response(&c, &h, tokens[2], &answer(500, b"oops"));
    p.on_response(&c, &h, tokens[3], &Err(CalloutError::NoResponse));
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
    p.on_response(&c, &h, 1, &answer(200, b"{\"loads\":[{\"dp_rank\":0,"));
    assert_eq!(h.counter("dprank.poll_failed.a"), 1);
    assert!(read_worker_states(&c, &h)[0].as_ref().unwrap().snapshot_seq == 0);
}

#[test]
fn reports_with_senseless_ranks_are_refused_counted_and_logged_once() {
    let (c, h, mut p) = first_round("");
    let good = br#"[{"dp_rank":0,"num_tokens":7},{"dp_rank":1,"num_tokens":3}]"#;
    p.on_response(&c, &h, 1, &answer(200, good));
    let bad: [&[u8]; 3] = [
        br#"{"loads":[{"dp_rank":0,"num_tokens":1},{"dp_rank":99,"num_tokens":0}]}"#,
        br#"[{"dp_rank":0,"num_tokens":1},{"dp_rank":0,"num_tokens":0}]"#,
        br#"{"dp_rank_count":3,"loads":[{"dp_rank":0,"num_tokens":1},{"dp_rank":2,"num_tokens":0}]}"#,
    ];
    for (round, body) in bad.iter().enumerate() {
        h.now.set(9_000_000 + 1000 * (round as u64 + 1));
        h.calls.borrow_mut().clear();
        p.on_tick(&c, &h);
        let token = h.calls.borrow()[0].2;
        p.on_response(&c, &h, token, &answer(200, body));
    }
    let refused = |h: &FakeHost| h.shared.get(&Keys::of(&c).refused()).map(|(b, _)| b.len());
    assert!(refused(&h).is_some_and(|n| n > 4), "worker a is listed");
    assert!(
        !shared_data::set_refused(&c, &h, c.routed()[0].address, true),
        "so another VM stays silent"
    );
    assert_eq!(h.counter("dprank.report_refused.a"), 3);
    assert_eq!(h.counter("dprank.poll_failed.a"), 0, "the poll itself went fine");
    assert_eq!(h.counter("dprank.poll_ok.a"), 1);
    let a = read_worker_states(&c, &h)[0].clone().unwrap();
    assert_eq!(
        (a.ranks(), a.snapshot_at_ms),
        (2, 9_000_000),
        "the last good snapshot stays (and ages)"
    );
    h.now.set(9_010_000);
    h.calls.borrow_mut().clear();
    p.on_tick(&c, &h);
    let token = h.calls.borrow()[0].2;
    p.on_response(&c, &h, token, &answer(200, good));
    assert!(
        shared_data::set_refused(&c, &h, c.routed()[0].address, true),
        "a good report ended the episode: the next refusal is logged again"
    );
}

#[test]
fn envoy_health_is_read_from_the_admin_api_every_round() {
    let (c, h, mut p) = first_round(r#","envoy_health":{"cluster":"sglang","admin_cluster":"admin"}"#);
    let admin: Vec<_> = h
        .calls
        .borrow()
        .iter()
        .filter(|(cluster, _, _)| cluster == "admin")
        .map(|(_, headers, token)| (headers.clone(), *token))
        .collect();
    assert_eq!(admin.len(), 1);
    let path = admin[0].0.iter().find(|(k, _)| k == ":path").unwrap().1.clone();
    assert_eq!(path, "/clusters?format=json&filter=%5Esglang%24");
    let admin_json = br#"{"cluster_statuses":[{"name":"sglang","host_statuses":[
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":1}},"health_status":{"eds_health_status":"HEALTHY"}},
        {"address":{"socket_address":{"address":"127.0.0.1","port_value":2}},"health_status":{"failed_outlier_check":true}},
        {"address":{"socket_address":{"address":"127.0.0.9","port_value":9}},"health_status":{"failed_active_health_check":true}}
    ]}]}"#;
    p.on_response(&c, &h, admin[0].1, &answer(200, admin_json));
    let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
    assert_eq!(
        shared_data::read_health(&c, &h).envoy_unhealthy,
        vec![b],
        "only configured workers are kept"
    );
    h.now.set(9_001_000);
    h.calls.borrow_mut().clear();
    p.on_tick(&c, &h);
    assert_eq!(h.gauge_value("dprank.health.b"), Some(3));
    assert_eq!(h.gauge_value("dprank.health.a"), Some(0));
    // A failed read keeps the last view.
    let token = h.calls.borrow().iter().find(|c| c.0 == "admin").unwrap().2;
    p.on_response(&c, &h, token, &answer(503, b""));
    assert_eq!(h.counter("dprank.envoy_health_failed"), 1);
    assert_eq!(shared_data::read_health(&c, &h).envoy_unhealthy, vec![b]);
}

#[test]
fn configured_dp_size_trims_a_larger_report() {
    let (c, h, mut p) = first_round("");
    p.on_response(
        &c,
        &h,
        2,
        &answer(200, br#"[{"num_tokens":1},{"num_tokens":2},{"num_tokens":3}]"#),
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
    p.on_response(&c, &h, 77, &answer(200, b"[]"));
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
    p.on_response(&c, &h, 3, &answer(200, br#"[{"num_tokens":4}]"#));
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
        &answer(200, admin(&["10.0.0.1:1", "10.0.0.2:1"]).as_bytes()),
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
        .shared
        .get(&Keys::of(&base).worker(&gone))
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
        &answer(200, admin(&["10.0.0.2:1"]).as_bytes()),
    );
    assert_eq!(membership.current(&h).routed().len(), 1);
    // Emptied: reads as absent.
    assert!(h.shared.get(&Keys::of(&base).worker(&gone)).is_none());
    let published = h.shared.get(&Keys::of(&base).members()).unwrap().0;
    assert_eq!(
        crate::codec::decode(&published),
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

#[test]
fn a_worker_ejected_for_broken_streams_then_gone_returns_at_its_first_good_poll() {
    use crate::health::{Outcome, Phase, Target};
    use crate::health_updates as observe;
    let (c, h, mut p) = first_round("");
    let a = Target {
        worker: c.routed()[0].address,
        rank: None,
    };
    for _ in 0..5 {
        observe::record(&c, &h, &[(a, Outcome::Failure)], 9_000_000, false);
    }
    let phase = |h: &FakeHost| {
        shared_data::read_health(&c, h)
            .entry(&a)
            .map(|e| e.phase(h.now_ms()))
    };
    assert!(matches!(phase(&h), Some(Phase::Ejected { .. })));
    p.on_response(&c, &h, 1, &answer(503, b"no healthy upstream"));
    h.now.set(9_001_000);
    h.calls.borrow_mut().clear();
    p.on_tick(&c, &h);
    assert!(matches!(phase(&h), Some(Phase::Ejected { .. })), "still ejected");
    let token = h.calls.borrow()[0].2;
    p.on_response(&c, &h, token, &answer(200, br#"[{"dp_rank":0,"num_tokens":1}]"#));
    assert_eq!(phase(&h), Some(Phase::Probing), "its cooldown (10 s) ended early");
}

#[test]
fn a_prefix_index_is_created_at_the_first_answered_poll_and_not_read_again() {
    let answer_reads = |extra: &str| {
        let (c, h, mut p) = first_round(extra);
        let key = Keys::of(&c).prefix_index(&c.routed()[0].address);
        let body = br#"[{"dp_rank":0,"num_tokens":7}]"#;
        p.on_response(&c, &h, 1, &answer(200, body));
        let created = h.shared.get(&key).is_some();
        h.now.set(9_000_000 + 1000);
        p.on_tick(&c, &h);
        let token = h.calls.borrow().iter().map(|c| c.2).nth(2).unwrap();
        let reads = h.host_calls("shared_get");
        p.on_response(&c, &h, token, &answer(200, body));
        (created, h.host_calls("shared_get") - reads)
    };
    let (created, with_index) = answer_reads("");
    assert!(created, "the first answered poll creates the index");
    let (none, without) = answer_reads(r#","prefix_affinity":false"#);
    assert!(!none, "no index without prefix affinity");
    assert_eq!(with_index, without, "a later answer does not read the index");
}

#[test]
fn a_poll_round_logs_its_writes_in_one_append() {
    let (c, h, _) = first_round(r#","state_reads":"change_log""#);
    let log = crate::shared_data::changes::read(&h, &Keys::of(&c).changes()).unwrap();
    let tags: Vec<u64> = c
        .all_workers()
        .map(|w| crate::shared_data::changes::worker_tag(&Keys::of(&c).worker(&w.address)))
        .collect();
    assert_eq!(log.tags, tags, "both workers' first states, in order");
    let key = Keys::of(&c).changes();
    // Created empty (as every key is), then written once.
    assert_eq!(h.shared.writes(&key), 2, "written once");
    // Reading every state (the default on 2 workers): no log.
    let (c, h, _) = first_round("");
    assert!(h.shared.get(&Keys::of(&c).changes()).is_none());
}

/// vLLM's `/metrics` for engines of (running, waiting, KV usage, prefix
/// queries, prefix hits), with 1000 blocks of 16 tokens per engine in
/// `cache_config_info` (vLLM writes its engines' sum there).
fn vllm_metrics(engines: &[(u64, u64, f64, u64, u64)]) -> String {
    let blocks = 1000 * engines.len();
    let mut text =
        String::from("# HELP vllm:num_requests_running Number of requests in model execution batches.\n");
    for (series, value) in [
        ("vllm:num_requests_running", 0),
        ("vllm:num_requests_waiting", 1),
        ("vllm:kv_cache_usage_perc", 2),
        ("vllm:prefix_cache_queries_total", 3),
        ("vllm:prefix_cache_hits_total", 4),
    ] {
        for (e, f) in engines.iter().enumerate() {
            let v = match value {
                0 => f.0 as f64,
                1 => f.1 as f64,
                2 => f.2,
                3 => f.3 as f64,
                _ => f.4 as f64,
            };
            text.push_str(&format!("{series}{{engine=\"{e}\",model_name=\"m\"}} {v:?}\n"));
        }
        for e in 0..engines.len() {
            text.push_str(&format!(
                "vllm:cache_config_info{{block_size=\"16\",engine=\"{e}\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
            ));
        }
    }
    text
}

/// The tokens of every fresh poll on `token` as the state of worker 0 holds them.
fn answer_a(c: &Config, h: &FakeHost, p: &mut Poller, at_ms: u64, body: &str) -> WorkerState {
    h.now.set(at_ms);
    h.calls.borrow_mut().clear();
    p.on_tick(c, h);
    let token = h.calls.borrow()[0].2;
    h.now.set(at_ms + 5);
    p.on_response(c, h, token, &answer(200, body.as_bytes()));
    read_worker_states(c, h)[0].clone().unwrap()
}

#[test]
fn vllm_workers_are_polled_on_metrics_and_their_figures_become_tokens() {
    use crate::config::QueueMeasure;
    use crate::worker_state::UNSIZED_REQUEST_TOKENS;
    let (c, h, mut p) = first_round(r#","engine":"vllm""#);
    {
        let calls = h.calls.borrow();
        assert_eq!(header(&calls, 0, ":path"), "/metrics");
        assert_eq!(header(&calls, 0, "accept"), "text/plain");
        assert!(
            calls[0].1.iter().all(|(k, _)| k != "accept-encoding"),
            "no compressed answers"
        );
    }
    let body = vllm_metrics(&[(3, 2, 0.5, 1000, 0), (0, 0, 0.0, 0, 0)]);
    p.on_response(&c, &h, 1, &answer(200, body.as_bytes()));
    let a = read_worker_states(&c, &h)[0].clone().unwrap();
    // 2000 blocks of 16 for two engines: 16000 tokens each, half of it in use.
    assert_eq!(a.polled_tokens(0), Some(8000 + 2 * UNSIZED_REQUEST_TOKENS));
    assert_eq!(a.polled_tokens(1), Some(0));
    assert_eq!(
        (a.prefill.capacity(0), a.prefill.used(0)),
        (Some(16_000), Some(8000))
    );
    assert_eq!(h.gauge_value("dprank.tokens.a.rank_0"), Some(8000 + 2048));
    // Requests routed here set the mean request: 500 tokens.
    shared_data::update_worker(&c, &h, 0, IfMissing::Skip, |s| s.add(0, 1, 500).map(|_| ()));
    // The counters grew by 1000 queries, 750 hits: a waiting request is
    // expected a quarter uncached.
    let body = vllm_metrics(&[(3, 2, 0.5, 2000, 750), (0, 0, 0.0, 0, 0)]);
    let a = answer_a(&c, &h, &mut p, 9_001_000, &body);
    assert_eq!(a.polled_tokens(0), Some(8000 + 2 * 500));
    assert_eq!(a.prefill.queued(0, QueueMeasure::Polled).tokens, 250);
    assert_eq!(a.prefill.queued(0, QueueMeasure::Polled).requests, 2);
    // The memory is the worker's: another poller carries on from it.
    let mut other = Poller::new(1);
    let body = vllm_metrics(&[(3, 4, 0.5, 3000, 1750), (0, 0, 0.0, 0, 0)]);
    let a = answer_a(&c, &h, &mut other, 9_002_000, &body);
    // Over the window: (1000 x 0.936 + 1000) queries, (750 x 0.936 + 1000)
    // hits: 12% of 4 x 500 uncached (a first read would know no rate: 2000).
    assert_eq!(a.prefill.queued(0, QueueMeasure::Polled).tokens, 242);
}

#[test]
fn hostile_metrics_answers_change_only_the_workers_freshness() {
    let (c, h, mut p) = first_round(r#","engine":"vllm""#);
    let good = vllm_metrics(&[(1, 0, 0.25, 10, 5), (2, 1, 0.5, 10, 5)]);
    p.on_response(&c, &h, 1, &answer(200, good.as_bytes()));
    let before = read_worker_states(&c, &h)[0].clone().unwrap();
    let huge = "#".repeat(9 << 20) + "\n";
    let hostile: Vec<(&str, String)> = vec![
        ("html", "<html><body>502 Bad Gateway</body></html>\n".into()),
        ("truncated", good[..good.len() / 2].to_string()),
        ("huge", huge),
        ("wrong labels", good.replace("engine=\"1\"", "engine=\"01\"")),
        ("NaN", good.replace("} 0.5\n", "} NaN\n")),
        ("empty", String::new()),
    ];
    for (round, (what, body)) in hostile.iter().enumerate() {
        let at = 9_000_000 + 1000 * (round as u64 + 1);
        let after = answer_a(&c, &h, &mut p, at, body);
        assert_eq!(after.snapshot_seq, before.snapshot_seq, "{what}");
        assert_eq!(after.polled_tokens(0), before.polled_tokens(0), "{what}");
        assert_eq!(after.polled_tokens(1), before.polled_tokens(1), "{what}");
        assert_eq!(
            after.source, before.source,
            "{what}: the memory waits for a good answer"
        );
        assert!(!after.unreachable, "{what}");
    }
    assert_eq!(h.counter("dprank.report_refused.a"), 1, "wrong labels");
    assert_eq!(h.counter("dprank.poll_failed.a"), 5);
    assert_eq!(h.counter("dprank.poll_ok.a"), 1);
}

#[test]
fn an_answer_the_proxy_will_not_hand_over_is_a_failed_poll_that_keeps_the_snapshot() {
    let (c, h, mut p) = first_round("");
    let good = br#"[{"dp_rank":0,"num_tokens":7},{"dp_rank":1,"num_tokens":3}]"#;
    p.on_response(&c, &h, 1, &answer(200, good));
    let tokens = |h: &FakeHost| {
        read_worker_states(&c, h)[0]
            .as_ref()
            .map(|s| (s.polled_tokens(0), s.polled_tokens(1), s.snapshot_seq))
    };
    let kept = tokens(&h);
    assert!(kept.is_some());
    h.now.set(h.now.get() + c.poll_interval_ms);
    h.calls.borrow_mut().clear();
    p.on_tick(&c, &h);
    let token = h.calls.borrow()[0].2;
    let why = CalloutError::Unreadable("headers", crate::host::HostError::BAD_ARGUMENT);
    p.on_response(&c, &h, token, &Err(why));
    assert_eq!(h.counter("dprank.poll_failed.a"), 1);
    assert_eq!(tokens(&h), kept, "the last good snapshot stays");
    assert!(why.to_string().contains("BadArgument"));
}

#[test]
fn a_worker_with_a_port_per_rank_is_polled_port_by_port_and_read_whole() {
    let c = Config::from_json(
        br#"{"workers":[{"address":"127.0.0.1:30000","name":"node","dp_size":2,"rank_ports":true}],"poll_cluster":"p"}"#,
    )
    .unwrap();
    let h = FakeHost::default();
    h.now.set(9_000_000);
    let mut p = Poller::new(0);
    p.on_tick(&c, &h);
    let calls = h.calls.borrow().clone();
    let ports: Vec<&str> = (0..calls.len())
        .map(|i| header(&calls, i, ":authority"))
        .collect();
    assert_eq!(ports, ["127.0.0.1:30000", "127.0.0.1:30001"]);
    // Each port reports its own rank, by its global number (a second node: 4, 5).
    p.on_response(
        &c,
        &h,
        calls[1].2,
        &answer(200, br#"{"loads":[{"dp_rank":5,"num_tokens":20}]}"#),
    );
    assert!(
        read_worker_states(&c, &h)[0]
            .as_ref()
            .is_none_or(|s| s.snapshot_seq == 0),
        "one port alone is no report"
    );
    p.on_response(
        &c,
        &h,
        calls[0].2,
        &answer(200, br#"{"loads":[{"dp_rank":4,"num_tokens":10}]}"#),
    );
    let state = read_worker_states(&c, &h)[0].clone().unwrap();
    assert_eq!(
        (state.first_rank, state.polled_tokens(0), state.polled_tokens(1)),
        (4, Some(10), Some(20))
    );
    assert_eq!(h.counter("dprank.poll_ok.node"), 1);
    // A port that fails fails the poll: the snapshot stays.
    h.now.set(9_000_000 + c.poll_interval_ms);
    h.calls.borrow_mut().clear();
    p.on_tick(&c, &h);
    let calls = h.calls.borrow().clone();
    p.on_response(
        &c,
        &h,
        calls[0].2,
        &answer(200, br#"{"loads":[{"dp_rank":4,"num_tokens":99}]}"#),
    );
    p.on_response(&c, &h, calls[1].2, &Err(CalloutError::NoResponse));
    assert_eq!(h.counter("dprank.poll_failed.node"), 1);
    assert_eq!(
        read_worker_states(&c, &h)[0].as_ref().unwrap().polled_tokens(0),
        Some(10)
    );
    // Ports that disagree on the numbering are a failed poll too.
    h.now.set(9_000_000 + 2 * c.poll_interval_ms);
    h.calls.borrow_mut().clear();
    p.on_tick(&c, &h);
    let calls = h.calls.borrow().clone();
    p.on_response(
        &c,
        &h,
        calls[0].2,
        &answer(200, br#"{"loads":[{"dp_rank":0,"num_tokens":1}]}"#),
    );
    p.on_response(
        &c,
        &h,
        calls[1].2,
        &answer(200, br#"{"loads":[{"dp_rank":5,"num_tokens":2}]}"#),
    );
    assert_eq!(h.counter("dprank.poll_failed.node"), 2);
}
