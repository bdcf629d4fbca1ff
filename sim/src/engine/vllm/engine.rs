//! The scheduler of one vLLM engine (one data-parallel rank), as vLLM's v1
//! `Scheduler.schedule` runs it (vllm/v1/core/sched/scheduler.py, 0.14):
//!
//! - one token budget per step (`max_num_batched_tokens`) shared by every
//!   request: running requests first, in order, each taking what it still
//!   lacks (one token for a decode, the rest of a prompt for a partial
//!   prefill) up to the budget left; then, only if nothing was preempted,
//!   waiting requests first come first served while the budget, the KV
//!   blocks and `max_num_seqs` allow, a prompt longer than the budget left
//!   taking a chunk (chunked prefill);
//! - KV in blocks allocated as tokens are scheduled (nothing reserved for
//!   output to come); full blocks are cached by hash when allocated, so a
//!   later request, in this step or another, finds them;
//! - a running request that cannot get its blocks preempts the latest
//!   admitted running request (the last of the list; itself if it is the
//!   last), whose blocks are freed and which goes back to the head of the
//!   queue to compute its prompt and output again.

use std::collections::{HashMap, VecDeque};

use super::blocks::{extend_hashes, BlockId, BlockPool};
use crate::engine::cost::{DecodeWork, PrefillWork};
use crate::engine::{Event, EventKind, Micros, Params, Queued, ReqId, SeqId};
use crate::output;

/// vLLM's `request_latency_buckets` (seconds), used by
/// `vllm:request_queue_time_seconds`.
pub const QUEUE_TIME_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];

/// One engine request (a sequence).
#[derive(Debug)]
pub(crate) struct Request {
    pub id: SeqId,
    pub req: ReqId,
    pub index: usize,
    pub prompt: Vec<u32>,
    /// The client's cap.
    pub max_new: u64,
    /// Where the answer ends (its EOS, at most `max_new`).
    pub stop_at: u64,
    pub generated: u64,
    /// vLLM's `num_computed_tokens`: tokens whose KV exists or is being
    /// computed in the current step (advanced when the step ends here).
    pub computed: u64,
    /// The blocks it holds, in order.
    pub blocks: Vec<BlockId>,
    /// Of those, how many are committed to the prefix cache.
    pub committed: usize,
    /// Hashes of the full blocks of its tokens (prompt and output).
    pub hashes: Vec<u64>,
    /// Prompt tokens found cached when first scheduled (`num_cached_tokens`).
    pub cached_tokens: Option<u64>,
    /// Preempted at least once: its cache lookups no longer count in the
    /// prefix-cache counters (vLLM counts them apart).
    pub preempted: bool,
    /// The API server process whose balancer sent it (in-flight counts).
    pub client: usize,
    /// When it reached the engine, and when it was first scheduled.
    pub queued_at: Micros,
    pub scheduled_at: Option<Micros>,
    /// Uncached tokens as the clairvoyant chooser projected them.
    pub oracle_uncached: Option<u64>,
}

impl Request {
    /// Prompt and output tokens so far (`num_tokens`).
    pub fn num_tokens(&self) -> u64 {
        self.prompt.len() as u64 + self.generated
    }

    fn token(&self, index: usize) -> u32 {
        match self.prompt.get(index) {
            Some(token) => *token,
            None => output::token_id((index - self.prompt.len() + 1) as u64),
        }
    }

    /// Hashes every full block of its tokens.
    fn update_hashes(&mut self, block_size: u64) {
        let len = self.num_tokens() as usize;
        let mut hashes = std::mem::take(&mut self.hashes);
        extend_hashes(&mut hashes, block_size as usize, |i| self.token(i), len);
        self.hashes = hashes;
    }

    fn event(&self, at: Micros, kind: EventKind) -> Event {
        Event {
            req: self.req,
            seq: self.index,
            at,
            kind,
        }
    }
}

/// The counters and gauges an engine reports, as its last step left them
/// (what `/metrics` shows for it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// When they were taken (the end of a step).
    pub at: Micros,
    pub running: u64,
    pub waiting: u64,
    /// Share of the KV blocks requests hold, 0 to 1.
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache, and found (new requests
    /// only, at every admission attempt, as vLLM counts them).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub finished_abort: u64,
    /// `vllm:request_queue_time_seconds`: counts per bucket (the last one
    /// +Inf) and the sum.
    pub queue_time_counts: [u64; QUEUE_TIME_BUCKETS.len() + 1],
    pub queue_time_sum: f64,
}

/// What one step of an engine does.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepPlan {
    /// (request, tokens scheduled, tokens computed before the step).
    pub scheduled: Vec<(SeqId, u64, u64)>,
    pub prefill: PrefillWork,
    pub decode: DecodeWork,
}

/// A request that left the engine in a step (finished or aborted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Left {
    pub req: ReqId,
    pub client: usize,
}

#[derive(Debug)]
pub(crate) struct Engine {
    pub reqs: HashMap<SeqId, Request>,
    pub waiting: VecDeque<SeqId>,
    pub running: Vec<SeqId>,
    pub pool: BlockPool,
    pub plan: Option<StepPlan>,
    /// Clairvoyant dispatch: requests placed here still in the tokenizer.
    pub pending: Vec<Queued>,
    /// What the engine last reported.
    pub stats: EngineStats,
    /// The live counters.
    counters: EngineStats,
}

fn blocks_for(tokens: u64, block_size: u64) -> u64 {
    tokens.div_ceil(block_size.max(1))
}

impl Engine {
    pub fn new(params: &Params) -> Self {
        Self {
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pool: BlockPool::new(params.num_blocks),
            plan: None,
            pending: Vec::new(),
            stats: EngineStats::default(),
            counters: EngineStats::default(),
        }
    }

    pub fn enqueue(&mut self, request: Request) {
        self.waiting.push_back(request.id);
        self.reqs.insert(request.id, request);
    }

    pub fn has_work(&self) -> bool {
        !(self.waiting.is_empty() && self.running.is_empty())
    }

    /// The cached prefix a request would get now: full blocks of its
    /// tokens but the last one (whose logits must be computed), as the
    /// blocks found.
    fn cache_hit(&mut self, params: &Params, id: SeqId) -> Vec<BlockId> {
        if !params.cache_on {
            return Vec::new();
        }
        let Some(request) = self.reqs.get_mut(&id) else {
            return Vec::new();
        };
        request.update_hashes(params.block_size);
        let max_blocks = (request.num_tokens().saturating_sub(1) / params.block_size) as usize;
        request
            .hashes
            .iter()
            .take(max_blocks)
            .map_while(|hash| self.pool.lookup(*hash))
            .collect()
    }

    /// Tokens of `prompt` the cache holds in full blocks (at most all but
    /// one token): what a request with this prompt would find now.
    pub fn cached_prefix(&self, params: &Params, prompt: &[u32]) -> u64 {
        if !params.cache_on || params.block_size == 0 {
            return 0;
        }
        let mut hashes = Vec::new();
        let max = prompt.len().saturating_sub(1);
        let usable = max / params.block_size as usize * params.block_size as usize;
        extend_hashes(&mut hashes, params.block_size as usize, |i| prompt[i], usable);
        hashes.iter().map_while(|hash| self.pool.lookup(*hash)).count() as u64 * params.block_size
    }

    /// Commits the request's blocks that hold `known` full tokens to the
    /// cache (`cache_blocks`).
    fn commit(&mut self, params: &Params, id: SeqId, known: u64) {
        if !params.cache_on {
            return;
        }
        let Some(request) = self.reqs.get_mut(&id) else {
            return;
        };
        request.update_hashes(params.block_size);
        let full = ((known / params.block_size) as usize).min(request.blocks.len());
        for index in request.committed..full {
            if let Some(hash) = request.hashes.get(index) {
                self.pool.commit(request.blocks[index], *hash);
            }
        }
        request.committed = request.committed.max(full);
    }

    /// `allocate_slots` for a running request: blocks for `new` more
    /// tokens, or false if not enough are free.
    fn allocate_running(&mut self, params: &Params, id: SeqId, new: u64) -> bool {
        let Some(request) = self.reqs.get(&id) else {
            return false;
        };
        let need =
            blocks_for(request.computed + new, params.block_size).saturating_sub(request.blocks.len() as u64);
        if need > self.pool.free_blocks() {
            return false;
        }
        let mut fresh = Vec::new();
        for _ in 0..need {
            if let Some(block) = self.pool.allocate() {
                fresh.push(block);
            }
        }
        let known = match self.reqs.get_mut(&id) {
            Some(request) => {
                request.blocks.extend(fresh);
                (request.computed + new).min(request.num_tokens())
            }
            None => return false,
        };
        self.commit(params, id, known);
        true
    }

    /// `allocate_slots` for a waiting request with the cached blocks `hit`:
    /// those are taken (a free one counts against the free blocks), new
    /// ones allocated for `new` tokens after them; false if they do not fit.
    fn allocate_waiting(&mut self, params: &Params, id: SeqId, hit: &[BlockId], new: u64) -> bool {
        let hit_tokens = hit.len() as u64 * params.block_size;
        let fresh = blocks_for(hit_tokens + new, params.block_size).saturating_sub(hit.len() as u64);
        let evictable = hit
            .iter()
            .filter(|block| self.pool.ref_count(**block) == 0)
            .count() as u64;
        if fresh + evictable > self.pool.free_blocks() {
            return false;
        }
        for block in hit {
            self.pool.touch(*block);
        }
        let mut blocks = hit.to_vec();
        for _ in 0..fresh {
            if let Some(block) = self.pool.allocate() {
                blocks.push(block);
            }
        }
        let known = match self.reqs.get_mut(&id) {
            Some(request) => {
                request.blocks = blocks;
                // The hit blocks are cached already.
                request.committed = hit.len();
                (hit_tokens + new).min(request.num_tokens())
            }
            None => return false,
        };
        self.commit(params, id, known);
        true
    }

    /// Frees a request's blocks, last first (`free`).
    fn free_blocks(&mut self, id: SeqId) {
        let Some(request) = self.reqs.get_mut(&id) else {
            return;
        };
        let blocks = std::mem::take(&mut request.blocks);
        request.committed = 0;
        for block in blocks.into_iter().rev() {
            self.pool.release(block);
        }
    }

    /// `_preempt_request`: frees its blocks; it starts again from the head
    /// of the queue.
    fn preempt(&mut self, id: SeqId, now: Micros, out: &mut Vec<Event>) {
        self.free_blocks(id);
        if let Some(request) = self.reqs.get_mut(&id) {
            request.computed = 0;
            request.preempted = true;
            out.push(request.event(now, EventKind::Retracted));
        }
        self.counters.preemptions += 1;
        self.waiting.push_front(id);
    }

    /// `schedule()`: the requests of the next step and their tokens; None
    /// if there is nothing to do.
    pub fn plan_step(
        &mut self,
        params: &Params,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<(PrefillWork, DecodeWork)> {
        let mut budget = params.max_batched;
        let mut scheduled: Vec<(SeqId, u64)> = Vec::new();
        let mut preempted = false;
        let mut index = 0;
        while index < self.running.len() && budget > 0 {
            let id = self.running[index];
            let Some(request) = self.reqs.get(&id) else {
                self.running.remove(index);
                continue;
            };
            let new = request.num_tokens().saturating_sub(request.computed).min(budget);
            if new == 0 {
                index += 1;
                continue;
            }
            let mut fits = true;
            while !self.allocate_running(params, id, new) {
                let Some(victim) = self.running.pop() else {
                    fits = false;
                    break;
                };
                self.preempt(victim, now, out);
                preempted = true;
                if victim == id {
                    fits = false;
                    break;
                }
            }
            if !fits {
                break;
            }
            scheduled.push((id, new));
            budget -= new;
            index += 1;
        }
        if !preempted {
            while budget > 0 && (self.running.len() as u64) < params.max_running {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                let hit = self.cache_hit(params, id);
                let hit_tokens = hit.len() as u64 * params.block_size;
                let Some(request) = self.reqs.get(&id) else {
                    self.waiting.pop_front();
                    continue;
                };
                let total = request.num_tokens();
                if params.cache_on && !request.preempted {
                    self.counters.prefix_queries += total;
                    self.counters.prefix_hits += hit_tokens;
                }
                let new = total.saturating_sub(hit_tokens).min(budget);
                if !self.allocate_waiting(params, id, &hit, new) {
                    break;
                }
                self.waiting.pop_front();
                if let Some(request) = self.reqs.get_mut(&id) {
                    request.computed = hit_tokens;
                    request.cached_tokens.get_or_insert(hit_tokens);
                    request.scheduled_at.get_or_insert(now);
                }
                self.running.push(id);
                scheduled.push((id, new));
                budget -= new;
            }
        }
        if scheduled.is_empty() {
            self.plan = None;
            return None;
        }
        let mut plan = StepPlan::default();
        for (id, new) in scheduled {
            let Some(request) = self.reqs.get(&id) else {
                continue;
            };
            let before = request.computed;
            let decoding = new == 1 && request.generated > 0 && before + 1 == request.num_tokens();
            if decoding {
                plan.decode.seqs += 1;
                plan.decode.kv_tokens += before;
            } else {
                plan.prefill.add(before, new);
            }
            plan.scheduled.push((id, new, before));
        }
        let work = (plan.prefill, plan.decode);
        self.plan = Some(plan);
        Some(work)
    }

    /// Ends the step: computed tokens advance; a request whose tokens are
    /// all computed gets its next token; finished requests free their
    /// blocks (their cached blocks stay until reused). Returns the requests
    /// that left.
    pub fn end_step(&mut self, params: &Params, now: Micros, out: &mut Vec<Event>) -> Vec<Left> {
        let mut left = Vec::new();
        let Some(plan) = self.plan.take() else {
            self.publish(now);
            return left;
        };
        for (id, new, _) in plan.scheduled {
            let Some(request) = self.reqs.get_mut(&id) else {
                continue;
            };
            request.computed += new;
            if request.computed < request.num_tokens() {
                continue;
            }
            request.generated += 1;
            self.counters.generation_tokens += 1;
            if request.generated == 1 {
                self.counters.prompt_tokens += request.prompt.len() as u64;
            }
            let done = request.generated >= request.stop_at;
            out.push(request.event(
                now,
                EventKind::Token {
                    count: request.generated,
                    cached_tokens: request.cached_tokens.unwrap_or(0),
                    done,
                },
            ));
            if done {
                if request.generated < request.max_new {
                    self.counters.finished_stop += 1;
                } else {
                    self.counters.finished_length += 1;
                }
                let queued = request
                    .scheduled_at
                    .unwrap_or(now)
                    .saturating_sub(request.queued_at) as f64
                    / 1e6;
                let bucket = QUEUE_TIME_BUCKETS
                    .iter()
                    .position(|le| queued <= *le)
                    .unwrap_or(QUEUE_TIME_BUCKETS.len());
                self.counters.queue_time_counts[bucket] += 1;
                self.counters.queue_time_sum += queued;
                left.push(Left {
                    req: request.req,
                    client: request.client,
                });
                self.running.retain(|other| *other != id);
                self.free_blocks(id);
                self.reqs.remove(&id);
            }
        }
        let _ = params;
        self.publish(now);
        left
    }

    /// The client went away: the request leaves wherever it is.
    pub fn abort(&mut self, id: SeqId) -> Option<Left> {
        if !self.reqs.contains_key(&id) {
            return None;
        }
        self.waiting.retain(|other| *other != id);
        self.running.retain(|other| *other != id);
        if let Some(plan) = &mut self.plan {
            plan.scheduled.retain(|(other, _, _)| *other != id);
        }
        self.free_blocks(id);
        self.counters.finished_abort += 1;
        self.reqs.remove(&id).map(|request| Left {
            req: request.req,
            client: request.client,
        })
    }

    /// (waiting, running) now, as the engine would publish them.
    pub fn counts(&self) -> (u64, u64) {
        (self.waiting.len() as u64, self.running.len() as u64)
    }

    /// Takes the stats the API server's `/metrics` shows for this engine.
    pub fn publish(&mut self, now: Micros) {
        let mut stats = self.counters;
        stats.at = now;
        stats.running = self.running.len() as u64;
        stats.waiting = self.waiting.len() as u64;
        stats.kv_usage = self.pool.usage();
        self.stats = stats;
    }
}
