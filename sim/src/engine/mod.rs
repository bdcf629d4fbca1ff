//! The model of SGLang servers with data-parallel ranks, free of clocks and
//! I/O: time is an argument, in simulated microseconds. The HTTP server
//! drives it in real time, `crate::offline::Fleet` in virtual time.
//!
//! A driver calls, for every group of ranks that step together,
//! `begin_step` (plan a step, get its duration), then `end_step` when the
//! duration has passed; requests enter through `submit` and reach their
//! rank's queue at `dispatch_due` once the tokenizer is done with them.

pub mod cost;
mod oracle;
pub mod radix;
mod rank;
pub mod vllm;
mod worker;

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::config::{Admission, Dispatch, Role, SimConfig, Toggle, VllmVersion, CLIP_MAX_NEW_TOKENS};
use crate::config::{MIN_NEW_TOKEN_RATIO_FACTOR, NEW_TOKEN_RATIO_DECAY_STEPS};
use cost::{CostModel, StepNoise};
pub use rank::RankSnapshot;
use rank::Seq;
pub use vllm::EngineStats;
use worker::{GroupedRanks, Worker};

/// Simulated time in microseconds.
pub type Micros = u64;
/// A request (one HTTP request; several sequences for batched input).
pub type ReqId = u64;
pub(crate) type SeqId = u64;

/// Something that happened to one sequence of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub req: ReqId,
    /// Index of the sequence in its request.
    pub seq: usize,
    pub at: Micros,
    pub kind: EventKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// The sequence now has `count` output tokens; `done` on its last.
    Token {
        count: u64,
        cached_tokens: u64,
        done: bool,
    },
    /// Sent back to the queue for lack of KV.
    Retracted,
    /// Decode role: admitted; its KV must now be fetched from the prefill.
    TransferStart,
    /// Decode role: the KV never came.
    Failed { message: String },
}

/// A request as it reaches a server.
#[derive(Debug, Clone, Default)]
pub struct Arrival {
    /// Token ids of each prompt (one per sequence).
    pub prompts: Vec<Vec<u32>>,
    /// `max_new_tokens` per sequence: the cap the client sent (clamped to
    /// fit a rank); admission reserves from it.
    pub max_new_tokens: u64,
    /// Where each sequence's answer ends (the simulated model's EOS), in
    /// prompt order, when known out of band (`crate::answers`); a missing
    /// entry runs to `max_new_tokens`.
    pub answer_tokens: Vec<Option<u64>>,
    /// The rank the request names, if any.
    pub rank: Option<usize>,
    /// The first `bootstrap_room`, for room-modulo dispatch.
    pub room: Option<u64>,
    /// Given as token ids: nothing to tokenize.
    pub pretokenized: bool,
    /// The request's `priority`, if it sent one (read only with priority
    /// scheduling on).
    pub priority: Option<i64>,
}

impl Arrival {
    /// Prompt tokens of all sequences.
    pub fn tokens(&self) -> u64 {
        self.prompts.iter().map(|prompt| prompt.len() as u64).sum()
    }

    /// Where sequence `index`'s answer ends: its known length, at most
    /// `max_new_tokens` (the client's cap cuts a longer answer), at least 1.
    pub fn stop_at(&self, index: usize) -> u64 {
        let cap = self.max_new_tokens.max(1);
        self.answer_tokens
            .get(index)
            .copied()
            .flatten()
            .map_or(cap, |answer| answer.clamp(1, cap))
    }

    /// Output tokens of all sequences, as they will really be generated.
    pub fn output_tokens(&self) -> u64 {
        (0..self.prompts.len().max(1))
            .map(|index| self.stop_at(index))
            .sum()
    }
}

/// Where a submitted request goes and when it reaches the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    pub req: ReqId,
    pub worker: usize,
    pub ready_at: Micros,
}

/// A request that has reached its rank's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dispatched {
    pub req: ReqId,
    pub worker: usize,
    pub rank: usize,
    pub group: usize,
}

/// Model constants derived once from the configuration.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub dp_size: usize,
    pub lockstep: bool,
    pub role: Role,
    pub dispatch: Dispatch,
    pub capacity: u64,
    pub page: u64,
    pub max_running: u64,
    pub chunk: Option<u64>,
    pub max_prefill: u64,
    /// `--enable-priority-scheduling`: the waiting queue in priority order,
    /// arrival order within a priority.
    pub priority_scheduling: bool,
    /// `--schedule-low-priority-values-first`.
    pub low_priority_values_first: bool,
    pub cache_on: bool,
    pub full_reservation: bool,
    pub init_ratio: f64,
    pub min_ratio: f64,
    pub ratio_decay: f64,
    pub clip: u64,
    pub cost: CostModel,
    pub noise: StepNoise,
    pub noise_seed: u64,
    /// SGLang `--enable-prefill-delayer` and its settings.
    pub prefill_delayer: bool,
    pub prefill_delayer_max_passes: u32,
    pub prefill_delayer_watermark: Option<f64>,
    /// SGLang `--enable-mixed-chunk`.
    pub mixed_chunk: bool,
    pub tokenizer_base_us: f64,
    pub tokenizer_us_per_token: f64,
    pub publish_interval: u32,
    /// vLLM mode.
    pub vllm: bool,
    pub vllm_version: VllmVersion,
    pub block_size: u64,
    pub num_blocks: u64,
    /// `max_num_batched_tokens`.
    pub max_batched: u64,
    pub api_servers: usize,
    /// Whether engines report their counts to the balancer (0.14: MoE
    /// engines only; 0.34: all).
    pub engines_report: bool,
}

impl Params {
    /// Where a request of `priority` stands in the waiting queue: higher
    /// first (0 for every request without priority scheduling, or without
    /// a priority, as SGLang's default priority value of none).
    pub fn priority_rank(&self, priority: Option<i64>) -> i64 {
        match (self.priority_scheduling, priority) {
            (true, Some(value)) if self.low_priority_values_first => value.saturating_neg(),
            (true, Some(value)) => value,
            _ => 0,
        }
    }

    fn new(config: &SimConfig) -> Self {
        let full_reservation = config.admission == Admission::ReserveFull;
        let init_ratio = if full_reservation {
            1.0
        } else {
            config.init_new_token_ratio()
        };
        let min_ratio = (init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR).min(1.0);
        Self {
            dp_size: config.dp_size(),
            lockstep: config.lockstep(),
            role: config.role,
            dispatch: config.dispatch(),
            capacity: config.kv_capacity(),
            page: config.page_size.max(1),
            max_running: config.max_running(),
            chunk: config.chunk_per_rank(),
            max_prefill: config.max_prefill_tokens,
            priority_scheduling: config.enable_priority_scheduling,
            low_priority_values_first: config.schedule_low_priority_values_first,
            // The decode side receives its KV; its cache plays no part.
            cache_on: config.prefix_cache == Toggle::On && config.role != Role::Decode,
            full_reservation,
            init_ratio,
            min_ratio,
            ratio_decay: (init_ratio - min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS,
            clip: if full_reservation {
                u64::MAX
            } else {
                CLIP_MAX_NEW_TOKENS
            },
            cost: config.cost(),
            noise: config.noise(),
            noise_seed: config.noise_seed,
            prefill_delayer: config.prefill_delayer() && config.lockstep() && !config.is_vllm(),
            prefill_delayer_max_passes: config.prefill_delayer_max_delay_passes.max(1),
            prefill_delayer_watermark: config.prefill_delayer_token_usage_low_watermark,
            mixed_chunk: config.mixed_chunk() && !config.is_vllm(),
            tokenizer_base_us: config.tokenizer_delay_us,
            tokenizer_us_per_token: config.tokenizer_us_per_token,
            publish_interval: config.load_publish_interval.max(1),
            vllm: config.is_vllm(),
            vllm_version: config.vllm_version,
            block_size: config.block_size().max(1),
            num_blocks: config.num_gpu_blocks(),
            max_batched: config.max_num_batched_tokens.max(1),
            api_servers: config.api_servers(),
            engines_report: config.vllm_version == VllmVersion::V0_34 || config.lockstep(),
        }
    }
}

/// Oracle dispatch: a request placed on a rank (or vLLM engine), still in
/// its worker's tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    pub req: ReqId,
    pub ready_at: Micros,
    pub uncached: u64,
    pub tokens: u64,
    /// The output cap, as admission reserves it.
    pub max_new: u64,
    /// The output it will really generate (the chooser is clairvoyant).
    pub output: u64,
}

#[derive(Debug)]
struct Pending {
    worker: usize,
    arrival: Arrival,
    /// Uncached tokens of each prompt as the oracle projected them.
    oracle_uncached: Vec<u64>,
}

#[derive(Debug)]
struct Placement {
    worker: usize,
    rank: Option<usize>,
    seqs: Vec<SeqId>,
    /// Sequences not yet finished or failed.
    open: usize,
}

/// The servers of a fleet: SGLang workers or vLLM servers.
#[derive(Debug)]
enum Servers {
    Sglang(Vec<Worker>),
    Vllm(Vec<vllm::worker::Worker>),
}

/// Every simulated server of one process, in one model.
#[derive(Debug)]
pub struct Fleet {
    params: Params,
    servers: Servers,
    pending: BTreeMap<(Micros, ReqId), Pending>,
    placements: HashMap<ReqId, Placement>,
    next_req: ReqId,
    next_seq: SeqId,
    every_token: bool,
    /// Oracle dispatch: arrival times of the last `RATE_WINDOW`.
    recent_arrivals: VecDeque<Micros>,
}

impl Fleet {
    pub fn new(config: &SimConfig, workers: usize) -> Self {
        let params = Params::new(config);
        let count = workers.max(1);
        let servers = if params.vllm {
            Servers::Vllm(
                (0..count)
                    .map(|index| vllm::worker::Worker::new(&params, index))
                    .collect(),
            )
        } else {
            Servers::Sglang((0..count).map(|index| Worker::new(&params, index)).collect())
        };
        Self {
            servers,
            params,
            pending: BTreeMap::new(),
            placements: HashMap::new(),
            next_req: 1,
            next_seq: 1,
            every_token: true,
            recent_arrivals: VecDeque::new(),
        }
    }

    /// The SGLang workers (none in vLLM mode).
    fn sglang(&self) -> &[Worker] {
        match &self.servers {
            Servers::Sglang(workers) => workers,
            Servers::Vllm(_) => &[],
        }
    }

    /// With false, token events are only produced for the first and the
    /// last token of each sequence (offline runs that only need those).
    pub fn set_every_token(&mut self, every: bool) {
        self.every_token = every;
    }

    pub fn workers(&self) -> usize {
        match &self.servers {
            Servers::Sglang(workers) => workers.len(),
            Servers::Vllm(workers) => workers.len(),
        }
    }

    pub fn dp_size(&self) -> usize {
        self.params.dp_size
    }

    /// Groups of ranks stepping together in a worker.
    pub fn groups(&self, worker: usize) -> usize {
        match &self.servers {
            Servers::Sglang(workers) => workers.get(worker).map_or(0, |w| w.groups.len()),
            Servers::Vllm(workers) => workers.get(worker).map_or(0, |w| w.groups.len()),
        }
    }

    pub fn group_of(&self, worker: usize, rank: usize) -> usize {
        match &self.servers {
            Servers::Sglang(workers) => workers.get(worker).map_or(0, |w| w.group_of(rank)),
            Servers::Vllm(workers) => workers.get(worker).map_or(0, |w| w.group_of(rank)),
        }
    }

    /// A request arrives at `worker` at `now`. Oracle dispatch picks its
    /// (worker, rank) at once; every request then waits for the chosen
    /// worker's tokenizer. A named rank must be below `dp_size`.
    pub fn submit(&mut self, now: Micros, worker: usize, mut arrival: Arrival) -> Submitted {
        let req = self.next_req;
        self.next_req += 1;
        let mut target = worker.min(self.workers() - 1);
        let oracle = self.params.dispatch == Dispatch::Oracle;
        if oracle {
            while self
                .recent_arrivals
                .front()
                .is_some_and(|at| *at + oracle::RATE_WINDOW < now)
            {
                self.recent_arrivals.pop_front();
            }
            self.recent_arrivals.push_back(now);
        }
        if oracle && arrival.rank.is_none() {
            let (chosen_worker, chosen_rank) = match &self.servers {
                Servers::Sglang(_) => oracle::choose(self, now, &arrival),
                Servers::Vllm(workers) => {
                    vllm::oracle::choose(&self.params, workers, &self.recent_arrivals, now, &arrival)
                }
            };
            target = chosen_worker;
            arrival.rank = Some(chosen_rank);
        }
        let params = &self.params;
        let ready_at = match &mut self.servers {
            Servers::Sglang(workers) => workers[target].tokenizer.take(params, now, &arrival),
            Servers::Vllm(workers) => workers[target].tokenizer.take(params, now, &arrival),
        };
        let mut oracle_uncached = Vec::new();
        if let (true, Some(rank)) = (oracle, arrival.rank) {
            let (uncached, pending) = match &mut self.servers {
                Servers::Sglang(workers) => match workers[target].ranks.get_mut(rank) {
                    Some(rank_state) => (
                        arrival
                            .prompts
                            .iter()
                            .map(|prompt| oracle::uncached(rank_state, prompt))
                            .collect(),
                        Some(&mut rank_state.pending),
                    ),
                    None => (Vec::new(), None),
                },
                Servers::Vllm(workers) => match workers[target].engines.get_mut(rank) {
                    Some(engine) => (
                        arrival
                            .prompts
                            .iter()
                            .map(|prompt| vllm::oracle::uncached(params, engine, prompt))
                            .collect(),
                        Some(&mut engine.pending),
                    ),
                    None => (Vec::new(), None),
                },
            };
            oracle_uncached = uncached;
            if let Some(pending) = pending {
                pending.push(Queued {
                    req,
                    ready_at,
                    uncached: oracle_uncached.iter().sum(),
                    tokens: arrival.tokens(),
                    max_new: arrival.max_new_tokens * arrival.prompts.len().max(1) as u64,
                    output: arrival.output_tokens(),
                });
            }
        }
        self.placements.insert(
            req,
            Placement {
                worker: target,
                rank: None,
                seqs: Vec::new(),
                open: arrival.prompts.len().max(1),
            },
        );
        self.pending.insert(
            (ready_at, req),
            Pending {
                worker: target,
                arrival,
                oracle_uncached,
            },
        );
        Submitted {
            req,
            worker: target,
            ready_at,
        }
    }

    /// When the next submitted request reaches its scheduler.
    pub fn next_ready(&self) -> Option<Micros> {
        self.pending.keys().next().map(|(at, _)| *at)
    }

    /// Puts every request the tokenizer is done with (by `now`) on its
    /// rank's queue, choosing the rank if the request names none.
    pub fn dispatch_due(&mut self, now: Micros) -> Vec<Dispatched> {
        let mut dispatched = Vec::new();
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((_, req), pending) = entry.remove_entry();
            dispatched.push(self.dispatch(now, req, pending));
        }
        dispatched
    }

    fn dispatch(&mut self, now: Micros, req: ReqId, pending: Pending) -> Dispatched {
        let Pending {
            worker,
            arrival,
            oracle_uncached,
        } = pending;
        let params = &self.params;
        let max_new = arrival.max_new_tokens.max(1);
        let stops: Vec<u64> = (0..arrival.prompts.len())
            .map(|index| arrival.stop_at(index))
            .collect();
        let mut seqs = Vec::new();
        let (rank, group) = match &mut self.servers {
            Servers::Sglang(workers) => {
                let worker_state = &mut workers[worker];
                let rank = match arrival.rank {
                    Some(rank) => rank.min(params.dp_size - 1),
                    None => worker_state.choose_rank(params, now, &arrival),
                };
                let rank_state = &mut worker_state.ranks[rank];
                rank_state.pending.retain(|queued| queued.req != req);
                let priority = params.priority_rank(arrival.priority);
                for (index, prompt) in arrival.prompts.into_iter().enumerate() {
                    let id = self.next_seq;
                    self.next_seq += 1;
                    seqs.push(id);
                    rank_state.enqueue(Seq {
                        id,
                        req,
                        index,
                        prompt,
                        max_new,
                        stop_at: stops[index],
                        generated: 0,
                        prefix_len: 0,
                        node: radix::ROOT,
                        computed: 0,
                        alloc: 0,
                        cached_tokens: None,
                        est_uncached: 0,
                        oracle_uncached: oracle_uncached.get(index).copied(),
                        priority,
                    });
                }
                (rank, worker_state.group_of(rank))
            }
            Servers::Vllm(workers) => {
                let server = &mut workers[worker];
                let client = server.next_client();
                let rank = match arrival.rank {
                    Some(rank) => rank.min(params.dp_size - 1),
                    None => server.balancer.choose(now, client),
                };
                server
                    .balancer
                    .placed(client, rank, arrival.prompts.len().max(1) as u64);
                let engine = &mut server.engines[rank];
                engine.pending.retain(|queued| queued.req != req);
                for (index, prompt) in arrival.prompts.into_iter().enumerate() {
                    let id = self.next_seq;
                    self.next_seq += 1;
                    seqs.push(id);
                    engine.enqueue(vllm::engine::Request {
                        id,
                        req,
                        index,
                        prompt,
                        max_new,
                        stop_at: stops[index],
                        generated: 0,
                        computed: 0,
                        blocks: Vec::new(),
                        committed: 0,
                        hashes: Vec::new(),
                        cached_tokens: None,
                        preempted: false,
                        client,
                        queued_at: now,
                        scheduled_at: None,
                        oracle_uncached: oracle_uncached.get(index).copied(),
                    });
                }
                (rank, server.group_of(rank))
            }
        };
        if let Some(placement) = self.placements.get_mut(&req) {
            placement.rank = Some(rank);
            placement.seqs = seqs;
        }
        Dispatched {
            req,
            worker,
            rank,
            group,
        }
    }

    /// Where a request is (or will be) served: (worker, rank once known).
    pub fn placement(&self, req: ReqId) -> Option<(usize, Option<usize>)> {
        self.placements
            .get(&req)
            .map(|placement| (placement.worker, placement.rank))
    }

    /// Plans one step of a group of ranks; its duration, or None if the
    /// group has nothing to do.
    pub fn begin_step(
        &mut self,
        worker: usize,
        group: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<Micros> {
        let start = out.len();
        let params = &self.params;
        let duration = match &mut self.servers {
            Servers::Sglang(workers) => workers.get_mut(worker)?.begin_step(params, group, now, out),
            Servers::Vllm(workers) => workers.get_mut(worker)?.begin_step(params, group, now, out),
        };
        self.settle(start, out);
        duration
    }

    /// Ends the group's step planned by `begin_step`.
    pub fn end_step(&mut self, worker: usize, group: usize, now: Micros, out: &mut Vec<Event>) {
        let start = out.len();
        let params = &self.params;
        match &mut self.servers {
            Servers::Sglang(workers) => {
                if let Some(worker) = workers.get_mut(worker) {
                    worker.end_step(params, group, now, out);
                }
            }
            Servers::Vllm(workers) => {
                if let Some(worker) = workers.get_mut(worker) {
                    worker.end_step(params, group, now, out);
                }
            }
        }
        self.settle(start, out);
    }

    /// Whether the group is in a step.
    pub fn in_step(&self, worker: usize, group: usize) -> bool {
        let step = match &self.servers {
            Servers::Sglang(workers) => workers
                .get(worker)
                .and_then(|w| w.groups.get(group))
                .map(|g| g.step),
            Servers::Vllm(workers) => workers
                .get(worker)
                .and_then(|w| w.groups.get(group))
                .map(|g| g.step),
        };
        step.flatten().is_some()
    }

    /// Forgets finished requests and thins the token events.
    fn settle(&mut self, start: usize, out: &mut Vec<Event>) {
        for event in &out[start..] {
            let closed = matches!(
                event.kind,
                EventKind::Token { done: true, .. } | EventKind::Failed { .. }
            );
            if closed {
                if let Some(placement) = self.placements.get_mut(&event.req) {
                    placement.open = placement.open.saturating_sub(1);
                    if placement.open == 0 {
                        self.placements.remove(&event.req);
                    }
                }
            }
        }
        if !self.every_token {
            let mut index = start;
            out.retain(|event| {
                let keep = index < start
                    || !matches!(event.kind, EventKind::Token { count, done: false, .. } if count > 1);
                index += 1;
                keep
            });
        }
    }

    /// The client went away: the request is dropped wherever it is. Returns
    /// the (worker, group) that may now have room.
    pub fn abort(&mut self, req: ReqId) -> Option<(usize, usize)> {
        let placement = self.placements.remove(&req)?;
        let Some(rank) = placement.rank else {
            // Still in the tokenizer.
            let key = self.pending.keys().find(|(_, id)| *id == req).copied();
            if let Some(pending) = key.and_then(|key| self.pending.remove(&key)) {
                if let Some(rank) = pending.arrival.rank {
                    match &mut self.servers {
                        Servers::Sglang(workers) => {
                            if let Some(rank_state) = workers
                                .get_mut(placement.worker)
                                .and_then(|w| w.ranks.get_mut(rank))
                            {
                                rank_state.pending.retain(|queued| queued.req != req);
                            }
                        }
                        Servers::Vllm(workers) => {
                            if let Some(engine) = workers
                                .get_mut(placement.worker)
                                .and_then(|w| w.engines.get_mut(rank))
                            {
                                engine.pending.retain(|queued| queued.req != req);
                            }
                        }
                    }
                }
            }
            return None;
        };
        match &mut self.servers {
            Servers::Sglang(workers) => {
                let worker = workers.get_mut(placement.worker)?;
                let rank_state = worker.ranks.get_mut(rank)?;
                for seq in placement.seqs {
                    rank_state.abort(seq);
                }
                Some((placement.worker, worker.group_of(rank)))
            }
            Servers::Vllm(workers) => {
                let server = workers.get_mut(placement.worker)?;
                for seq in placement.seqs {
                    let left = server.engines.get_mut(rank).and_then(|engine| engine.abort(seq));
                    if let Some(left) = left {
                        server.balancer.left(left.client, rank);
                    }
                }
                Some((placement.worker, server.group_of(rank)))
            }
        }
    }

    /// Decode role: the KV transfer of a sequence ended. Returns the
    /// (worker, group) to wake.
    pub fn transfer_done(
        &mut self,
        now: Micros,
        req: ReqId,
        seq: usize,
        outcome: Result<(), String>,
        out: &mut Vec<Event>,
    ) -> Option<(usize, usize)> {
        let placement = self.placements.get(&req)?;
        let (worker, rank) = (placement.worker, placement.rank?);
        let id = *placement.seqs.get(seq)?;
        let start = out.len();
        let Servers::Sglang(workers) = &mut self.servers else {
            return None;
        };
        let worker_state = workers.get_mut(worker)?;
        worker_state
            .ranks
            .get_mut(rank)?
            .finish_transfer(&self.params, now, id, outcome, out);
        let group = worker_state.group_of(rank);
        self.settle(start, out);
        Some((worker, group))
    }

    /// The loads each rank of `worker` last published (SGLang mode; empty
    /// in vLLM mode, whose engines report through `engine_stats`).
    pub fn published(&self, worker: usize) -> Vec<RankSnapshot> {
        self.sglang()
            .get(worker)
            .map(|w| w.ranks.iter().map(|rank| rank.published).collect())
            .unwrap_or_default()
    }

    /// vLLM mode: what each engine of `worker` last reported (what its
    /// `/metrics` shows); empty in SGLang mode.
    pub fn engine_stats(&self, worker: usize) -> Vec<EngineStats> {
        match &self.servers {
            Servers::Vllm(workers) => workers
                .get(worker)
                .map(|w| w.engines.iter().map(|engine| engine.stats).collect())
                .unwrap_or_default(),
            Servers::Sglang(_) => Vec::new(),
        }
    }

    /// vLLM mode: (waiting, running) of each engine of `worker` right now.
    pub fn engine_counts(&self, worker: usize) -> Vec<(u64, u64)> {
        match &self.servers {
            Servers::Vllm(workers) => workers
                .get(worker)
                .map(|w| w.engines.iter().map(|engine| engine.counts()).collect())
                .unwrap_or_default(),
            Servers::Sglang(_) => Vec::new(),
        }
    }

    /// The loads of `worker`'s ranks right now (tests and the oracle's
    /// tie-break; the endpoints serve `published`). SGLang mode.
    pub fn live(&mut self, worker: usize, now: Micros) -> Vec<RankSnapshot> {
        let params = &self.params;
        match &mut self.servers {
            Servers::Sglang(workers) => workers
                .get_mut(worker)
                .map(|w| {
                    w.ranks
                        .iter_mut()
                        .map(|rank| rank.snapshot(params, now))
                        .collect()
                })
                .unwrap_or_default(),
            Servers::Vllm(_) => Vec::new(),
        }
    }

    /// The current `new_token_ratio` of a rank (SGLang mode).
    pub fn new_token_ratio(&self, worker: usize, rank: usize) -> f64 {
        self.sglang()
            .get(worker)
            .and_then(|w| w.ranks.get(rank))
            .map_or(0.0, |rank| rank.ratio)
    }

    /// Tokens of `prompt` a rank's prefix cache holds now (vLLM: in full
    /// blocks, at most all but one token).
    pub fn cached_prefix(&self, worker: usize, rank: usize, prompt: &[u32]) -> usize {
        match &self.servers {
            Servers::Sglang(workers) => workers
                .get(worker)
                .and_then(|w| w.ranks.get(rank))
                .map_or(0, |rank| rank.cache.match_len(prompt)),
            Servers::Vllm(workers) => workers
                .get(worker)
                .and_then(|w| w.engines.get(rank))
                .map_or(0, |engine| engine.cached_prefix(&self.params, prompt) as usize),
        }
    }
}
