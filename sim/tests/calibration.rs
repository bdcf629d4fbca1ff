//! The cost models against the published figures they were fitted to (see
//! sim/README.md, "Step costs"): each test drives the engine in virtual
//! time through the cited scenario and checks the throughput or latency
//! the source reports, within 15%. Also: lockstep under the calibrated
//! model, and ranks that step on their own under the dense one.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeSet, HashMap};

use dprank_sim::engine::{Arrival, EventKind, Fleet, Micros};
use dprank_sim::{CostPreset, Role, SimConfig, Toggle};

const TOLERANCE: f64 = 0.15;

/// When a request got its first token and when it finished, in µs.
#[derive(Debug, Clone, Copy, Default)]
struct Timing {
    first: Micros,
    finish: Micros,
}

/// Requests (rank, prompt tokens, output tokens) all arriving at time 0 on
/// one worker, as a benchmark client sends a batch at once: no tokenizer
/// time, every request queued before the first step. Runs to the end.
fn run(config: &SimConfig, requests: &[(usize, u64, u64)]) -> Vec<Timing> {
    let config = SimConfig {
        tokenizer_delay_us: 0.0,
        tokenizer_us_per_token: 0.0,
        ..config.clone()
    };
    config.validate().unwrap();
    let mut fleet = Fleet::new(&config, 1);
    fleet.set_every_token(false);
    let mut index = HashMap::new();
    for (i, &(rank, prompt, max_new)) in requests.iter().enumerate() {
        // Distinct token ids: no two prompts share a prefix.
        let base = (i as u32) << 14;
        let submitted = fleet.submit(
            0,
            0,
            Arrival {
                prompts: vec![(0..prompt as u32).map(|t| base.wrapping_add(t)).collect()],
                max_new_tokens: max_new,
                answer_tokens: Vec::new(),
                rank: Some(rank),
                room: None,
                pretokenized: true,
                priority: None,
            },
        );
        index.insert(submitted.req, i);
    }
    fleet.dispatch_due(0);
    let mut timings = vec![Timing::default(); requests.len()];
    let mut events = Vec::new();
    let mut steps = BTreeSet::new();
    let groups = fleet.groups(0);
    let mut now = 0;
    let start = |fleet: &mut Fleet, group: usize, now: Micros, events: &mut Vec<_>| loop {
        let duration = fleet.begin_step(0, group, now, events);
        // Decode role: the KV arrives at once.
        let transfers: Vec<(u64, usize)> = events
            .iter()
            .filter(|event: &&dprank_sim::engine::Event| event.kind == EventKind::TransferStart)
            .map(|event| (event.req, event.seq))
            .collect();
        events.retain(|event| event.kind != EventKind::TransferStart);
        for (req, seq) in &transfers {
            fleet.transfer_done(now, *req, *seq, Ok(()), events);
        }
        match duration {
            Some(duration) => return Some(now + duration),
            None if transfers.is_empty() => return None,
            None => {}
        }
    };
    for group in 0..groups {
        if let Some(end) = start(&mut fleet, group, now, &mut events) {
            steps.insert((end, group));
        }
    }
    loop {
        for event in events.drain(..) {
            if let EventKind::Token { count, done, .. } = event.kind {
                let timing = &mut timings[index[&event.req]];
                if count == 1 {
                    timing.first = event.at;
                }
                if done {
                    timing.finish = event.at;
                }
            }
        }
        let Some((end, group)) = steps.pop_first() else {
            break;
        };
        now = end;
        fleet.end_step(0, group, now, &mut events);
        if let Some(end) = start(&mut fleet, group, now, &mut events) {
            steps.insert((end, group));
        }
    }
    timings
}

fn seconds(us: Micros) -> f64 {
    us as f64 / 1e6
}

fn assert_close(what: &str, simulated: f64, cited: f64) {
    let error = simulated / cited - 1.0;
    eprintln!(
        "{what}: simulated {simulated:.1}, cited {cited:.1} ({:+.1}%)",
        100.0 * error
    );
    assert!(
        error.abs() <= TOLERANCE,
        "{what}: simulated {simulated:.1} is not within 15% of the cited {cited:.1}"
    );
}

fn deepseek(role: Role) -> SimConfig {
    SimConfig {
        cost_model: CostPreset::DeepseekV3Dp8,
        role,
        prefix_cache: Toggle::Off,
        ..SimConfig::default()
    }
}

/// LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert
/// Parallelism on 96 H100 GPUs" (2025-05-05): prefill on 4 nodes (EP32),
/// 57,674 / 54,543 / 50,302 input tokens/s per node for 1K / 2K / 4K
/// prompts, 16,384 tokens per GPU per batch.
#[test]
fn deepseek_prefill_per_node_matches_sglang_at_1k_2k_and_4k_prompts() {
    let config = SimConfig {
        // 16,384 prompt tokens per rank and step.
        chunked_prefill_size: 16_384 * 8,
        max_prefill_tokens: 16_384,
        ..deepseek(Role::Prefill)
    };
    let mut previous = f64::INFINITY;
    for (prompt, cited) in [(1024u64, 57_674.0), (2048, 54_543.0), (4096, 50_302.0)] {
        let per_step = 16_384 / prompt;
        let requests: Vec<_> = (0..8 * per_step * 6)
            .map(|i| ((i % 8) as usize, prompt, 1))
            .collect();
        let timings = run(&config, &requests);
        let makespan = timings.iter().map(|t| t.finish).max().unwrap();
        let per_node = (requests.len() as u64 * prompt) as f64 / seconds(makespan);
        assert_close(
            &format!("prefill {prompt}-token prompts, tokens/s per node"),
            per_node,
            cited,
        );
        // Longer prompts cost more per token: the attention term.
        assert!(per_node < previous);
        previous = per_node;
    }
}

/// The same post: decode on 9 nodes (EP72), 22,282 output tokens/s per node
/// at 256 sequences per GPU and a KV cache length of 2,000.
#[test]
fn deepseek_decode_per_node_matches_sglang_at_256_sequences_of_2000_tokens() {
    let config = SimConfig {
        // The cited batch whole (256 x 2,050 tokens at most).
        kv_capacity: Some(560_000),
        ..deepseek(Role::Decode)
    };
    // 1,950 prompt tokens and 100 decode steps: 2,000 KV tokens per
    // sequence on average.
    let requests: Vec<_> = (0..8 * 256).map(|i| (i % 8, 1950, 101)).collect();
    let timings = run(&config, &requests);
    assert!(
        timings.iter().all(|t| t.first == 0),
        "the batch was not admitted whole"
    );
    let makespan = timings.iter().map(|t| t.finish).max().unwrap();
    let per_node = (requests.len() * 100) as f64 / seconds(makespan);
    assert_close("decode, output tokens/s per node", per_node, 22_282.0);
}

/// DeepSeek, "DeepSeek-V3/R1 Inference System Overview" (2025-03-01): each
/// H800 node ~14.8k output tokens/s during decoding, 20-22 tokens/s per
/// sequence, 4,989 KV tokens per output token on average. At 21 tokens/s
/// per sequence that is 14,800 / 8 / 21 = 88 sequences per GPU.
#[test]
fn deepseek_decode_matches_deepseeks_own_service_statistics() {
    let requests: Vec<_> = (0..8 * 88).map(|i| (i % 8, 4939, 101)).collect();
    let timings = run(&deepseek(Role::Decode), &requests);
    assert!(
        timings.iter().all(|t| t.first == 0),
        "the batch was not admitted whole"
    );
    let makespan = seconds(timings.iter().map(|t| t.finish).max().unwrap());
    assert_close(
        "decode, output tokens/s per node",
        (requests.len() * 100) as f64 / makespan,
        14_800.0,
    );
    let per_sequence = 100.0 / makespan;
    assert_close("decode, tokens/s per sequence", per_sequence, 21.0);
}

fn dense() -> SimConfig {
    SimConfig {
        cost_model: CostPreset::Dense8b,
        dp_size: Some(1),
        prefix_cache: Toggle::Off,
        ..SimConfig::default()
    }
}

/// vLLM's nightly performance benchmark (buildkite vllm/performance-benchmark
/// build 9555): Llama-3.1-8B on one H100, a batch of 8 prompts of 32 tokens,
/// 128 output tokens each: 997.542 ms mean end-to-end latency.
#[test]
fn dense_decode_latency_matches_vllm_llama_8b_on_h100() {
    let requests = vec![(0, 32, 128); 8];
    let timings = run(&dense(), &requests);
    // One prefill step for the whole batch, then 127 decode steps.
    assert!(timings.iter().all(|t| t.first == timings[0].first));
    let latency_ms = timings.iter().map(|t| t.finish).max().unwrap() as f64 / 1e3;
    assert_close("batch of 8, 32 in / 128 out, latency ms", latency_ms, 997.542);
}

/// SGLang PR #1060 (2024-08), Llama-3.1-8B-Instruct on H100:
/// `bench_serving --dataset-name random --random-input 8192 --random-output 8
/// --num-prompts 1000` (input lengths uniform in 1..=8192, all sent at
/// once): 27,670 input tokens/s.
#[test]
fn dense_prefill_throughput_matches_sglang_llama_8b_with_8k_random_prompts() {
    let mut state: u64 = 7;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    let requests: Vec<_> = (0..1000).map(|_| (0, 1 + next() % 8192, 8)).collect();
    let tokens: u64 = requests.iter().map(|(_, prompt, _)| prompt).sum();
    let timings = run(&dense(), &requests);
    let makespan = seconds(timings.iter().map(|t| t.finish).max().unwrap());
    eprintln!("{tokens} input tokens (the cited run: 4,064,944) in {makespan:.1} s (cited: 146.91 s)");
    assert_close(
        "8k random prompts, input tokens/s",
        tokens as f64 / makespan,
        27_670.0,
    );
}

/// Under DP attention a step lasts as long as the slowest rank's, an idle
/// rank waiting too: a rank decoding a tiny batch next to one prefilling a
/// long prompt decodes once per prefill step.
#[test]
fn lockstep_ranks_wait_for_the_slowest_under_the_calibrated_model() {
    let config = SimConfig {
        dp_size: Some(2),
        tokenizer_delay_us: 0.0,
        tokenizer_us_per_token: 0.0,
        ..deepseek(Role::Regular)
    };
    let cost = config.cost();
    let chunk = config.chunk_per_rank().unwrap();
    let mut fleet = Fleet::new(&config, 1);
    assert_eq!(fleet.groups(0), 1);
    let arrival = |rank, prompt: u64, max_new| Arrival {
        prompts: vec![(0..prompt as u32).map(|t| t + (rank as u32) * 100_000).collect()],
        max_new_tokens: max_new,
        answer_tokens: Vec::new(),
        rank: Some(rank),
        room: None,
        pretokenized: true,
        priority: None,
    };
    let mut out = Vec::new();
    fleet.submit(0, 0, arrival(1, 10, 50));
    fleet.dispatch_due(0);
    // Rank 1 prefills 10 tokens alone; rank 0 is idle and waits.
    let first = fleet.begin_step(0, 0, 0, &mut out).unwrap();
    let mut work = dprank_sim::engine::cost::PrefillWork::default();
    work.add(0, 10);
    assert_eq!(first, cost.prefill_us(work));
    fleet.end_step(0, 0, first, &mut out);
    // Rank 0 now gets a long prompt: chunks of `chunk` tokens.
    fleet.submit(first, 0, arrival(0, 4 * chunk, 1));
    fleet.dispatch_due(first);
    let second = fleet.begin_step(0, 0, first, &mut out).unwrap();
    let mut work = dprank_sim::engine::cost::PrefillWork::default();
    work.add(0, chunk);
    let decode = cost.decode_us(dprank_sim::engine::cost::DecodeWork {
        seqs: 1,
        kv_tokens: 11,
    });
    assert_eq!(second, cost.prefill_us(work).max(decode));
    assert!(second > decode, "the prefill chunk is the slower rank");
    fleet.end_step(0, 0, first + second, &mut out);
    // The next chunk attends to the first one: longer still.
    let third = fleet.begin_step(0, 0, first + second, &mut out).unwrap();
    let mut work = dprank_sim::engine::cost::PrefillWork::default();
    work.add(chunk, chunk);
    assert_eq!(third, cost.prefill_us(work));
    assert!(third > second);
}

#[test]
fn dense_ranks_step_on_their_own() {
    let config = SimConfig {
        cost_model: CostPreset::Dense8b,
        ..SimConfig::default()
    };
    assert!(!config.lockstep() && !config.dp_attention());
    let fleet = Fleet::new(&config, 1);
    assert_eq!(fleet.groups(0), config.dp_size());
    // Without DP attention each rank takes the server's whole chunk.
    assert_eq!(config.chunk_per_rank(), Some(8192));
    let deepseek = SimConfig::default();
    assert!(deepseek.lockstep() && deepseek.dp_attention());
    assert_eq!(Fleet::new(&deepseek, 1).groups(0), 1);
    assert_eq!(deepseek.chunk_per_rank(), Some(8192 / 8));
}
