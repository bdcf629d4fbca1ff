//! Queueing behaviour and the load reports, through real HTTP.

mod common;

use std::time::{Duration, Instant};

use common::*;
use dprank_sim::{Dispatch, SimConfig};
use reqwest::StatusCode;
use serde_json::json;

#[tokio::test]
async fn load_report_matches_what_the_model_holds() {
    // The first request is prefilled at once, then 3 s decode steps: the
    // two requests arriving meanwhile wait (one running slot), and the
    // snapshot published at the end of the step shows them.
    let server = start(SimConfig {
        dp_size: Some(2),
        kv_capacity: Some(500),
        max_running: Some(1),
        decode_step_ms: Some(3000.0),
        ..fast_config()
    })
    .await;
    let mut requests = Vec::new();
    for index in 0..3 {
        let url = format!("{}/generate", server.url());
        // Distinct prompts: no prefix-cache hits.
        let body = json!({"text": distinct_text(100, index), "sampling_params": {"max_new_tokens": 100}, "routed_dp_rank": 1})
            .to_string();
        requests.push(tokio::spawn(async move {
            client()
                .post(url)
                .body(body)
                .send()
                .await
                .map(|response| response.status())
        }));
        if index == 0 {
            // The first is prefilled (its prompt in KV, published at the
            // end of the prefill step) and decoding before the others arrive.
            wait_for(Duration::from_secs(5), || async {
                (rank_tokens(&server).await[1] == 100).then_some(())
            })
            .await;
        }
    }
    let loads = wait_for(Duration::from_secs(5), || async {
        let loads = get_json(&server, "/get_load").await;
        (loads[1]["num_reqs"] == 3 && loads[1]["num_tokens"] == 301).then_some(loads)
    })
    .await;
    // Published at the end of the first decode step: one running with
    // prompt + first token in KV, two waiting with their prompts.
    assert_eq!(
        loads,
        json!([
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0},
            {"dp_rank": 1, "num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": 301},
        ])
    );
    let v1 = get_json(&server, "/v1/loads?include=core").await;
    assert_eq!(v1["dp_rank_count"], 2);
    assert_eq!(v1["version"], "sim");
    assert!(v1["timestamp"].as_str().unwrap().starts_with("20"));
    let rank1 = &v1["loads"][1];
    assert_eq!(rank1["dp_rank"], 1);
    assert_eq!(rank1["num_running_reqs"], 1);
    assert_eq!(rank1["num_waiting_reqs"], 2);
    assert_eq!(rank1["num_total_reqs"], 3);
    assert_eq!(rank1["num_used_tokens"], 101);
    assert_eq!(rank1["num_total_tokens"], 301);
    assert_eq!(rank1["max_total_num_tokens"], 500);
    assert!((rank1["token_usage"].as_f64().unwrap() - 101.0 / 500.0).abs() < 1e-9);
    assert_eq!(v1["aggregate"]["num_used_tokens"], 101);
    assert_eq!(v1["aggregate"]["num_total_reqs"], 3);
    assert_eq!(v1["aggregate"]["max_total_num_tokens"], 1000);
    let counters = get_json(&server, "/_sim/counters").await;
    assert_eq!(counters["in_flight_per_rank"], json!([0, 3]));
    assert_eq!(counters["served_per_rank"], json!([0, 3]));
    assert!(counters["load_requests"]["/get_load"].as_u64().unwrap() >= 1);
    assert_eq!(counters["load_requests"]["/v1/loads"], 1);
    for request in requests {
        request.abort();
    }
}

#[tokio::test]
async fn a_longer_queue_means_longer_waits() {
    // One running slot: requests are served one after the other.
    let server = start(SimConfig {
        max_running: Some(1),
        decode_step_ms: Some(10.0),
        ..fast_config()
    })
    .await;
    let started = Instant::now();
    let mut requests = Vec::new();
    for _ in 0..4 {
        let url = format!("{}/generate", server.url());
        requests.push(tokio::spawn(async move {
            let body =
                json!({"text": "hello", "sampling_params": {"max_new_tokens": 5}, "routed_dp_rank": 0});
            let response = client().post(url).body(body.to_string()).send().await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            response.text().await.unwrap();
            started.elapsed()
        }));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let waiting = wait_for(Duration::from_secs(5), || async {
        let loads = get_json(&server, "/get_load").await;
        let waiting = loads[0]["num_waiting_reqs"].as_u64().unwrap();
        (waiting >= 2).then_some(waiting)
    })
    .await;
    assert!(waiting >= 2);
    let mut latencies = Vec::new();
    for request in requests {
        latencies.push(request.await.unwrap());
    }
    latencies.sort();
    // Each request takes ~4 decode steps; the last waited for three others.
    assert!(
        latencies[3] > latencies[0] * 2,
        "latencies do not grow with the queue: {latencies:?}"
    );
    assert!(latencies[3] >= Duration::from_millis(4 * 4 * 10));
}

#[tokio::test]
async fn kv_full_requests_wait_until_kv_is_freed() {
    // The old rule (full reservation, no cache): each request reserves
    // 150 + 40 tokens, the second must wait for the first to finish.
    let server = start(SimConfig {
        kv_capacity: Some(300),
        decode_step_ms: Some(20.0),
        admission: dprank_sim::Admission::ReserveFull,
        prefix_cache: dprank_sim::Toggle::Off,
        ..fast_config()
    })
    .await;
    let big = json!({"text": text_of(150), "sampling_params": {"max_new_tokens": 40}, "routed_dp_rank": 2})
        .to_string();
    let holder = {
        let url = format!("{}/generate", server.url());
        let big = big.clone();
        tokio::spawn(async move {
            client()
                .post(url)
                .body(big)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
    };
    wait_for(Duration::from_secs(5), || async {
        (get_json(&server, "/v1/loads").await["loads"][2]["num_running_reqs"] == 1).then_some(())
    })
    .await;
    let waiter = {
        let url = format!("{}/generate", server.url());
        tokio::spawn(async move {
            client()
                .post(url)
                .body(big)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
    };
    let loads = wait_for(Duration::from_secs(5), || async {
        let loads = get_json(&server, "/v1/loads").await;
        (loads["loads"][2]["num_waiting_reqs"] == 1).then_some(loads)
    })
    .await;
    assert_eq!(loads["loads"][2]["num_running_reqs"], 1);
    holder.await.unwrap();
    waiter.await.unwrap();
    let loads = get_json(&server, "/get_load").await;
    assert_eq!(loads[2]["num_reqs"], 0);
    assert_eq!(loads[2]["num_tokens"], 0);
}

#[tokio::test]
async fn streaming_yields_chunks_over_time() {
    let server = start(SimConfig {
        decode_step_ms: Some(40.0),
        ..fast_config()
    })
    .await;
    for (path, body) in [
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 5}, "stream": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 5, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true}),
        ),
    ] {
        let mut response = client()
            .post(format!("{}{path}", server.url()))
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut arrivals = Vec::new();
        let mut text = String::new();
        let started = Instant::now();
        while let Some(chunk) = response.chunk().await.unwrap() {
            arrivals.push(started.elapsed());
            text.push_str(std::str::from_utf8(&chunk).unwrap());
        }
        let events: Vec<&str> = text.split("\n\n").filter(|event| !event.is_empty()).collect();
        assert_eq!(events.len(), 6, "{path}: {text}");
        assert_eq!(*events.last().unwrap(), "data: [DONE]");
        let payloads: Vec<serde_json::Value> = events[..5]
            .iter()
            .map(|event| serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        match path {
            "/generate" => {
                assert_eq!(payloads[4]["text"], " the quick brown fox jumps");
                assert_eq!(payloads[4]["meta_info"]["completion_tokens"], 5);
            }
            "/v1/completions" => assert_eq!(payloads[1]["choices"][0]["text"], " quick"),
            _ => {
                assert_eq!(payloads[0]["choices"][0]["delta"]["role"], "assistant");
                assert_eq!(payloads[2]["choices"][0]["delta"]["content"], " brown");
                assert_eq!(payloads[4]["choices"][0]["finish_reason"], "length");
            }
        }
        // Four decode steps of 40 ms separate the first and last tokens.
        assert!(arrivals.len() >= 4, "{path}: {arrivals:?}");
        assert!(
            *arrivals.last().unwrap() >= Duration::from_millis(100),
            "{path}: {arrivals:?}"
        );
    }
}

#[tokio::test]
async fn non_streamed_shapes() {
    let server = start(fast_config()).await;
    let reply = post(
        &server,
        "/generate",
        r#"{"text":["one","one two"],"sampling_params":{"max_new_tokens":2}}"#,
    )
    .await;
    let items = reply.json();
    assert_eq!(items.as_array().unwrap().len(), 2);
    assert_eq!(items[1]["meta_info"]["prompt_tokens"], 2);
    assert_eq!(items[1]["meta_info"]["cached_tokens"], 0);
    assert_eq!(items[1]["text"], " the quick");
    let reply = post(&server, "/v1/completions", r#"{"prompt":[1,2,3],"max_tokens":3}"#).await;
    let body = reply.json();
    assert_eq!(body["choices"][0]["text"], " the quick brown");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
    );
    let reply = post(
        &server,
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":1}"#,
    )
    .await;
    let body = reply.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "m");
    assert_eq!(body["choices"][0]["message"]["content"], " the");
    // <|im_start|> user \n hi <|im_end|> \n <|im_start|> assi stant \n
    assert_eq!(body["usage"]["prompt_tokens"], 10);
    // No cache report unless --enable-cache-report.
    assert!(body["usage"].get("prompt_tokens_details").is_none());
}

#[tokio::test]
async fn prompts_larger_than_the_kv_cache_are_rejected() {
    let server = start(SimConfig {
        kv_capacity: Some(100),
        ..fast_config()
    })
    .await;
    let reply = post(&server, "/generate", &json!({"text": text_of(100)}).to_string()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("KV cache"));
    // Output is clamped to what fits an empty rank with a page to spare
    // (SGLang admits prompt + output + a page strictly below the free KV).
    let reply = post(
        &server,
        "/generate",
        &json!({"text": text_of(95), "sampling_params": {"max_new_tokens": 50}}).to_string(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["meta_info"]["completion_tokens"], 3);
}

#[tokio::test]
async fn minimum_tokens_dispatch_avoids_the_loaded_rank() {
    let server = start(SimConfig {
        dispatch: Some(Dispatch::TotalTokens),
        decode_step_ms: Some(2000.0),
        ..fast_config()
    })
    .await;
    let url = format!("{}/generate", server.url());
    let heavy = tokio::spawn(async move {
        let body =
            json!({"text": text_of(5000), "sampling_params": {"max_new_tokens": 50}, "routed_dp_rank": 0});
        let _ = client().post(url).body(body.to_string()).send().await;
    });
    wait_for(Duration::from_secs(5), || async {
        (rank_tokens(&server).await[0] > 0).then_some(())
    })
    .await;
    let mut light = Vec::new();
    for _ in 0..3 {
        let url = format!("{}/generate", server.url());
        light.push(tokio::spawn(async move {
            let body = json!({"text": "abcd", "sampling_params": {"max_new_tokens": 50}});
            let _ = client().post(url).body(body.to_string()).send().await;
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_for(Duration::from_secs(5), || async {
        let counters = get_json(&server, "/_sim/counters").await;
        (counters["served_per_rank"] == json!([1, 1, 1, 1])).then_some(())
    })
    .await;
    heavy.abort();
    for task in light {
        task.abort();
    }
}

#[tokio::test]
async fn round_robin_dispatch_cycles_through_ranks() {
    let server = start(SimConfig {
        instant: true,
        ..fast_config()
    })
    .await;
    let mut ranks = Vec::new();
    for _ in 0..5 {
        ranks.push(post(&server, "/generate", r#"{"text":"x"}"#).await.rank());
    }
    assert_eq!(ranks, vec![0, 1, 2, 3, 0]);
}

#[tokio::test]
async fn instant_mode_counts_in_flight_and_answers_at_once() {
    let server = start(SimConfig {
        instant: true,
        dp_size: Some(4),
        ..SimConfig::default()
    })
    .await;
    let started = Instant::now();
    let reply = post(
        &server,
        "/generate",
        r#"{"text":"x","sampling_params":{"max_new_tokens":4000}}"#,
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(reply.json()["meta_info"]["completion_tokens"], 4000);
    assert_eq!(rank_tokens(&server).await, vec![0, 0, 0, 0]);

    control(&server, r#"{"response_delay_ms":150}"#).await;
    let started = Instant::now();
    let reply = post(&server, "/v1/completions", r#"{"prompt":"x","stream":true}"#).await;
    assert!(started.elapsed() >= Duration::from_millis(150));
    assert!(reply.text.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn lockstep_ranks_wait_for_the_slowest() {
    // Rank 0 decodes a 100k-token batch (20 + 100 ms a step); rank 1 a tiny
    // one. Independently rank 1 would step every 20 ms; in lockstep every
    // 120 ms.
    for (lockstep, slow) in [(false, false), (true, true)] {
        let server = start(SimConfig {
            lockstep: Some(lockstep),
            decode_step_ms: Some(20.0),
            decode_step_us_per_token: Some(1.0),
            ..fast_config()
        })
        .await;
        let url = format!("{}/generate", server.url());
        let heavy = tokio::spawn(async move {
            let body = json!({"text": text_of(100_000), "sampling_params": {"max_new_tokens": 100}, "routed_dp_rank": 0});
            let _ = client().post(url).body(body.to_string()).send().await;
        });
        wait_for(Duration::from_secs(10), || async {
            (get_json(&server, "/v1/loads").await["loads"][0]["num_running_reqs"] == 1).then_some(())
        })
        .await;
        let started = Instant::now();
        let reply = post(
            &server,
            "/generate",
            r#"{"text":"x","sampling_params":{"max_new_tokens":4},"routed_dp_rank":1}"#,
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        let elapsed = started.elapsed();
        if slow {
            assert!(elapsed >= Duration::from_millis(3 * 120), "lockstep: {elapsed:?}");
        } else {
            assert!(
                elapsed < Duration::from_millis(3 * 120),
                "independent: {elapsed:?}"
            );
        }
        heavy.abort();
    }
}
