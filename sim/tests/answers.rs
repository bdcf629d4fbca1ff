//! Answers that end at their own length (the simulated EOS), given out of
//! band, while admission reserves from the client's cap.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use dprank_sim::answers::{tag_letters, tag_text};
use dprank_sim::offline::{Fleet, Prompt, Report, Request};
use dprank_sim::{CostPreset, SimConfig};
use reqwest::StatusCode;
use serde_json::{json, Value};

fn at(reports: &[Report], req: u64, finished: bool) -> &Report {
    reports
        .iter()
        .find(|report| report.req == req && report.finished == finished)
        .unwrap_or_else(|| panic!("no report for {req}: {reports:?}"))
}

/// One rank with room for one large cap at a time, no tokenizer time.
fn small_rank() -> SimConfig {
    SimConfig {
        cost_model: CostPreset::Legacy,
        dp_size: Some(1),
        kv_capacity: Some(3000),
        tokenizer_delay_us: 0.0,
        tokenizer_us_per_token: 0.0,
        ..SimConfig::default()
    }
}

/// Two requests arriving together, answers of 5 tokens, with `cap`: their
/// first tokens and finishes.
fn two_requests(cap: u64) -> [(f64, f64, u64); 2] {
    let mut fleet = Fleet::new(small_rank(), 1).unwrap();
    let ids: Vec<u64> = (0..2)
        .map(|salt| {
            let prompt = Prompt::Text(distinct_text(100, salt));
            fleet
                .submit(0.0, 0, Request::new(prompt, cap).answer_after(5))
                .unwrap()
        })
        .collect();
    let reports = fleet.run_to_end();
    [0, 1].map(|i| {
        let finish = at(&reports, ids[i], true);
        (
            at(&reports, ids[i], false).at,
            finish.at,
            finish.completion_tokens,
        )
    })
}

#[test]
fn answers_end_at_their_length_and_admission_reserves_the_cap() {
    // A cap of 5: the second is admitted at the next step (the first's
    // running reservation is 4 x new_token_ratio).
    let tight = two_requests(5);
    assert!(tight[1].0 < tight[0].1, "{tight:?}");
    // A cap of 2800: the first takes 100 + 2800 of the 3000 tokens and
    // holds 2799 x 0.21 of them while it runs, so the second waits for it
    // to finish, though both answers are 5 tokens long.
    let capped = two_requests(2800);
    assert!(capped[1].0 >= capped[0].1, "{capped:?}");
    assert_eq!((capped[0].2, capped[1].2), (5, 5));
    assert_eq!((tight[0].2, tight[1].2), (5, 5));
    // An answer longer than the cap is cut at the cap.
    let mut fleet = Fleet::new(small_rank(), 1).unwrap();
    let id = fleet
        .submit(
            0.0,
            0,
            Request::new(Prompt::Text("hi".into()), 3).answer_after(50),
        )
        .unwrap();
    assert_eq!(at(&fleet.run_to_end(), id, true).completion_tokens, 3);
}

async fn stream(server: &dprank_sim::SimServer, path: &str, body: Value) -> Vec<Value> {
    let mut response = client()
        .post(format!("{}{path}", server.url()))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut text = String::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    text.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect()
}

#[tokio::test]
async fn tagged_prompts_stop_at_the_length_given_out_of_band() {
    let server = start(fast_config()).await;
    let lengths = json!({"lengths": {tag_letters(11): 3, tag_letters(12): 4}});
    let reply = post(&server, "/_sim/answers", &lengths.to_string()).await;
    assert_eq!(reply.json(), json!({"tags": 2}));
    // /generate: three tokens, ended by the stop token, though 50 were allowed.
    let body = json!({"text": format!("a prompt{}", tag_text(11)),
                      "sampling_params": {"max_new_tokens": 50}, "stream": true});
    let events = stream(&server, "/generate", body).await;
    assert_eq!(events.len(), 3);
    assert_eq!(events[2]["meta_info"]["completion_tokens"], 3);
    assert_eq!(events[2]["meta_info"]["finish_reason"]["type"], "stop");
    // Chat: the newest user message's tag decides, not an earlier turn's.
    let body = json!({"messages": [
        {"role": "user", "content": format!("first{}", tag_text(11))},
        {"role": "assistant", "content": " the quick brown"},
        {"role": "user", "content": format!("second{}", tag_text(12))}],
        "max_tokens": 50, "stream": true});
    let events = stream(&server, "/v1/chat/completions", body).await;
    assert_eq!(events.len(), 4);
    assert_eq!(events[3]["choices"][0]["finish_reason"], "stop");
    // An unknown tag, or none: the answer runs to the cap.
    let body = json!({"text": format!("a prompt{}", tag_text(13)),
                      "sampling_params": {"max_new_tokens": 6}, "stream": true});
    let events = stream(&server, "/generate", body).await;
    assert_eq!(events.len(), 6);
    assert_eq!(events[5]["meta_info"]["finish_reason"]["type"], "length");
    // Bad updates are refused and change nothing.
    let reply = post(&server, "/_sim/answers", r#"{"lengths": {"x": 0}}"#).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let reply = post(&server, "/_sim/answers", r#"{"nope": 1}"#).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(get_json(&server, "/_sim/answers").await, json!({"tags": 2}));
    let reply = post(&server, "/_sim/answers", r#"{"clear": true}"#).await;
    assert_eq!(reply.json(), json!({"tags": 0}));
}
