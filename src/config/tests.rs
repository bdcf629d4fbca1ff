use super::*;

fn parse(s: &str) -> Result<Config, ConfigError> {
    Config::from_json(s.as_bytes())
}

fn key_of(r: Result<Config, ConfigError>) -> String {
    match r {
        Err(ConfigError::Invalid { key, .. }) => key,
        other => panic!("expected an invalid key, got {other:?}"),
    }
}

#[test]
fn minimal_config_gets_documented_defaults() {
    let c = parse(r#"{"workers":[{"address":"127.0.0.1:30001"}]}"#).unwrap();
    assert_eq!(c.routed()[0].name, "127_0_0_1_30001");
    assert_eq!(c.routed()[0].endpoint(), "127.0.0.1:30001");
    assert_eq!(c.poll_cluster, "dprank_poll");
    assert_eq!(c.route_header, "x-dprank-endpoint");
    assert_eq!(c.poll_interval_ms, 1000);
    assert_eq!(c.poll_timeout_ms, 1000);
    assert_eq!(c.stale_after_ms, 3000);
    assert_eq!(c.load_endpoint, LoadEndpoint::Auto);
    assert_eq!(c.rank_field, "routed_dp_rank");
    assert_eq!(c.cost_estimate, CostEstimate::Bytes);
    assert_eq!(c.fail_mode, FailMode::Open);
    assert_eq!(c.paths, DEFAULT_PATHS);
    assert!(!c.keep_client_rank);
    assert_eq!(c.pin_header, None);
    assert!(c.poll_loads);
    assert_eq!(
        c.passive_health,
        Some(PassiveHealth {
            consecutive_failures: 5,
            cooldown_ms: 10_000,
            max_cooldown_ms: 300_000,
            probe_share: 0.05,
        })
    );
    assert_eq!(c.envoy_health, None);
    assert_eq!(c.retry_alternates, 2);
    assert_eq!(c.state_refresh_ms, 0, "every request reads every state");
    assert_eq!(c.state_reads, StateReads::Auto);
    assert_eq!(c.transport, Transport::Body);
    assert_eq!(
        c.removed_headers,
        [
            "x-dprank-endpoint",
            "x-data-parallel-rank",
            "x-override-routed-dp-rank",
            "x-override-disagg-prefill-dp-rank",
            "x-override-bootstrap-host",
            "x-override-bootstrap-port",
            "x-override-bootstrap-room"
        ]
    );
}

#[test]
fn health_and_retry_keys() {
    let c = parse(
        r#"{"workers":[{"address":"127.0.0.1:1"}],"retry_alternates":0,
            "passive_health":{"consecutive_failures":3,"cooldown_ms":2000,"max_cooldown_ms":8000,"probe_share":0.1},
            "envoy_health":{"cluster":"sglang"}}"#,
    )
    .unwrap();
    let p = c.passive_health.clone().unwrap();
    assert_eq!(
        (p.consecutive_failures, p.cooldown_ms, p.max_cooldown_ms),
        (3, 2000, 8000)
    );
    assert_eq!(p.probe_share, 0.1);
    assert_eq!(c.retry_alternates, 0);
    let e = c.envoy_health.clone().unwrap();
    assert_eq!(
        (e.cluster.as_str(), e.admin_cluster.as_str()),
        ("sglang", "dprank_admin")
    );
    assert!(c.reads_health());
    let off = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"passive_health":{"enabled":false}}"#).unwrap();
    assert_eq!(off.passive_health, None);
    assert!(!off.reads_health());
    // A long first cooldown raises the default cap with it.
    let long =
        parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"passive_health":{"cooldown_ms":600000}}"#).unwrap();
    assert_eq!(long.passive_health.unwrap().max_cooldown_ms, 600_000);
}

#[test]
fn bad_health_and_retry_keys_are_named() {
    let with = |extra: &str| parse(&format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}],{extra}}}"#));
    for (extra, key) in [
        (
            r#""passive_health":{"consecutive_failures":0}"#,
            "passive_health.consecutive_failures",
        ),
        (
            r#""passive_health":{"cooldown_ms":10}"#,
            "passive_health.cooldown_ms",
        ),
        (
            r#""passive_health":{"cooldown_ms":5000,"max_cooldown_ms":4000}"#,
            "passive_health.max_cooldown_ms",
        ),
        (
            r#""passive_health":{"probe_share":0}"#,
            "passive_health.probe_share",
        ),
        (
            r#""passive_health":{"probe_share":1.5}"#,
            "passive_health.probe_share",
        ),
        (r#""retry_alternates":17"#, "retry_alternates"),
        (r#""state_refresh_ms":1001"#, "state_refresh_ms"),
        (
            r#""state_reads":"change_log","state_refresh_ms":100"#,
            "state_refresh_ms",
        ),
        (r#""envoy_health":{"cluster":""}"#, "envoy_health"),
    ] {
        assert_eq!(key_of(with(extra)), key, "{extra}");
    }
    assert!(matches!(
        with(r#""passive_health":{"threshold":3}"#),
        Err(ConfigError::Json(e)) if e.contains("threshold")
    ));
    let discovery =
        parse(r#"{"workers_from_cluster":{"cluster":"sglang"},"envoy_health":{"cluster":"sglang"}}"#);
    assert_eq!(key_of(discovery), "envoy_health");
}

#[test]
fn full_config_is_taken_as_written() {
    let c = parse(
        r#"{"workers":[{"address":"10.0.0.1:8000","dp_size":8,"name":"a"},{"address":"[::1]:8000"}],
            "poll_cluster":"polls","route_header":"x-pick","poll_interval_ms":250,"poll_timeout_ms":200,
            "stale_after_ms":1000,"load_endpoint":"get_load","naming":"legacy","cost_estimate":"words",
            "fail_mode":"closed","paths":["/generate"],"keep_client_rank":true,"pin_header":"x-pin",
            "state_key":"fleet_a","poll_loads":false}"#,
    )
    .unwrap();
    assert_eq!(c.routed()[0].dp_size, Some(8));
    assert_eq!(c.routed()[1].endpoint(), "[::1]:8000");
    assert_eq!(c.rank_field, "data_parallel_rank");
    assert_eq!(c.poll_timeout_ms, 200);
    assert_eq!(c.fail_mode, FailMode::Closed);
    assert_eq!(c.pin_header.as_deref(), Some("x-pin"));
    assert!(!c.poll_loads);
    assert_eq!(c.rank_field_names(), vec!["data_parallel_rank", "routed_dp_rank"]);
}

#[test]
fn explicit_rank_field_wins_over_naming() {
    let c =
        parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"naming":"legacy","rank_field":"my_rank"}"#).unwrap();
    assert_eq!(
        c.rank_field_names(),
        vec!["my_rank", "routed_dp_rank", "data_parallel_rank"]
    );
}

#[test]
fn routes_path_ignores_query() {
    let c = parse(r#"{"workers":[{"address":"127.0.0.1:1"}]}"#).unwrap();
    assert!(c.routes_path("/generate?x=1"));
    assert!(!c.routes_path("/generate/x"));
}

#[test]
fn unknown_key_is_named() {
    let err = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_intervall_ms":5}"#).unwrap_err();
    assert!(err.to_string().contains("poll_intervall_ms"), "{err}");
}

#[test]
fn not_json_is_rejected() {
    assert!(matches!(parse("workers: []"), Err(ConfigError::Json(_))));
}

#[test]
fn wrong_enum_value_is_named() {
    let err = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"load_endpoint":"metrics"}"#).unwrap_err();
    assert!(err.to_string().contains("metrics"), "{err}");
}

#[test]
fn no_workers_rejected() {
    assert_eq!(key_of(parse(r#"{"workers":[]}"#)), "workers");
}

#[test]
fn hostname_address_rejected() {
    assert_eq!(
        key_of(parse(r#"{"workers":[{"address":"sglang:30000"}]}"#)),
        "workers[0].address"
    );
}

#[test]
fn duplicate_address_rejected() {
    let r = parse(r#"{"workers":[{"address":"127.0.0.1:1"},{"address":"127.0.0.1:1","name":"b"}]}"#);
    assert_eq!(key_of(r), "workers[1].address");
}

#[test]
fn duplicate_name_rejected() {
    let r =
        parse(r#"{"workers":[{"address":"127.0.0.1:1","name":"a"},{"address":"127.0.0.1:2","name":"a"}]}"#);
    assert_eq!(key_of(r), "workers[1].name");
}

#[test]
fn bad_worker_name_rejected() {
    let r = parse(r#"{"workers":[{"address":"127.0.0.1:1","name":"a.b"}]}"#);
    assert_eq!(key_of(r), "workers[0].name");
}

#[test]
fn zero_and_huge_dp_size_rejected() {
    assert_eq!(
        key_of(parse(r#"{"workers":[{"address":"127.0.0.1:1","dp_size":0}]}"#)),
        "workers[0].dp_size"
    );
    assert_eq!(
        key_of(parse(r#"{"workers":[{"address":"127.0.0.1:1","dp_size":5000}]}"#)),
        "workers[0].dp_size"
    );
}

#[test]
fn poll_timing_out_of_bounds_rejected() {
    for (keys, key) in [
        (r#""poll_interval_ms":10"#, "poll_interval_ms"),
        (
            r#""poll_interval_ms":500,"poll_timeout_ms":600"#,
            "poll_timeout_ms",
        ),
        (r#""stale_after_ms":500"#, "stale_after_ms"),
    ] {
        let r = parse(&format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}],{keys}}}"#));
        assert_eq!(key_of(r), key);
    }
}

#[test]
fn bad_rank_field_rejected() {
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"rank_field":""}"#
        )),
        "rank_field"
    );
}

#[test]
fn bad_paths_rejected() {
    assert_eq!(
        key_of(parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"paths":[]}"#)),
        "paths"
    );
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"paths":["generate"]}"#
        )),
        "paths"
    );
}

#[test]
fn bad_headers_rejected() {
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"route_header":"X-Pick"}"#
        )),
        "route_header"
    );
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"pin_header":"x-dprank-endpoint"}"#
        )),
        "pin_header"
    );
}

#[test]
fn empty_poll_cluster_rejected() {
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_cluster":""}"#
        )),
        "poll_cluster"
    );
}

#[test]
fn bad_state_key_rejected() {
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"state_key":"a.b"}"#
        )),
        "state_key"
    );
}
const PD: &str = r#""prefill_workers":[{"address":"127.0.0.1:1","name":"p0","bootstrap_port":8998},{"address":"127.0.0.1:2","name":"p1"}],"decode_workers":[{"address":"127.0.0.1:3","name":"d0"}]"#;

fn pd(extra: &str) -> Result<Config, ConfigError> {
    parse(&format!("{{{PD}{extra}}}"))
}

#[test]
fn pd_mode_current_naming() {
    let c = pd("").unwrap();
    let p = c.pd().unwrap();
    assert_eq!(c.routed()[0].name, "d0");
    assert_eq!(p.prefill[0].bootstrap_port, Some(8998));
    assert_eq!(p.prefill[1].bootstrap_port, None);
    assert_eq!(p.cluster, "dprank_prefill");
    assert_eq!(p.timeout_ms, 600_000);
    assert_eq!(
        p.prefill_body_fields,
        vec![("routed_dp_rank".to_string(), RankOf::Prefill)]
    );
    assert_eq!(
        p.decode_body_fields,
        vec![
            ("routed_dp_rank".to_string(), RankOf::Decode),
            ("disagg_prefill_dp_rank".to_string(), RankOf::Prefill)
        ]
    );
    let names: Vec<&str> = c.all_workers().map(|w| w.name.as_str()).collect();
    assert_eq!(names, vec!["d0", "p0", "p1"]);
}

#[test]
fn pd_mode_legacy_naming_sends_both_ranks_on_both_bodies() {
    let c = pd(r#","naming":"legacy""#).unwrap();
    let p = c.pd().unwrap();
    let both = vec![
        ("data_parallel_rank".to_string(), RankOf::Prefill),
        ("decode_dp_rank".to_string(), RankOf::Decode),
    ];
    assert_eq!(p.prefill_body_fields, both);
    assert_eq!(p.decode_body_fields, vec![both[1].clone(), both[0].clone()]);
}

#[test]
fn pd_mode_explicit_field_names() {
    let c = pd(r#","prefill_rank_field":"pr","decode_rank_field":"dr","decode_prefill_rank_field":"dpr","prefill_cluster":"pc","prefill_timeout_ms":5000"#)
        .unwrap();
    let p = c.pd().unwrap();
    assert_eq!(p.prefill_body_fields, vec![("pr".to_string(), RankOf::Prefill)]);
    assert_eq!(p.decode_body_fields[1], ("dpr".to_string(), RankOf::Prefill));
    assert_eq!((p.cluster.as_str(), p.timeout_ms), ("pc", 5000));
    assert!(p.field_names().contains(&"dr"));
}

#[test]
fn pd_mode_errors_name_their_key() {
    assert_eq!(key_of(pd(r#","workers":[{"address":"127.0.0.1:9"}]"#)), "workers");
    assert_eq!(
        key_of(parse(r#"{"prefill_workers":[{"address":"127.0.0.1:1"}]}"#)),
        "decode_workers"
    );
    assert_eq!(
        key_of(parse(r#"{"decode_workers":[{"address":"127.0.0.1:1"}]}"#)),
        "prefill_workers"
    );
    assert_eq!(key_of(parse("{}")), "workers");
    assert_eq!(
        key_of(parse(
            r#"{"prefill_workers":[{"address":"127.0.0.1:3"}],"decode_workers":[{"address":"127.0.0.1:3"}]}"#
        )),
        "prefill_workers[0].address"
    );
    assert_eq!(
        key_of(parse(
            r#"{"prefill_workers":[{"address":"127.0.0.1:1"}],"decode_workers":[{"address":"127.0.0.1:3","bootstrap_port":1}]}"#
        )),
        "decode_workers[0].bootstrap_port"
    );
    assert_eq!(key_of(pd(r#","rank_field":"x""#)), "rank_field");
    assert_eq!(key_of(pd(r#","prefill_timeout_ms":0"#)), "prefill_timeout_ms");
    assert_eq!(
        key_of(pd(r#","decode_rank_field":"x","decode_prefill_rank_field":"x""#)),
        "decode_prefill_rank_field"
    );
}

#[test]
fn pd_keys_rejected_in_regular_mode() {
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"prefill_cluster":"x"}"#
        )),
        "prefill_cluster"
    );
    assert_eq!(
        key_of(parse(
            r#"{"workers":[{"address":"127.0.0.1:1","bootstrap_port":8998}]}"#
        )),
        "workers[0].bootstrap_port"
    );
}

#[test]
fn workers_from_cluster() {
    let c = parse(r#"{"workers_from_cluster":{"cluster":"sglang"}}"#).unwrap();
    assert!(c.routed().is_empty());
    assert_eq!(
        c.discovery(),
        Some(&Discovery {
            cluster: "sglang".into(),
            admin_cluster: "dprank_admin".into()
        })
    );
    let c = parse(r#"{"workers_from_cluster":{"cluster":"s","admin_cluster":"a"}}"#).unwrap();
    assert_eq!(c.discovery().unwrap().admin_cluster, "a");
}

#[test]
fn workers_from_cluster_errors() {
    assert_eq!(
        key_of(parse(
            r#"{"workers_from_cluster":{"cluster":"s"},"workers":[{"address":"127.0.0.1:1"}]}"#
        )),
        "workers_from_cluster"
    );
    assert_eq!(
        key_of(parse(&format!(
            r#"{{{PD},"workers_from_cluster":{{"cluster":"s"}}}}"#
        ))),
        "workers_from_cluster"
    );
    assert_eq!(
        key_of(parse(r#"{"workers_from_cluster":{"cluster":""}}"#)),
        "workers_from_cluster"
    );
    assert!(parse(r#"{"workers_from_cluster":{"name":"s"}}"#).is_err());
}

#[test]
fn huge_poll_interval_rejected_not_overflowed() {
    let r = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":6148914691236517206}"#);
    assert_eq!(key_of(r), "poll_interval_ms");
    let c = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":3600000}"#).unwrap();
    assert_eq!(c.stale_after_ms, 3 * 3_600_000);
}

#[test]
fn field_names_needing_escapes_rejected() {
    // As they appear inside the JSON string: a control character, a quote, a backslash, nothing.
    for name in [r"rank\u0001", r#"a\"b"#, r"a\\b", ""] {
        let r = parse(&format!(
            r#"{{"workers":[{{"address":"127.0.0.1:1"}}],"rank_field":"{name}"}}"#
        ));
        assert_eq!(key_of(r), "rank_field", "{name}");
    }
    assert_eq!(
        key_of(pd(r#","decode_rank_field":"x\u001f""#)),
        "decode_rank_field"
    );
}

#[test]
fn pd_keys_rejected_with_workers_from_cluster() {
    let r = parse(r#"{"workers_from_cluster":{"cluster":"sglang"},"prefill_rank_field":"x"}"#);
    assert_eq!(key_of(r), "prefill_rank_field");
}

#[test]
fn effective_configuration_prints_as_json() {
    let c = pd(r#","poll_interval_ms":500"#).unwrap();
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["mode"]["pd"]["decode"][0]["name"], "d0");
    assert_eq!(v["mode"]["pd"]["prefill"][0]["address"], "127.0.0.1:1");
    assert_eq!(v["mode"]["pd"]["prefill"][0]["bootstrap_port"], 8998);
    assert_eq!(
        (v["poll_interval_ms"].as_u64(), v["stale_after_ms"].as_u64()),
        (Some(500), Some(1500))
    );
    let c = parse(r#"{"workers_from_cluster":{"cluster":"sglang"}}"#).unwrap();
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["mode"]["from_cluster"]["discovery"]["cluster"], "sglang");
    assert_eq!(v["fail_mode"], "open");
}

#[test]
fn prefix_affinity_is_on_by_default_with_documented_tuning() {
    let c = parse(r#"{"workers":[{"address":"127.0.0.1:1"}]}"#).unwrap();
    let p = c.prefix.unwrap();
    assert_eq!(
        (p.block_bytes, p.capacity_tokens, p.ttl_ms, p.queue),
        (512, None, 600_000, QueueMeasure::Max)
    );
    assert_eq!(
        (p.uncached_weight, p.load_weight, p.kv_weight, p.wait_weight),
        (1.0, 0.1, 1.0, 0.0)
    );
    assert_eq!((p.private_weight, p.private_after_ms), (25.0, 3000));
    assert_eq!(p.capacity_blocks(Some(200_000)), 1562);
    assert_eq!(p.capacity_blocks(None), 131_072 * 4 / 512, "unreported");
    let tuned = parse(
        r#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_block_bytes":1024,"prefix_capacity_tokens":8000,
            "prefix_ttl_ms":5000,"prefix_uncached_weight":2,"prefix_load_weight":0,"prefix_kv_weight":0.5,
            "prefix_wait_weight":300,"prefix_queue":"local","prefix_load":"slowest_rank",
            "prefix_private_weight":1}"#,
    )
    .unwrap()
    .prefix
    .unwrap();
    assert_eq!(
        (tuned.private_weight, tuned.private_after_ms),
        (1.0, 3000),
        "the default, within a TTL of 5 s"
    );
    let short = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_ttl_ms":2000}"#).unwrap();
    assert_eq!(
        short.prefix.unwrap().private_after_ms,
        2000,
        "the default stays within the TTL"
    );
    assert_eq!(
        tuned.capacity_blocks(Some(200_000)),
        8000 * 4 / 1024,
        "configured wins"
    );
    assert_eq!((tuned.queue, tuned.wait_weight), (QueueMeasure::Local, 300.0));
    assert_eq!(
        (p.load, tuned.load),
        (LoadMeasure::SlowestRankWhenUncached, LoadMeasure::SlowestRank),
        "SGLang's default: the lockstep for prompts no rank holds"
    );
    let per_rank = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load":"rank"}"#).unwrap();
    assert_eq!(per_rank.prefix.unwrap().load, LoadMeasure::Rank);
    let off = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_affinity":false}"#).unwrap();
    assert_eq!(off.prefix, None);
}

#[test]
fn prefix_keys_are_checked_and_refused_when_affinity_is_off() {
    let with = |extra: &str| parse(&format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}],{extra}}}"#));
    assert_eq!(key_of(with(r#""prefix_block_bytes":16"#)), "prefix_block_bytes");
    assert_eq!(
        key_of(with(r#""prefix_capacity_tokens":0"#)),
        "prefix_capacity_tokens"
    );
    assert_eq!(key_of(with(r#""prefix_ttl_ms":999"#)), "prefix_ttl_ms");
    assert_eq!(key_of(with(r#""prefix_ttl_ms":3600001"#)), "prefix_ttl_ms");
    assert_eq!(
        key_of(with(r#""prefix_uncached_weight":-1"#)),
        "prefix_uncached_weight"
    );
    assert_eq!(key_of(with(r#""prefix_kv_weight":1e9"#)), "prefix_kv_weight");
    assert_eq!(
        key_of(with(r#""prefix_private_weight":-3"#)),
        "prefix_private_weight"
    );
    assert_eq!(
        key_of(with(r#""prefix_private_after_ms":999"#)),
        "prefix_private_after_ms"
    );
    assert_eq!(
        key_of(with(r#""prefix_ttl_ms":60000,"prefix_private_after_ms":60001"#)),
        "prefix_private_after_ms",
        "beyond the TTL nothing is matched"
    );
    assert_eq!(
        key_of(with(r#""prefix_affinity":false,"prefix_private_after_ms":9000"#)),
        "prefix_private_after_ms"
    );
    assert!(with(r#""prefix_queue":"both""#).is_err());
    assert!(with(r#""prefix_load":"worker""#).is_err());
    assert_eq!(
        key_of(with(r#""prefix_affinity":false,"prefix_load":"slowest_rank""#)),
        "prefix_load"
    );
    assert_eq!(
        key_of(with(r#""prefix_affinity":false,"prefix_load_weight":0.5"#)),
        "prefix_load_weight"
    );
}

#[test]
fn lockstep_terms_default_to_the_tuned_values_and_are_checked() {
    use super::prefix::Lockstep;
    let with = |extra: &str| parse(&format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}],{extra}}}"#));
    let defaults = with(r#""prefix_load":"slowest_rank""#).unwrap().prefix.unwrap();
    assert_eq!(
        defaults.lockstep,
        Lockstep {
            raise_weight: 0.75,
            max_fullness: 2.0,
            running_tokens: 3000,
            horizon_weight: 0.5,
            rank_weight: 0.05,
        }
    );
    let tuned = with(
        r#""prefix_lockstep_raise_weight":1,"prefix_lockstep_max_fullness":3,"prefix_lockstep_running_tokens":0,"prefix_lockstep_horizon_weight":0,"prefix_lockstep_rank_weight":0"#,
    )
    .unwrap()
    .prefix
    .unwrap();
    assert_eq!(
        tuned.lockstep,
        Lockstep {
            raise_weight: 1.0,
            max_fullness: 3.0,
            running_tokens: 0,
            horizon_weight: 0.0,
            rank_weight: 0.0,
        },
        "under SGLang's default slowest_rank_when_uncached"
    );
    for key in [
        "prefix_lockstep_raise_weight",
        "prefix_lockstep_max_fullness",
        "prefix_lockstep_horizon_weight",
        "prefix_lockstep_rank_weight",
    ] {
        assert_eq!(key_of(with(&format!(r#""{key}":-1"#))), key);
        assert_eq!(key_of(with(&format!(r#""{key}":1e9"#))), key);
    }
    assert_eq!(
        key_of(with(r#""prefix_lockstep_running_tokens":16777217"#)),
        "prefix_lockstep_running_tokens"
    );
    // Refused where they would do nothing.
    assert_eq!(
        key_of(with(r#""prefix_load":"rank","prefix_lockstep_raise_weight":1"#)),
        "prefix_lockstep_raise_weight"
    );
    assert_eq!(
        key_of(with(r#""engine":"vllm","prefix_lockstep_running_tokens":1"#)),
        "prefix_lockstep_running_tokens",
        "vLLM's default: rank"
    );
    assert_eq!(
        key_of(with(
            r#""prefix_affinity":false,"prefix_lockstep_horizon_weight":1"#
        )),
        "prefix_lockstep_horizon_weight"
    );
}

fn regular(extra: &str) -> Result<Config, ConfigError> {
    parse(&format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}]{extra}}}"#))
}

#[test]
fn header_transport_defaults_to_both_rank_headers() {
    let c = regular(r#","rank_transport":"header""#).unwrap();
    let h = c.header_transport().unwrap();
    assert_eq!(h.rank_headers, DEFAULT_RANK_HEADERS);
    assert_eq!(h.cost_without_length, DEFAULT_COST_WITHOUT_LENGTH);
    let c = regular(
        r#","rank_transport":"header","rank_headers":["x-my-rank"],"cost_without_length":7,"pin_header":"x-pin""#,
    )
    .unwrap();
    let h = c.header_transport().unwrap();
    assert_eq!(
        (h.rank_headers.as_slice(), h.cost_without_length),
        (&["x-my-rank".to_string()][..], 7)
    );
    assert!(
        ["x-dprank-endpoint", "x-pin", "x-data-parallel-rank", "x-my-rank"]
            .iter()
            .all(|n| c.removed_headers.iter().any(|r| r == n)),
        "a configured rank header is removed from clients too: {:?}",
        c.removed_headers
    );
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["transport"]["header"]["rank_headers"][0], "x-my-rank");
    assert!(v.get("removed_headers").is_none());
    let own = |extra: &str| {
        regular(extra)
            .unwrap()
            .removed_headers
            .iter()
            .any(|n| n == "x-override-priority")
    };
    assert!(
        !own(r#","admission":{}"#),
        "a client's priority header is left alone"
    );
    assert!(
        own(r#","admission":{"server_priority":{"critical":1}}"#),
        "with server priority the gateway sets it, never the client"
    );
    assert_eq!(
        key_of(regular(
            r#","admission":{"server_priority":{"critical":1},"priority_header":"x-override-priority"}"#
        )),
        "admission.priority_header"
    );
}

#[test]
fn header_transport_refuses_what_needs_the_body() {
    let cases = [
        (
            r#","rank_transport":"header","keep_client_rank":true"#,
            "keep_client_rank",
        ),
        (
            r#","rank_transport":"header","cost_estimate":"words""#,
            "cost_estimate",
        ),
        (r#","rank_transport":"header","rank_headers":[]"#, "rank_headers"),
        (
            r#","rank_transport":"header","rank_headers":["X-Rank"]"#,
            "rank_headers",
        ),
        (
            r#","rank_transport":"header","rank_headers":["a","a"]"#,
            "rank_headers",
        ),
        (
            r#","rank_transport":"header","rank_headers":["x-dprank-endpoint"]"#,
            "rank_headers",
        ),
        (
            r#","rank_transport":"header","cost_without_length":0"#,
            "cost_without_length",
        ),
        (r#","rank_headers":["x-a"]"#, "rank_headers"),
        (
            r#","rank_transport":"body","cost_without_length":5"#,
            "cost_without_length",
        ),
    ];
    for (extra, key) in cases {
        assert_eq!(key_of(regular(extra)), key, "{extra}");
    }
    assert_eq!(
        key_of(pd(r#","rank_transport":"header""#)),
        "rank_transport",
        "PD's prefill leg carries the body"
    );
    assert!(regular(r#","rank_transport":"header","cost_estimate":"one""#).is_ok());
    assert!(regular(r#","rank_transport":"body","keep_client_rank":true"#).is_ok());
}

#[test]
fn header_transport_reads_the_body_only_under_prefix_affinity() {
    let c = regular(r#","rank_transport":"header""#).unwrap();
    assert_eq!(c.prefix, None, "off by default: the body streams through unread");
    assert!(c.decides_at_headers().is_some());
    assert_eq!(
        key_of(regular(r#","rank_transport":"header","prefix_ttl_ms":5000"#)),
        "prefix_ttl_ms"
    );
    let reads = regular(r#","rank_transport":"header","prefix_affinity":true,"prefix_ttl_ms":5000"#).unwrap();
    assert_eq!(reads.prefix.as_ref().map(|p| p.ttl_ms), Some(5000));
    assert!(reads.header_transport().is_some_and(|h| h.reads_body));
    assert!(
        reads.decides_at_headers().is_none(),
        "decided at the end of the body"
    );
    // The cost comes from the body then: words is fine, the length fallback is not.
    assert!(regular(r#","rank_transport":"header","prefix_affinity":true,"cost_estimate":"words""#).is_ok());
    assert_eq!(
        key_of(regular(
            r#","rank_transport":"header","prefix_affinity":true,"cost_without_length":5"#
        )),
        "cost_without_length"
    );
    assert!(regular(r#","rank_transport":"header","prefix_affinity":false"#).is_ok());
}

#[test]
fn state_reads_follow_the_change_log_from_the_fleet_size_auto_chooses() {
    let fleet = |workers: usize, extra: &str| {
        let list: Vec<String> = (1..=workers)
            .map(|i| format!(r#"{{"address":"10.0.0.{i}:1"}}"#))
            .collect();
        parse(&format!(r#"{{"workers":[{}]{extra}}}"#, list.join(","))).unwrap()
    };
    let below = CHANGE_LOG_MIN_WORKERS - 1;
    assert!(!fleet(below, "").reads_change_log());
    assert!(fleet(CHANGE_LOG_MIN_WORKERS, "").reads_change_log());
    assert!(
        !fleet(CHANGE_LOG_MIN_WORKERS, r#","state_refresh_ms":100"#).reads_change_log(),
        "an explicit state_refresh_ms keeps reading every state"
    );
    assert!(!fleet(CHANGE_LOG_MIN_WORKERS, r#","state_reads":"every_worker""#).reads_change_log());
    assert!(fleet(1, r#","state_reads":"change_log""#).reads_change_log());
    // A PD fleet counts both pools.
    let pd = parse(
        r#"{"prefill_workers":[{"address":"10.0.0.1:1"},{"address":"10.0.0.2:1"},{"address":"10.0.0.3:1"},{"address":"10.0.0.4:1"}],
            "decode_workers":[{"address":"10.0.1.1:1"},{"address":"10.0.1.2:1"},{"address":"10.0.1.3:1"},{"address":"10.0.1.4:1"}]}"#,
    )
    .unwrap();
    assert_eq!(
        CHANGE_LOG_MIN_WORKERS, 8,
        "the PD fleet above sits at the threshold"
    );
    assert!(pd.reads_change_log());
    assert!(matches!(
        parse(r#"{"workers":[{"address":"10.0.0.1:1"}],"state_reads":"sometimes"}"#),
        Err(ConfigError::Json(e)) if e.contains("sometimes")
    ));
}

#[test]
fn engine_vllm_puts_the_rank_in_its_header_and_reads_the_prompt() {
    assert_eq!(regular("").unwrap().engine, Engine::Sglang, "the default");
    let c = regular(r#","engine":"vllm""#).unwrap();
    assert_eq!(
        c.engine,
        Engine::Vllm {
            served_model_name: None
        }
    );
    let h = c.header_transport().unwrap();
    assert_eq!(h.rank_headers, [engine::VLLM_RANK_HEADER]);
    assert!(h.reads_body, "prefix affinity reads the prompt");
    assert!(c.decides_at_headers().is_none());
    assert_eq!(
        c.prefix,
        Some(Prefix {
            load: LoadMeasure::Rank,
            ..Prefix::default()
        }),
        "vLLM's engines step on their own: each is costed by its own tokens"
    );
    assert_eq!(c.paths, engine::VLLM_PATHS);
    assert_eq!(c.poll_interval_ms, DEFAULT_POLL_INTERVAL_MS);
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["engine"]["vllm"]["served_model_name"], serde_json::Value::Null);
    // Load only: decided from the headers, the body never read.
    let load_only = regular(r#","engine":"vllm","prefix_affinity":false,"cost_without_length":9"#).unwrap();
    assert_eq!(
        load_only.decides_at_headers().map(|h| h.cost_without_length),
        Some(9)
    );
    // The keys that change nothing for the body are accepted.
    let c = regular(
        r#","engine":"vllm","rank_transport":"header","keep_client_rank":false,"served_model_name":"Qwen/Qwen3-8B",
            "rank_headers":["x-data-parallel-rank","x-trace-rank"],"paths":["/v1/chat/completions"]"#,
    )
    .unwrap();
    assert_eq!(
        c.engine,
        Engine::Vllm {
            served_model_name: Some("Qwen/Qwen3-8B".into())
        }
    );
    assert_eq!(c.header_transport().unwrap().rank_headers.len(), 2);
    assert_eq!(c.paths, ["/v1/chat/completions"]);
}

#[test]
fn engine_vllm_refuses_every_key_that_would_send_a_body_rank_field() {
    let cases = [
        (r#","engine":"vllm","rank_transport":"body""#, "rank_transport"),
        (r#","engine":"vllm","rank_field":"rank""#, "rank_field"),
        (r#","engine":"vllm","naming":"current""#, "naming"),
        (r#","engine":"vllm","keep_client_rank":true"#, "keep_client_rank"),
        (r#","engine":"vllm","load_endpoint":"auto""#, "load_endpoint"),
        (
            r#","engine":"vllm","rank_headers":["x-override-routed-dp-rank"]"#,
            "rank_headers",
        ),
        (r#","engine":"vllm","served_model_name":"""#, "served_model_name"),
        (r#","served_model_name":"m""#, "served_model_name"),
        (
            r#","engine":"vllm","admission":{"server_priority":{"critical":1}}"#,
            "admission.server_priority",
        ),
    ];
    for (extra, key) in cases {
        let refused = regular(extra);
        assert_eq!(key_of(refused.clone()), key, "{extra}");
        let Err(ConfigError::Invalid { reason, .. }) = refused else {
            unreachable!()
        };
        if extra.contains("vllm") && key != "served_model_name" {
            assert!(reason.contains("vllm"), "{extra}: {reason}");
        }
    }
    let pd = parse(
        r#"{"engine":"vllm","prefill_workers":[{"address":"127.0.0.1:1"}],"decode_workers":[{"address":"127.0.0.1:2"}]}"#,
    );
    assert_eq!(key_of(pd), "prefill_workers");
    assert!(matches!(
        regular(r#","engine":"tgi""#),
        Err(ConfigError::Json(e)) if e.contains("tgi")
    ));
}

#[test]
fn arrays_are_not_read_as_objects_field_by_field() {
    assert!(matches!(parse(r#"[null, "model"]"#), Err(ConfigError::Json(_))));
    assert!(matches!(parse(r#""workers""#), Err(ConfigError::Json(_))));
    for (input, key) in [
        (r#"{"workers":[["127.0.0.1:1", 4]]}"#, "workers[0]"),
        (
            r#"{"workers":[{"address":"127.0.0.1:1"}],"passive_health":[false]}"#,
            "passive_health",
        ),
        (
            r#"{"workers":[{"address":"127.0.0.1:1"}],"discovery":["c"]}"#,
            "discovery",
        ),
        (
            r#"{"workers":[{"address":"127.0.0.1:1"}],"admission":[]}"#,
            "admission",
        ),
    ] {
        assert_eq!(key_of(parse(input)), key, "{input}");
    }
}
