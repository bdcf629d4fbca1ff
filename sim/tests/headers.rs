//! Rank headers per modelled SGLang version, the override switch, cached
//! tokens in responses and oracle placement across the workers of one
//! process, through real HTTP.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use dprank_sim::{Dispatch, RankHeader, SimConfig, SimServer};
use reqwest::StatusCode;
use serde_json::{json, Value};

fn instant(rank_header: RankHeader, header_overrides: bool) -> SimConfig {
    SimConfig {
        instant: true,
        rank_header,
        header_overrides,
        ..fast_config()
    }
}

async fn post_with(server: &SimServer, path: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut request = client()
        .post(format!("{}{path}", server.url()))
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(Duration::from_secs(30));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    Reply {
        status: response.status(),
        headers: response.headers().clone(),
        text: response.text().await.unwrap(),
    }
}

fn bodies() -> [(&'static str, Value); 3] {
    [
        ("/generate", json!({"text": "x", "routed_dp_rank": 1})),
        ("/v1/completions", json!({"prompt": "x", "routed_dp_rank": 1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "routed_dp_rank": 1}),
        ),
    ]
}

#[tokio::test]
async fn the_rank_header_wins_over_the_body_on_the_endpoints_that_read_it() {
    // (mode, rank served on /generate, /v1/completions, /v1/chat/completions)
    for (mode, expected) in [
        (RankHeader::Honour, [3, 3, 3]),
        (RankHeader::Openai, [1, 3, 3]),
        (RankHeader::Ignore, [1, 1, 1]),
    ] {
        let server = start(instant(mode, false)).await;
        for ((path, body), rank) in bodies().iter().zip(expected) {
            let reply = post_with(&server, path, body, &[("X-Data-Parallel-Rank", "3")]).await;
            assert_eq!(reply.status, StatusCode::OK, "{mode:?} {path}: {}", reply.text);
            assert_eq!(reply.rank(), rank, "{mode:?} {path}");
            // A header that is not an integer is a 400 where it is read,
            // unnoticed where it is not.
            let reply = post_with(&server, path, body, &[("x-data-parallel-rank", "two")]).await;
            let expected_status = if rank == 3 {
                StatusCode::BAD_REQUEST
            } else {
                StatusCode::OK
            };
            assert_eq!(reply.status, expected_status, "{mode:?} {path}: {}", reply.text);
        }
        // Out of range is a 400 like the body field.
        let reply = post_with(
            &server,
            "/v1/completions",
            &bodies()[1].1,
            &[("x-data-parallel-rank", "4")],
        )
        .await;
        let expected_status = if mode == RankHeader::Ignore {
            StatusCode::OK
        } else {
            StatusCode::BAD_REQUEST
        };
        assert_eq!(reply.status, expected_status, "{mode:?}");
    }
}

#[tokio::test]
async fn override_headers_need_the_switch_and_win_over_the_rank_header() {
    let headers = [("x-data-parallel-rank", "3"), ("x-override-routed-dp-rank", "2")];
    let off = start(instant(RankHeader::Honour, false)).await;
    let on = start(instant(RankHeader::Honour, true)).await;
    for ((path, body), overridden) in bodies().iter().zip([true, false, true]) {
        let reply = post_with(&off, path, body, &headers).await;
        assert_eq!(reply.rank(), 3, "{path}");
        let reply = post_with(&on, path, body, &headers).await;
        assert_eq!(reply.rank(), if overridden { 2 } else { 3 }, "{path}");
    }
    let reply = post_with(
        &on,
        "/generate",
        &bodies()[0].1,
        &[("x-override-routed-dp-rank", "x")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let reply = post_with(
        &off,
        "/generate",
        &bodies()[0].1,
        &[("x-override-routed-dp-rank", "x")],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
}

#[tokio::test]
async fn cached_tokens_are_reported_in_responses() {
    for cache_report in [false, true] {
        let server = start(SimConfig {
            enable_cache_report: cache_report,
            ..fast_config()
        })
        .await;
        let text = distinct_text(300, 1);
        let generate = json!({"text": text, "sampling_params": {"max_new_tokens": 2}, "routed_dp_rank": 0});
        let first = post(&server, "/generate", &generate.to_string()).await.json();
        assert_eq!(first["meta_info"]["cached_tokens"], 0);
        let second = post(&server, "/generate", &generate.to_string()).await.json();
        assert_eq!(second["meta_info"]["cached_tokens"], 299);
        assert_eq!(second["meta_info"]["prompt_tokens"], 300);

        let chat =
            json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2, "routed_dp_rank": 1});
        post(&server, "/v1/chat/completions", &chat.to_string()).await;
        let reply = post(&server, "/v1/chat/completions", &chat.to_string())
            .await
            .json();
        let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap();
        let details = &reply["usage"]["prompt_tokens_details"];
        if cache_report {
            assert_eq!(details["cached_tokens"], prompt - 1);
        } else {
            assert!(details.is_null(), "{reply}");
        }
        // Streamed: the usage chunk carries it too.
        let mut streamed = chat.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let reply = post(&server, "/v1/chat/completions", &streamed.to_string()).await;
        let usage = reply
            .text
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .map(|data| serde_json::from_str::<Value>(data).unwrap())
            .find(|chunk| chunk["usage"].is_object())
            .unwrap();
        if cache_report {
            assert_eq!(
                usage["usage"]["prompt_tokens_details"]["cached_tokens"],
                prompt - 1
            );
        } else {
            assert!(usage["usage"]["prompt_tokens_details"].is_null());
        }
    }
}

#[tokio::test]
async fn the_oracle_places_requests_across_the_workers_of_a_process() {
    let config = Arc::new(SimConfig {
        dp_size: Some(2),
        dispatch: Some(Dispatch::Oracle),
        prefill_tokens_per_s: Some(2000.0),
        ..fast_config()
    });
    let any = "127.0.0.1:0".parse().unwrap();
    let servers = SimServer::start_fleet(config, &[(any, None), (any, None)])
        .await
        .unwrap();
    let (a, b) = (&servers[0], &servers[1]);
    // Keep both ranks of worker a busy with 4-second prefills.
    let mut busy = Vec::new();
    for rank in 0..2 {
        let url = format!("{}/generate", a.url());
        let body = json!({"text": distinct_text(8000, rank), "routed_dp_rank": rank}).to_string();
        busy.push(tokio::spawn(async move {
            let _ = client().post(url).body(body).send().await;
        }));
    }
    wait_for(Duration::from_secs(5), || async {
        let counters = get_json(a, "/_sim/counters").await;
        (counters["in_flight_per_rank"] == json!([1, 1])).then_some(())
    })
    .await;
    let reply = post(
        a,
        "/generate",
        r#"{"text":"quick one","sampling_params":{"max_new_tokens":1}}"#,
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(reply.headers["x-sim-worker"], b.addr.to_string());
    // Recorded where it arrived, counted where it was served.
    let records = get_json(a, "/_sim/requests").await;
    assert_eq!(records.as_array().unwrap().len(), 3);
    let served = get_json(b, "/_sim/counters").await["served_per_rank"].clone();
    assert_eq!(
        served
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum::<u64>(),
        1
    );
    for task in busy {
        task.abort();
    }
}
