//! vLLM mode (`--engine vllm`, sim/README.md "vLLM mode"): the scheduler
//! in virtual time (token budget, chunked prefill, block-granular prefix
//! hits, eviction of free cached blocks least recently freed first,
//! preemption by recompute), the internal balancer's choices, the rank
//! header and its 400, and `/metrics` as dprank's own reader reads it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{client, get, get_json, post, start};
use dprank_sim::engine::cost::{DecodeWork, PrefillWork};
use dprank_sim::offline::{Fleet, Prompt, Report, Request};
use dprank_sim::{CostPreset, Dispatch, EngineKind, RankHeader, SimConfig, VllmVersion};
use reqwest::StatusCode;

/// One dense-model vLLM server: engines step on their own, no tokenizer
/// time, 16-token blocks.
fn vllm(dp: usize) -> SimConfig {
    SimConfig {
        engine: EngineKind::Vllm,
        cost_model: CostPreset::Dense8b,
        dp_size: Some(dp),
        tokenizer_delay_us: 0.0,
        tokenizer_us_per_token: 0.0,
        ..SimConfig::default()
    }
}

fn tokens(range: std::ops::Range<u32>) -> Prompt {
    Prompt::Tokens(range.collect())
}

fn first_token(reports: &[Report], req: u64) -> &Report {
    reports
        .iter()
        .find(|r| r.req == req && !r.finished)
        .unwrap_or_else(|| panic!("no first token for {req}"))
}

fn micros(seconds: f64) -> u64 {
    (seconds * 1e6).round() as u64
}

#[test]
fn a_step_serves_decodes_first_and_chunks_prompts_into_the_budget_left() {
    let config = SimConfig {
        max_num_batched_tokens: 1000,
        ..vllm(1)
    };
    let cost = config.cost();
    let prefill = |chunks: &[(u64, u64)]| {
        let mut work = PrefillWork::default();
        for &(context, new) in chunks {
            work.add(context, new);
        }
        work
    };
    let decode = |kv| DecodeWork {
        seqs: 1,
        kv_tokens: kv,
    };
    let mut fleet = Fleet::new(config, 1).unwrap();
    let a = fleet
        .submit(0.0, 0, Request::new(tokens(0..100), 10).answer_after(10))
        .unwrap();
    // Step 1: A's prompt alone; B arrives during it.
    let step1 = cost.mixed_us(prefill(&[(0, 100)]), DecodeWork::default());
    let b = fleet
        .submit(
            (step1 - 1) as f64 / 1e6,
            0,
            Request::new(tokens(10_000..13_000), 1).answer_after(1),
        )
        .unwrap();
    let reports = fleet.run_to_end();
    assert_eq!(micros(first_token(&reports, a).at), step1);
    // Then each step decodes A first and gives B's prompt the 999 tokens
    // left of the budget, then its last 3.
    let steps: u64 = [(0, 999), (999, 999), (1998, 999), (2997, 3)]
        .iter()
        .zip(100..)
        .map(|(&(context, new), kv)| cost.mixed_us(prefill(&[(context, new)]), decode(kv)))
        .sum();
    assert_eq!(micros(first_token(&reports, b).at), step1 + steps);
}

#[test]
fn prefix_hits_are_whole_blocks_of_the_prompt_but_its_last_token() {
    let mut fleet = Fleet::new(vllm(1), 1).unwrap();
    fleet
        .submit(0.0, 0, Request::new(tokens(0..100), 1).answer_after(1))
        .unwrap();
    fleet.run_to_end();
    // 50 shared tokens: 3 whole blocks of 16.
    let mut shared: Vec<u32> = (0..50).collect();
    shared.extend(1000..1050);
    let b = fleet
        .submit(1.0, 0, Request::new(Prompt::Tokens(shared), 1).answer_after(1))
        .unwrap();
    // The same 100 tokens: 99 may hit, so 6 whole blocks.
    let c = fleet
        .submit(2.0, 0, Request::new(tokens(0..100), 1).answer_after(1))
        .unwrap();
    let reports = fleet.run_to_end();
    assert_eq!(first_token(&reports, b).cached_tokens, 48);
    assert_eq!(first_token(&reports, c).cached_tokens, 96);
    let stats = fleet.engine_stats(0)[0];
    assert_eq!((stats.prefix_queries, stats.prefix_hits), (300, 144));
    assert_eq!((stats.running, stats.waiting), (0, 0));
    assert_eq!(stats.kv_usage, 0.0);
}

#[test]
fn free_cached_blocks_are_evicted_least_recently_freed_first_tails_before_heads() {
    // 20 blocks of 16 tokens.
    let config = SimConfig {
        kv_capacity: Some(320),
        ..vllm(1)
    };
    let mut fleet = Fleet::new(config, 1).unwrap();
    let a: Vec<u32> = (0..96).collect();
    let b: Vec<u32> = (500..596).collect();
    fleet
        .submit(0.0, 0, Request::new(Prompt::Tokens(a.clone()), 1).answer_after(1))
        .unwrap();
    fleet.run_to_end();
    fleet
        .submit(1.0, 0, Request::new(Prompt::Tokens(b.clone()), 1).answer_after(1))
        .unwrap();
    fleet.run_to_end();
    assert_eq!(fleet.engine().cached_prefix(0, 0, &a), 80);
    assert_eq!(fleet.engine().cached_prefix(0, 0, &b), 80);
    // 10 blocks: the 8 never used, then A's last two (A was freed before B,
    // tail first).
    fleet
        .submit(2.0, 0, Request::new(tokens(900..1060), 1).answer_after(1))
        .unwrap();
    fleet.run_to_end();
    assert_eq!(fleet.engine().cached_prefix(0, 0, &a), 64);
    assert_eq!(fleet.engine().cached_prefix(0, 0, &b), 80);
}

#[test]
fn a_request_without_blocks_preempts_the_latest_admitted_which_recomputes() {
    // 10 blocks; two requests that need 9 each by their end.
    let config = SimConfig {
        kv_capacity: Some(160),
        ..vllm(1)
    };
    let mut fleet = Fleet::new(config, 1).unwrap();
    let a = fleet
        .submit(0.0, 0, Request::new(tokens(0..64), 70).answer_after(70))
        .unwrap();
    let b = fleet
        .submit(0.0, 0, Request::new(tokens(100..164), 70).answer_after(70))
        .unwrap();
    let reports = fleet.run_to_end();
    let retractions = fleet.retractions().to_vec();
    assert!(!retractions.is_empty());
    assert!(retractions.iter().all(|(req, _)| *req == b), "{retractions:?}");
    let done = |req| reports.iter().find(|r| r.req == req && r.finished).unwrap();
    assert_eq!(done(a).completion_tokens, 70);
    assert_eq!(done(b).completion_tokens, 70);
    assert!(done(a).at < done(b).at);
    let stats = fleet.engine_stats(0)[0];
    assert_eq!(stats.preemptions, retractions.len() as u64);
    assert!(fleet.metrics(0).contains(&format!(
        "vllm:num_preemptions_total{{engine=\"0\",model_name=\"sim-model\"}} {}.0\n",
        retractions.len()
    )));
}

fn ranks_of(fleet: &mut Fleet, times: &[f64]) -> Vec<usize> {
    let ids: Vec<u64> = times
        .iter()
        .map(|t| {
            fleet
                .submit(*t, 0, Request::new(tokens(0..20), 1).answer_after(1))
                .unwrap()
        })
        .collect();
    let reports = fleet.run_to_end();
    ids.iter().map(|id| first_token(&reports, *id).rank).collect()
}

#[test]
fn the_balancer_of_a_dense_0_14_server_sees_only_its_own_picks() {
    // Dense engines report nothing to the coordinator in 0.14: the balancer
    // spreads by its own picks, from engine 0, and forgets them when the
    // coordinator publishes its zeros every 5 s.
    let mut fleet = Fleet::new(vllm(4), 1).unwrap();
    let picks = ranks_of(&mut fleet, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(picks, vec![0, 1, 2, 3, 0, 0, 1, 2]);
}

#[test]
fn the_balancer_of_an_moe_0_14_server_scores_waiting_four_times_running() {
    let config = SimConfig {
        lockstep: Some(true),
        ..vllm(3)
    };
    let mut fleet = Fleet::new(config, 1).unwrap();
    // Engine 0 runs two long answers, engine 1 one.
    for rank in [0, 0, 1] {
        fleet
            .submit(0.0, 0, Request::new(tokens(0..20), 5000).on_rank(rank))
            .unwrap();
    }
    fleet.run_until(1.0);
    // Scores 2, 1 and 0: engine 2.
    let first = fleet
        .submit(1.0, 0, Request::new(tokens(50..70), 1).answer_after(1))
        .unwrap();
    // The next one, before the counts are published again: its own pick
    // counts as waiting on engine 2 (4), engine 1's running (1) is less.
    let second = fleet
        .submit(1.001, 0, Request::new(tokens(80..100), 1).answer_after(1))
        .unwrap();
    let reports = fleet.run_until(2.0);
    assert_eq!(first_token(&reports, first).rank, 2);
    assert_eq!(first_token(&reports, second).rank, 1);
}

#[test]
fn the_0_34_balancer_rotates_its_start_and_counts_requests_in_flight() {
    let config = SimConfig {
        vllm_version: VllmVersion::V0_34,
        api_server_count: Some(1),
        ..vllm(3)
    };
    let mut fleet = Fleet::new(config, 1).unwrap();
    let picks = ranks_of(&mut fleet, &[0.0, 1.0, 2.0, 3.0, 4.0]);
    assert_eq!(picks, vec![0, 1, 2, 0, 1]);
    // A long request pinned on engine 1 keeps it busy: rotation skips it.
    let config = SimConfig {
        vllm_version: VllmVersion::V0_34,
        api_server_count: Some(1),
        ..vllm(2)
    };
    let mut fleet = Fleet::new(config, 1).unwrap();
    fleet
        .submit(0.0, 0, Request::new(tokens(0..20), 5000).on_rank(1))
        .unwrap();
    let picks = ranks_of(&mut fleet, &[1.0, 2.0]);
    assert_eq!(picks, vec![0, 0]);
}

#[test]
fn the_clairvoyant_chooser_places_a_shared_prompt_where_it_is_cached() {
    let config = SimConfig {
        dispatch: Some(Dispatch::Oracle),
        ..vllm(4)
    };
    let mut fleet = Fleet::new(config, 2).unwrap();
    let long: Vec<u32> = (0..4000).collect();
    fleet
        .submit(
            0.0,
            0,
            Request::new(Prompt::Tokens(long.clone()), 1)
                .answer_after(1)
                .on_rank(2),
        )
        .unwrap();
    fleet.run_to_end();
    let mut again = long.clone();
    again.extend(9000..9010);
    let id = fleet
        .submit(1.0, 0, Request::new(Prompt::Tokens(again), 1).answer_after(1))
        .unwrap();
    let reports = fleet.run_to_end();
    let first = first_token(&reports, id);
    assert_eq!((first.worker, first.rank), (0, 2));
    assert_eq!(first.cached_tokens, 4000);
}

#[tokio::test]
async fn the_rank_header_pins_an_engine_and_an_out_of_range_one_is_a_400() {
    let mut config = vllm(2);
    config.time_scale = 50.0;
    let server = start(config).await;
    let body = r#"{"model":"m","prompt":"hello world","max_tokens":2}"#;
    for (value, rank) in [("1", 1), (" +1 ", 1), ("0", 0), ("0_0", 0)] {
        let reply = client()
            .post(format!("{}/v1/completions", server.url()))
            .header("X-Data-Parallel-Rank", value)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), StatusCode::OK, "{value:?}");
        assert_eq!(
            reply.headers()["x-sim-dp-rank"],
            rank.to_string().as_str(),
            "{value:?}"
        );
    }
    // Not an integer: no rank, the balancer picks (no error).
    for value in ["one", "1.0", "1__0", "", "_1"] {
        let reply = client()
            .post(format!("{}/v1/chat/completions", server.url()))
            .header("x-data-parallel-rank", value)
            .body(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), StatusCode::OK, "{value:?}");
    }
    for stream in [false, true] {
        let reply = client()
            .post(format!("{}/v1/completions", server.url()))
            .header("x-data-parallel-rank", "2")
            .body(format!(r#"{{"prompt":"hi","max_tokens":1,"stream":{stream}}}"#))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), StatusCode::BAD_REQUEST);
        let error: serde_json::Value = serde_json::from_str(&reply.text().await.unwrap()).unwrap();
        assert_eq!(
            error["error"]["message"],
            "data_parallel_rank 2 is out of range [0, 2)."
        );
        assert_eq!(error["error"]["type"], "BadRequestError");
    }
    // The records say which engine served each request.
    let records = get_json(&server, "/_sim/requests").await;
    assert_eq!(records[0]["rank"], 1);
    // SGLang's endpoints are not there.
    for path in ["/get_load", "/v1/loads", "/server_info"] {
        assert_eq!(get(&server, path).await.status, StatusCode::NOT_FOUND, "{path}");
    }
    assert_eq!(
        post(&server, "/generate", r#"{"text":"a"}"#).await.status,
        StatusCode::NOT_FOUND
    );
    let models = get_json(&server, "/v1/models").await;
    assert_eq!(models["data"][0]["owned_by"], "vllm");
}

#[tokio::test]
async fn vllm_0_34_refuses_a_streamed_out_of_range_rank_inside_the_stream_and_ignore_mode_never_pins() {
    let mut config = vllm(2);
    config.time_scale = 50.0;
    config.vllm_version = VllmVersion::V0_34;
    let server = start(config).await;
    let reply = client()
        .post(format!("{}/v1/chat/completions", server.url()))
        .header("x-data-parallel-rank", "-1")
        .body(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"stream":true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::OK);
    let text = reply.text().await.unwrap();
    assert!(
        text.contains("data_parallel_rank -1 is out of range [0, 2)."),
        "{text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let reply = client()
        .post(format!("{}/v1/completions", server.url()))
        .header("x-data-parallel-rank", "7")
        .body(r#"{"prompt":"hi","max_tokens":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::BAD_REQUEST);

    // 0.12 and 0.13 parse the header and drop it: the balancer picks, and
    // an out-of-range value is no error.
    let mut config = vllm(2);
    config.time_scale = 50.0;
    config.rank_header = RankHeader::Ignore;
    let server = start(config).await;
    let mut served = Vec::new();
    for _ in 0..4 {
        let reply = client()
            .post(format!("{}/v1/completions", server.url()))
            .header("x-data-parallel-rank", "1")
            .body(r#"{"prompt":"hi","max_tokens":1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), StatusCode::OK);
        served.push(reply.headers()["x-sim-dp-rank"].to_str().unwrap().to_string());
    }
    assert!(served.iter().any(|rank| rank == "0"), "{served:?}");
    let reply = client()
        .post(format!("{}/v1/completions", server.url()))
        .header("x-data-parallel-rank", "9")
        .body(r#"{"prompt":"hi","max_tokens":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), StatusCode::OK);
}

#[tokio::test]
async fn metrics_read_by_dprank_s_own_reader_match_the_engines() {
    let mut config = vllm(3);
    config.time_scale = 20.0;
    config.model = "org/Model-8B".into();
    config.enable_cache_report = true;
    let server = start(config).await;
    let prompt = common::distinct_text(300, 1);
    let body = format!(r#"{{"prompt":"{prompt}","max_tokens":1}}"#);
    for _ in 0..2 {
        let reply = client()
            .post(format!("{}/v1/completions", server.url()))
            .header("x-data-parallel-rank", "2")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), StatusCode::OK);
        let usage: serde_json::Value = serde_json::from_str(&reply.text().await.unwrap()).unwrap();
        // vLLM reports the details only when something was cached.
        let details = &usage["usage"]["prompt_tokens_details"];
        assert!(
            details.is_null() || details["cached_tokens"].as_u64().unwrap() > 0,
            "{usage}"
        );
    }
    let reply = get(&server, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let report = dprank::load::vllm::parse_vllm_metrics(reply.text.as_bytes(), None).unwrap();
    assert_eq!(report.model_name, "org/Model-8B");
    assert_eq!(report.engines.len(), 3);
    assert_eq!(report.skipped_lines, 0);
    let engine = report.engines[2];
    assert_eq!((engine.running, engine.waiting), (Some(0), Some(0)));
    assert_eq!(engine.kv_usage, Some(0.0));
    let queries = engine.prefix_queries.unwrap();
    let hits = engine.prefix_hits.unwrap();
    assert!(queries >= 600 && hits >= 288, "{queries} {hits}");
    assert_eq!(report.engines[0].prefix_queries, Some(0));
    // Faults garble what they say, and the reader refuses it.
    for (fault, refused) in [("wrong_labels", true), ("wrong_dp_size", false), ("nan", false)] {
        common::control(&server, &format!(r#"{{"load_fault":"{fault}"}}"#)).await;
        let text = get(&server, "/metrics").await.text;
        let read = dprank::load::vllm::parse_vllm_metrics(text.as_bytes(), None);
        assert_eq!(read.is_err(), refused, "{fault}: {read:?}");
        if fault == "wrong_dp_size" {
            assert_eq!(read.as_ref().unwrap().engines.len(), 5);
        }
        if fault == "nan" {
            assert_eq!(read.as_ref().unwrap().engines[0].kv_usage, None);
        }
    }
    common::control(&server, r#"{"load_fault":"none"}"#).await;
    let counters = get_json(&server, "/_sim/counters").await;
    assert!(counters["load_requests"]["/metrics"].as_u64().unwrap() >= 4);
}

#[tokio::test]
async fn an_sglang_server_refuses_the_exposition_faults() {
    let server = start(common::fast_config()).await;
    let reply = post(&server, "/_sim/control", r#"{"load_fault":"nan"}"#).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
}

#[test]
fn vllm_mode_refuses_sglang_only_settings() {
    let bad = [
        SimConfig {
            dispatch: Some(Dispatch::TotalTokens),
            ..vllm(2)
        },
        SimConfig {
            role: dprank_sim::Role::Prefill,
            ..vllm(2)
        },
        SimConfig {
            block_size: Some(0),
            ..vllm(2)
        },
    ];
    for config in bad {
        assert!(config.validate().is_err(), "{config:?}");
    }
    let sglang = SimConfig {
        dispatch: Some(Dispatch::Vllm),
        ..SimConfig::default()
    };
    assert!(sglang.validate().is_err());
    assert!(vllm(2).validate().is_ok());
}

#[test]
fn the_readme_describes_vllm_mode_with_the_sources_it_follows() {
    let readme = include_str!("../README.md");
    let section = readme
        .split("\n## vLLM mode")
        .nth(1)
        .expect("sim/README.md has a \"## vLLM mode\" section");
    for source in [
        "vllm/v1/core/sched/scheduler.py",
        "vllm/v1/core/kv_cache_manager.py",
        "vllm/v1/core/block_pool.py",
        "vllm/v1/engine/core_client.py",
        "vllm/v1/engine/coordinator.py",
        "vllm/v1/metrics/loggers.py",
        "serving_engine.py",
        "arg_utils.py",
        "--engine vllm",
        "--vllm-version",
        "--block-size",
        "--max-num-batched-tokens",
    ] {
        assert!(
            section.contains(source),
            "the vLLM mode section should name {source}"
        );
    }
}
