//! Prefix affinity's per-request cost: hashing a prompt into blocks, then
//! scoring every candidate with its worker's index (one shared-data read
//! per worker), then recording the prompt in the chosen worker's index.

use std::fmt::Write as _;

use dprank::body::JsonObject;
use dprank::codec;
use dprank::config::Config;
use dprank::host::memory::MemoryHost;
use dprank::prefix::index::IndexRecord;
use dprank::prefix::{PromptBlocks, RequestPrefix};
use dprank::scheduler::{choose, scored_workers, Constraint, Context, Pool};
use dprank::shared_data::{self, Keys};
use dprank::worker_state::{LoadTable, WorkerState};

use super::{time_ns, Timing, RANKS_PER_WORKER};
use crate::report::markdown_table;

/// KV tokens per rank the indexes are sized for (the simulator's default).
const CAPACITY_TOKENS: u64 = 200_000;
const PROMPT_BYTES: usize = 16 * 1024;
const NOW_MS: u64 = 1_800_000_000_000;

/// A chat body of about `bytes`: a system prompt and a question.
fn chat_body(bytes: usize) -> Vec<u8> {
    let system =
        "You answer questions about the tax code, briefly and with sources. ".repeat(bytes * 3 / 4 / 68 + 1);
    let question = "How are capital gains on inherited shares taxed when sold? ".repeat(bytes / 4 / 60 + 1);
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}],"stream":true}}"#
    )
    .into_bytes()
}

/// `workers` workers of 8 ranks, polled, each rank's index full of other
/// prompts' blocks; worker 0's rank 3 also holds this prompt's system part.
fn fleet(workers: usize, prompt: &PromptBlocks) -> Result<(Config, MemoryHost), String> {
    let list: Vec<String> = (0..workers)
        .map(|i| {
            format!(
                r#"{{"address":"127.0.1.{}:30000","dp_size":{RANKS_PER_WORKER}}}"#,
                i + 1
            )
        })
        .collect();
    let config = Config::from_json(format!(r#"{{"workers":[{}]}}"#, list.join(",")).as_bytes())
        .map_err(|e| format!("prefix fleet config: {e}"))?;
    let settings = config
        .prefix
        .clone()
        .ok_or("prefix affinity is off by default?")?;
    let host = MemoryHost::default();
    host.now.set(NOW_MS);
    let capacity = settings.capacity_blocks(Some(CAPACITY_TOKENS));
    let keys = Keys::of(&config);
    for (w, worker) in config.routed().iter().enumerate() {
        let mut state = WorkerState::default();
        let seq = state.begin_poll();
        state.apply_snapshot(seq, NOW_MS, &[Some(1000); RANKS_PER_WORKER]);
        host.shared_set_state(&keys.worker(&worker.address), &codec::encode(&state));
        let mut record = IndexRecord::empty(settings.block_bytes, NOW_MS);
        let mut seed = (w as u32 + 1).wrapping_mul(0x9E37_79B9);
        for rank in 0..RANKS_PER_WORKER {
            // Other prompts of 32 blocks each, up to the capacity.
            for _ in 0..capacity / 32 {
                let chain: Vec<u32> = (0..32)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 17;
                        seed ^= seed << 5;
                        seed
                    })
                    .collect();
                record.touch(rank, &[&chain], NOW_MS - 1000, u64::MAX, capacity);
            }
        }
        if w == 0 {
            let half: Vec<&[u32]> = prompt
                .chains
                .iter()
                .map(|c| &c.hashes[..c.hashes.len() * 3 / 4])
                .collect();
            record.touch(3, &half, NOW_MS - 10, u64::MAX, capacity);
        }
        host.shared_set_state(&keys.prefix_index(&worker.address), &codec::encode(&record));
    }
    Ok((config, host))
}

trait SetState {
    fn shared_set_state(&self, key: &str, value: &[u8]);
}

impl SetState for MemoryHost {
    fn shared_set_state(&self, key: &str, value: &[u8]) {
        let _ = self.shared.set(key, value, None);
    }
}

/// The prefix affinity rows of the selection report, and the 16 KB
/// one-worker cost (hash + score) for the verdict.
pub fn rows(batches: usize) -> Result<(String, Timing), String> {
    // Keep freed memory in the process, as a wasm VM does (its linear
    // memory never shrinks): otherwise each request's index copies are
    // page-faulted in afresh once they pass glibc's trim threshold.
    // SAFETY: mallopt only changes allocator thresholds.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
    }
    let body = chat_body(PROMPT_BYTES);
    let object = JsonObject::parse(&body).map_err(|e| format!("chat body: {e:?}"))?;
    let block_bytes = dprank::config::prefix::DEFAULT_BLOCK_BYTES;
    let prompt = PromptBlocks::of(&object, block_bytes);
    let parse = time_ns(batches, || {
        JsonObject::parse(&body).map_or(0, |o| o.fields.len() as u64)
    });
    let hash = time_ns(batches, || {
        PromptBlocks::of(&object, block_bytes).chains.len() as u64
    });
    let mut rows = Vec::new();
    let mut one_worker = None;
    for workers in [1usize, 2, 4, 8] {
        let (config, host) = fleet(workers, &prompt)?;
        let settings = config.prefix.clone().ok_or("no prefix settings")?;
        let states = shared_data::read_worker_states(&config, &host);
        let loads = LoadTable::of(&states);
        let pool = Pool {
            workers: config.routed(),
            states: &states,
            loads: &loads,
            offset: 0,
        };
        let mut tie = 0u64;
        let mut score = |prompt: PromptBlocks| {
            tie = tie.wrapping_add(1);
            let ctx = Context {
                now_ms: NOW_MS,
                stale_after_ms: u64::MAX,
                constraint: Constraint::default(),
                tie_breaker: tie,
                health: &dprank::health::NO_HEALTH,
                admit_probing: false,
                pick: config.pick,
                gateways: config.gateways,
                room: None,
                prefix: None,
            };
            // As the router does: the indexes of the workers the filters keep, then the choice.
            let mut request = RequestPrefix::new(&settings, prompt, true, 256, host.now.get());
            scored_workers(&pool, &ctx, |w| {
                request.insert(w, shared_data::read_prefix_index(&config, &host, w));
            });
            let ctx = Context {
                prefix: Some(&request),
                ..ctx
            };
            choose(&pool, &ctx).map_or(0, |c| c.cost)
        };
        let scored = time_ns(batches, || score(prompt.clone()));
        let hash_and_score = time_ns(batches, || score(PromptBlocks::of(&object, block_bytes)));
        let index_bytes = host.shared.bytes() as usize
            - states
                .iter()
                .flatten()
                .map(|s| codec::encode(s).len())
                .sum::<usize>();
        // The write: the chosen worker's index rebuilt and encoded.
        let record = time_ns(batches, || {
            let request = RequestPrefix::new(&settings, prompt.clone(), true, 256, host.now.get());
            shared_data::update_index(
                &config,
                &host,
                0,
                None,
                request.record_on(3, Some(CAPACITY_TOKENS)),
            );
            host.now
                .set(host.now.get() + 2 * dprank::prefix::index::TOUCH_AFTER_MS);
            1
        });
        host.now.set(NOW_MS);
        if workers == 1 {
            one_worker = Some(hash_and_score);
        }
        rows.push(vec![
            workers.to_string(),
            (index_bytes / workers).to_string(),
            scored.cell(),
            hash_and_score.cell(),
            record.cell(),
        ]);
    }
    let table = markdown_table(
        &[
            "workers (8 ranks each)",
            "index bytes per worker (full)",
            "score every candidate (one index read per worker), ns",
            "hash + score, ns",
            "record: rebuild and write the chosen worker's index, ns",
        ],
        &rows,
    );
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Prefix affinity on a {} KB chat body ({} blocks of {block_bytes} bytes; each rank's index full for {CAPACITY_TOKENS} KV tokens, {} blocks; reads and writes go to an in-memory host, so they include copying the index as Envoy's shared-data calls do; the body is parsed once per request whatever the rule, {} ns, and not counted). Hashing the prompt into blocks: {} ns.\n",
        body.len() / 1024,
        prompt.chains.iter().map(|c| c.hashes.len()).sum::<usize>(),
        dprank::config::Prefix::default().capacity_blocks(Some(CAPACITY_TOKENS)),
        parse.cell(),
        hash.cell(),
    );
    md.push_str(&table);
    Ok((md, one_worker.ok_or("no one-worker row")?))
}
