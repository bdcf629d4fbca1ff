//! Prefix affinity through the router: where prompts sharing a prefix go,
//! how a hot prefix spills, and the index shared by several VMs.

use super::body_fields::output_budget;
use super::*;
use crate::body::JsonObject;
use crate::codec::decode_view;
use crate::host::fake::FakeHost;
use crate::host::memory::{MemoryHost, SharedData};
use crate::metrics;
use crate::prefix::index::IndexView;
use crate::prefix::PromptBlocks;
use crate::shared_data::testing::*;
use crate::shared_data::{read_worker_states, Keys};

/// Routes with a fresh copy of the states, as a VM that has not routed
/// before, through the real entry.
fn route(c: &Rc<Config>, h: &dyn Host, body: &[u8], pin: Option<&str>, tie_breaker: u64) -> Decision {
    let args = RouteArgs {
        pin,
        tie_breaker,
        class: None,
    };
    super::route(c, h, &mut StateCache::default(), Input::Body(body), &args).expect("no admission")
}

fn routed(d: Decision) -> Routed {
    match d {
        Decision::Route(r) => r,
        other => panic!("expected a route, got {other:?}"),
    }
}

/// Two workers of four ranks, every rank polled at 100 tokens.
fn equal_fleet(extra: &str) -> (Rc<Config>, FakeHost) {
    let c = config(extra);
    let h = FakeHost::default();
    h.now.set(1_000_000);
    poll(&c, &h, 0, &[100; 4]);
    poll(&c, &h, 1, &[100; 4]);
    (c, h)
}

/// A chat request: a shared system prompt of `system` bytes, then a question.
fn chat(system: usize, question: &str, stream: bool) -> Vec<u8> {
    let system = "You answer questions about the tax code. ".repeat(system / 41 + 1);
    format!(
        r#"{{"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}],"stream":{stream}}}"#
    )
    .into_bytes()
}

fn place(r: &Routed) -> (usize, u32) {
    (r.chosen.worker, r.chosen.rank.unwrap())
}

/// The request answers at once: first byte, then the end.
fn finish(c: &Rc<Config>, h: &dyn Host, r: &Routed) {
    if let Some(p) = &r.queued_prefill {
        prefill_over(c, h, p);
    }
    if let Some(t) = &r.estimate {
        give_back(c, h, t);
    }
}

#[test]
fn with_equal_loads_a_shared_prefix_sticks_to_one_rank() {
    let (c, h) = equal_fleet("");
    let first = routed(route(&c, &h, &chat(6000, "What is a deduction?", true), None, 1));
    finish(&c, &h, &first);
    for i in 0..12 {
        let r = routed(route(
            &c,
            &h,
            &chat(6000, &format!("Question {i}?"), true),
            None,
            100 + i,
        ));
        assert_eq!(place(&r), place(&first), "request {i}");
        finish(&c, &h, &r);
    }
    // Distinct prompts still spread over the equal ranks.
    let spread: std::collections::HashSet<(usize, u32)> = (0..24)
        .map(|i| {
            let body = format!(
                r#"{{"text":"{}","stream":true}}"#,
                format!("{i} unrelated ").repeat(200)
            );
            let r = routed(route(&c, &h, body.as_bytes(), None, 1000 + i));
            finish(&c, &h, &r);
            place(&r)
        })
        .collect();
    assert!(spread.len() >= 4, "{spread:?}");
}

#[test]
fn the_output_budget_comes_from_the_request() {
    let budget = |body: &str| output_budget(&JsonObject::parse(body.as_bytes()).unwrap());
    assert_eq!(
        budget(r#"{"text":"a","sampling_params":{"max_new_tokens":77}}"#),
        77
    );
    assert_eq!(budget(r#"{"messages":[],"max_tokens":12}"#), 12);
    assert_eq!(budget(r#"{"messages":[],"max_completion_tokens":9}"#), 9);
    assert_eq!(
        budget(r#"{"text":"a","sampling_params":{"max_new_tokens":100000}}"#),
        4096
    );
    assert_eq!(budget(r#"{"text":"a","max_tokens":"x"}"#), 256);
}

/// Shared-data reads one routing decision makes with a fresh copy of the
/// states (the health record and two states, then the prefix indexes it
/// reads).
fn reads(c: &Rc<Config>, h: &FakeHost, body: &[u8], pin: Option<&str>) -> u64 {
    let before = h.host_calls("shared_get");
    routed(route(c, h, body, pin, 7));
    h.host_calls("shared_get") - before
}

#[test]
fn only_the_indexes_of_workers_the_filters_keep_are_read_each_once() {
    let (c, h) = equal_fleet("");
    let body = chat(2000, "Which?", true);
    assert_eq!(reads(&c, &h, &body, None), 3 + 2, "both workers are candidates");
    assert_eq!(reads(&c, &h, &body, Some("a/1")), 3 + 1, "the pin keeps a only");
    assert_eq!(
        reads(&c, &h, &body, Some("a/9")),
        3 + 2,
        "a pin that names no rank is dropped: each index still read once"
    );
    // b's snapshot goes stale: its index is not read.
    h.now.set(h.now.get() + c.stale_after_ms + 1);
    poll(&c, &h, 0, &[100; 4]);
    assert_eq!(reads(&c, &h, &body, None), 3 + 1);
    let unhashed = br#"{"text":"","stream":true}"#;
    assert_eq!(reads(&c, &h, unhashed, None), 3, "no blocks: nothing to look up");
}

#[test]
fn off_gives_the_load_only_rule() {
    let (c, h) = equal_fleet(r#","prefix_affinity":false"#);
    let places: std::collections::HashSet<(usize, u32)> = (0..16)
        .map(|i| {
            let r = routed(route(&c, &h, &chat(6000, "Same?", true), None, i));
            assert!(r.queued_prefill.is_none());
            finish(&c, &h, &r);
            place(&r)
        })
        .collect();
    assert!(places.len() > 1, "ties spread: {places:?}");
    let index = Keys::of(&c).prefix_index(&c.routed()[0].address);
    assert!(h.shared.get(&index).is_none(), "no index is kept");
}

#[test]
fn a_hot_prefix_spills_to_a_second_rank_when_its_queue_outweighs_the_cache() {
    let (c, h) = equal_fleet("");
    let warm = routed(route(&c, &h, &chat(8000, "Warm up.", true), None, 1));
    finish(&c, &h, &warm);
    let question = "q".repeat(1600); // ~400 tokens each, the system prompt ~2000
    let burst: Vec<Routed> = (0..12)
        .map(|i| {
            routed(route(
                &c,
                &h,
                &chat(8000, &format!("{i}{question}"), true),
                None,
                10 + i,
            ))
        })
        .collect();
    let places: Vec<(usize, u32)> = burst.iter().map(place).collect();
    assert!(
        places[..2].iter().all(|p| *p == place(&warm)),
        "a short queue still beats a cold prefill: {places:?}"
    );
    let spilled: Vec<&(usize, u32)> = places.iter().filter(|p| **p != place(&warm)).collect();
    assert!(!spilled.is_empty(), "the queue grew past the prefix: {places:?}");
    let on_warm = places.iter().filter(|p| **p == place(&warm)).count();
    assert!((3..12).contains(&on_warm), "{places:?}");
    // Once the burst has started answering, the warm rank takes the prefix again.
    for r in &burst {
        finish(&c, &h, r);
    }
    let after = routed(route(&c, &h, &chat(8000, "After.", true), None, 99));
    assert!(
        place(&after) == place(&warm) || spilled.contains(&&place(&after)),
        "back on a rank holding it: {places:?} then {:?}",
        place(&after)
    );
}

#[test]
fn a_heavily_loaded_rank_loses_its_prefix_traffic() {
    let (c, h) = equal_fleet("");
    let warm = routed(route(&c, &h, &chat(6000, "Warm up.", true), None, 1));
    finish(&c, &h, &warm);
    let mut heavy = [100u64; 4];
    heavy[warm.chosen.rank.unwrap() as usize] = 1_000_000;
    h.now.set(h.now.get() + 1000);
    poll(&c, &h, warm.chosen.worker, &heavy);
    poll(&c, &h, 1 - warm.chosen.worker, &[100; 4]);
    let r = routed(route(&c, &h, &chat(6000, "Now?", true), None, 2));
    assert_ne!(place(&r), place(&warm));
}

#[test]
fn the_index_forgets_prompts_after_its_ttl() {
    // The same tie breakers with and without the warm-up's entries expired.
    // For each tie breaker: whether the request went to the warm rank.
    let after = |wait_ms: u64| -> Vec<bool> {
        (0..16)
            .map(|tie| {
                let (c, h) = equal_fleet(r#","prefix_ttl_ms":5000"#);
                let warm = routed(route(&c, &h, &chat(6000, "Warm up.", true), None, 1));
                finish(&c, &h, &warm);
                h.now.set(h.now.get() + wait_ms);
                poll(&c, &h, 0, &[100; 4]);
                poll(&c, &h, 1, &[100; 4]);
                let r = routed(route(&c, &h, &chat(6000, "Later?", true), None, 100 + tie));
                place(&r) == place(&warm)
            })
            .collect()
    };
    assert!(after(4000).iter().all(|warm| *warm), "still held before the TTL");
    let expired = after(5001);
    assert!(
        expired.iter().filter(|warm| !**warm).count() > 8,
        "after it the ties spread: {expired:?}"
    );
}

#[test]
fn the_prefill_charge_leaves_at_the_first_byte_and_the_estimate_at_the_end() {
    let (c, h) = equal_fleet(r#","prefix_queue":"local""#);
    let r = routed(route(&c, &h, &chat(4000, "Hi", true), None, 1));
    let p = r.queued_prefill.unwrap();
    let queued = |h: &FakeHost| {
        read_worker_states(&c, h)[r.chosen.worker]
            .as_ref()
            .unwrap()
            .prefill
            .queued(p.rank as usize, crate::config::QueueMeasure::Local)
    };
    assert_eq!((queued(&h).tokens, queued(&h).requests), (p.tokens, 1));
    assert!(p.tokens > 900 && p.streamed);
    prefill_over(&c, &h, &p);
    assert_eq!((queued(&h).tokens, queued(&h).requests), (0, 0));
    let states = read_worker_states(&c, &h);
    assert!(states[r.chosen.worker].as_ref().unwrap().pending_total() > 0);
    // The second time the same prompt costs only its uncached tail.
    let again = routed(route(&c, &h, &chat(4000, "Hi", false), None, 1));
    assert_eq!(place(&again), place(&r));
    let p2 = again.queued_prefill.unwrap();
    assert!(p2.tokens < 200 && !p2.streamed, "{p2:?}");
}

#[test]
fn pd_chooses_the_prefill_rank_by_prefix_and_the_decode_rank_by_load() {
    let (c, h) = pd_fleet("");
    // Equal prefill loads; the decode minimum stays d1/1.
    poll(&c, &h, 2, &[9, 9]);
    poll(&c, &h, 3, &[9, 9]);
    let pd = |tie| match route(&c, &h, &chat(6000, "PD?", true), None, tie) {
        Decision::Pd(pd) => pd,
        other => panic!("expected PD, got {other:?}"),
    };
    let first = pd(1);
    let prefill = (first.prefill.worker, first.prefill.rank);
    if let Some(p) = &first.queued_prefill {
        prefill_over(&c, &h, p);
    }
    give_back(&c, &h, first.prefill_estimate.as_ref().unwrap());
    give_back(&c, &h, first.decode_estimate.as_ref().unwrap());
    assert_eq!(
        first.decode.as_ref().map(|d| (d.worker, d.rank)),
        Some((1, Some(1)))
    );
    for tie in 2..8 {
        let next = pd(tie);
        assert_eq!((next.prefill.worker, next.prefill.rank), prefill, "tie {tie}");
        assert!(next.decode_estimate.is_some());
        give_back(&c, &h, next.prefill_estimate.as_ref().unwrap());
        give_back(&c, &h, next.decode_estimate.as_ref().unwrap());
        if let Some(p) = &next.queued_prefill {
            prefill_over(&c, &h, p);
        }
    }
    // Only the prefill pool keeps an index.
    let keys = Keys::of(&c);
    assert!(h.shared.get(&keys.prefix_index(&c.routed()[0].address)).is_none());
    assert!(h.shared.get(&keys.prefix_index(&c.routed()[1].address)).is_none());
}

#[test]
fn vms_on_two_threads_share_one_index_without_losing_a_write() {
    let c = config(r#","prefix_block_bytes":64"#);
    let shared = SharedData::default();
    let setup = MemoryHost::with_shared(shared.clone());
    setup.now.set(1_000_000);
    poll(&c, &setup, 0, &[100; 4]);
    poll(&c, &setup, 1, &[100; 4]);
    let prompt = |thread: usize, i: usize| format!("thread {thread} prompt {i} ").repeat(8);
    let routes: Vec<Vec<(usize, u32)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|thread| {
                let shared = shared.clone();
                s.spawn(move || {
                    // Each thread is a VM with its own copy of the configuration.
                    let c = &config(r#","prefix_block_bytes":64"#);
                    let h = MemoryHost::with_shared(shared);
                    h.now.set(1_000_000);
                    (0..150)
                        .map(|i| {
                            let body = format!(r#"{{"text":"{}","stream":true}}"#, prompt(thread, i));
                            let r = routed(route(c, &h, body.as_bytes(), None, (thread * 1000 + i) as u64));
                            finish(c, &h, &r);
                            place(&r)
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    // Every prompt is in the index of the rank it went to: no write was lost.
    let keys = Keys::of(&c);
    for (thread, places) in routes.iter().enumerate() {
        for (i, (worker, rank)) in places.iter().enumerate() {
            let body = format!(r#"{{"text":"{}"}}"#, prompt(thread, i));
            let blocks = PromptBlocks::of(&JsonObject::parse(body.as_bytes()).unwrap(), 64);
            let (bytes, _) = shared
                .get(&keys.prefix_index(&c.routed()[*worker].address))
                .unwrap();
            let view: IndexView = decode_view(&bytes).unwrap();
            let held = view
                .rank(*rank as usize)
                .map_or(0, |r| r.matched(&blocks.chains[0].hashes, 0));
            assert_eq!(held, blocks.chains[0].hashes.len(), "thread {thread} prompt {i}");
        }
    }
    // And every estimate and prefill charge was given back.
    let h = MemoryHost::with_shared(shared);
    for state in read_worker_states(&c, &h).iter().flatten() {
        assert_eq!(state.pending_total(), 0);
        for rank in 0..4 {
            let queued = state.prefill.queued(rank, crate::config::QueueMeasure::Local);
            assert_eq!((queued.tokens, queued.requests), (0, 0));
        }
    }
    assert_eq!(h.counter(metrics::SHARED_DATA_CONFLICTS), 0);
}
