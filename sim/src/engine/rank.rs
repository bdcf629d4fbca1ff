//! The scheduler of one data-parallel rank, as SGLang's `Scheduler` runs it
//! (python/sglang/srt/managers/scheduler.py, schedule_policy.py,
//! schedule_batch.py):
//!
//! - each step first tries to build a prefill batch from the waiting queue
//!   in arrival order (`get_new_batch_prefill` with `PrefillAdder`); only if
//!   there is none does the running batch decode (`update_running_batch`);
//! - admission reserves the uncached prompt plus the request's output
//!   (clipped to 4096) against free + evictable KV minus
//!   `new_token_ratio` x the remaining output of the running requests;
//! - a decode step that finds no KV for the next token retracts requests
//!   (fewest output tokens first, then longest prompt) back to the queue
//!   and raises the ratio; otherwise the ratio decays towards its minimum;
//! - prompts longer than the chunk budget are prefilled in chunks;
//! - with `--enable-mixed-chunk` a prefill step carries the running batch's
//!   decodes; with the prefill delayer a rank may hold new prefills back
//!   (`hold_prefill`, decided for the group in `worker.rs`);
//! - the radix cache and the requests share the rank's KV pool: prompts
//!   are inserted after prefill, whole sequences when they finish.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};

use super::cost::{DecodeWork, PrefillWork};
use super::radix::{NodeId, RadixCache, ROOT};
use super::{Event, EventKind, Micros, Params, Queued, ReqId, SeqId};
use crate::config::{Role, RETRACT_DECODE_STEPS};
use crate::output;

/// Window of the token-weighted cache hit rate reported in the loads
/// (SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS).
const HIT_RATE_WINDOW: Micros = 15_000_000;
/// Decode steps `gen_throughput` is measured over (SGLang's
/// --decode-log-interval default).
const GEN_THROUGHPUT_STEPS: usize = 40;

/// One sequence (a request has one per prompt of a batch).
#[derive(Debug)]
pub(crate) struct Seq {
    pub id: SeqId,
    pub req: ReqId,
    pub index: usize,
    pub prompt: Vec<u32>,
    /// `max_new_tokens` as asked (clamped to fit): what admission reserves.
    pub max_new: u64,
    /// Where the answer ends (its EOS, at most `max_new`).
    pub stop_at: u64,
    pub generated: u64,
    /// Cache tokens this sequence locks (whole pages).
    pub prefix_len: u64,
    pub node: NodeId,
    /// Tokens whose KV exists (cached prefix included).
    pub computed: u64,
    /// KV tokens allocated to this sequence outside the cache.
    pub alloc: u64,
    /// Prompt tokens found in the cache at the first admission.
    pub cached_tokens: Option<u64>,
    /// Uncached tokens as last matched (for `num_waiting_uncached_tokens`).
    pub est_uncached: u64,
    /// Uncached tokens as the oracle projected them when it placed it.
    pub oracle_uncached: Option<u64>,
    /// Its place in the waiting queue: higher first (`Params::priority_rank`).
    pub priority: i64,
}

impl Seq {
    /// Tokens a (re)prefill must cover: the prompt and what was generated.
    fn fill_len(&self) -> u64 {
        self.prompt.len() as u64 + self.generated
    }

    /// The first `upto` tokens of prompt + output.
    fn fill(&self, upto: u64) -> Cow<'_, [u32]> {
        let upto = upto as usize;
        if upto <= self.prompt.len() {
            return Cow::Borrowed(&self.prompt[..upto]);
        }
        let mut tokens = self.prompt.clone();
        let outputs = (upto - self.prompt.len()) as u64;
        tokens.extend((1..=outputs).map(output::token_id));
        Cow::Owned(tokens)
    }

    fn event(&self, at: Micros, kind: EventKind) -> Event {
        Event {
            req: self.req,
            seq: self.index,
            at,
            kind,
        }
    }

    fn token_event(&self, at: Micros) -> Event {
        self.event(
            at,
            EventKind::Token {
                count: self.generated,
                cached_tokens: self.cached_tokens.unwrap_or(0),
                done: self.generated >= self.stop_at,
            },
        )
    }
}

/// What a rank does during the current step.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) enum Plan {
    #[default]
    Idle,
    /// Prefill these sequences by this many tokens each.
    Prefill {
        batch: Vec<(SeqId, u64)>,
        work: PrefillWork,
    },
    /// One decode step of the running batch.
    Decode(DecodeWork),
    /// A prefill step carrying the decodes of `decoding` (SGLang's mixed
    /// chunk).
    Mixed {
        batch: Vec<(SeqId, u64)>,
        work: PrefillWork,
        decoding: Vec<SeqId>,
        decode: DecodeWork,
    },
}

/// A rank's load as published for the load endpoints and the DP controller.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RankSnapshot {
    /// When it was published.
    pub at: Micros,
    pub running: u64,
    pub waiting: u64,
    pub waiting_uncached_tokens: u64,
    /// KV in use: requests' tokens and cache tokens they lock.
    pub used_tokens: u64,
    /// Used + the full length of waiting requests.
    pub total_tokens: u64,
    pub cache_hit_rate: f64,
    pub gen_throughput: f64,
}

/// Why the admission loop stopped (SGLang's `AddReqResult`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Continue,
    NoToken,
    Other,
}

/// The running totals of one admission pass (`PrefillAdder`).
#[derive(Debug)]
struct Adder {
    /// KV promised: running requests' expected output, then every
    /// admitted request's prompt and output.
    offset: f64,
    /// Prompt tokens admitted this pass.
    current: u64,
    rem_input: i64,
    rem_chunk: Option<i64>,
    batch: Vec<(SeqId, u64)>,
}

#[derive(Debug)]
pub(crate) struct Rank {
    pub seqs: HashMap<SeqId, Seq>,
    pub waiting: VecDeque<SeqId>,
    pub running: Vec<SeqId>,
    pub chunked: Option<SeqId>,
    /// Decode role: admitted, KV being fetched from the prefill worker.
    pub transferring: Vec<SeqId>,
    pub cache: RadixCache,
    /// Oracle dispatch: requests placed here still in the tokenizer.
    pub pending: Vec<Queued>,
    /// KV tokens allocated to sequences (outside the cache).
    pub alloc_total: u64,
    pub ratio: f64,
    /// SGLang's `batch_is_full`: no prefill is tried until the running
    /// batch shrinks.
    pub batch_is_full: bool,
    /// The prefill delayer holds new prefills back this step (a prompt
    /// being chunked goes on).
    pub hold_prefill: bool,
    pub plan: Plan,
    publish_counter: u32,
    pub published: RankSnapshot,
    /// (admitted at, cached tokens, uncached tokens) of recent admissions.
    hits: VecDeque<(Micros, u64, u64)>,
    /// (start, end, tokens) of recent decode steps.
    decode_steps: VecDeque<(Micros, Micros, u64)>,
}

fn ceil_page(tokens: u64, page: u64) -> u64 {
    tokens.div_ceil(page) * page
}

fn floor_page(tokens: u64, page: u64) -> u64 {
    tokens / page * page
}

impl Rank {
    pub fn new(params: &Params) -> Self {
        Self {
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            chunked: None,
            transferring: Vec::new(),
            cache: RadixCache::new(params.page as usize),
            pending: Vec::new(),
            alloc_total: 0,
            ratio: params.init_ratio,
            batch_is_full: false,
            hold_prefill: false,
            plan: Plan::Idle,
            publish_counter: 0,
            published: RankSnapshot::default(),
            hits: VecDeque::new(),
            decode_steps: VecDeque::new(),
        }
    }

    /// Free KV slots.
    pub fn available(&self, params: &Params) -> u64 {
        params
            .capacity
            .saturating_sub(self.cache.total_size() + self.alloc_total)
    }

    /// Evicts cache tokens until `need` slots are free, if it can.
    fn make_room(&mut self, params: &Params, need: u64) {
        let available = self.available(params);
        if available < need {
            self.cache.evict(need - available);
        }
    }

    /// Sets a sequence's allocation for `kv` tokens of KV (whole pages
    /// beyond its cached prefix), evicting cache tokens if needed.
    fn set_alloc(&mut self, params: &Params, id: SeqId, kv: u64) {
        let Some(seq) = self.seqs.get(&id) else {
            return;
        };
        let new = ceil_page(kv, params.page).saturating_sub(seq.prefix_len);
        let old = seq.alloc;
        if new > old {
            self.make_room(params, new - old);
        }
        self.alloc_total = self.alloc_total + new - old;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.alloc = new;
        }
    }

    /// Output the running requests are still expected to write.
    fn running_offset(&self, params: &Params) -> f64 {
        self.running
            .iter()
            .chain(&self.transferring)
            .filter_map(|id| self.seqs.get(id))
            .map(|seq| seq.max_new.saturating_sub(seq.generated).min(params.clip) as f64 * self.ratio)
            .sum()
    }

    fn budget(&self, params: &Params, adder: &Adder) -> (f64, f64) {
        let room = (self.available(params) + self.cache.evictable_size()) as f64;
        (room - adder.offset, room - adder.current as f64)
    }

    fn verdict(&self, params: &Params, adder: &Adder) -> Verdict {
        let (rem_total, cur_rem) = self.budget(params, adder);
        if rem_total <= 0.0 || cur_rem <= 0.0 {
            Verdict::NoToken
        } else if adder.rem_input <= 0 || adder.rem_chunk.is_some_and(|chunk| chunk <= 0) {
            Verdict::Other
        } else {
            Verdict::Continue
        }
    }

    /// Queues a dispatched sequence.
    pub fn enqueue(&mut self, mut seq: Seq) {
        seq.est_uncached = seq.fill_len() - self.cache.match_len(&seq.prompt) as u64;
        let id = seq.id;
        self.seqs.insert(id, seq);
        self.queue(id);
    }

    /// Puts `id` in the waiting queue behind every sequence of its priority
    /// or higher (arrival order when every priority is the same).
    fn queue(&mut self, id: SeqId) {
        let priority_of = |seqs: &HashMap<SeqId, Seq>, id: &SeqId| seqs.get(id).map_or(0, |seq| seq.priority);
        let mine = priority_of(&self.seqs, &id);
        let behind_last = self
            .waiting
            .back()
            .is_none_or(|last| priority_of(&self.seqs, last) >= mine);
        if behind_last {
            self.waiting.push_back(id);
            return;
        }
        let at = self
            .waiting
            .iter()
            .position(|other| priority_of(&self.seqs, other) < mine)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, id);
    }

    /// Tokens of `prompt` the prompts being prefilled now will have put in
    /// the cache by the end of the current step.
    pub fn in_flight_match(&self, prompt: &[u32]) -> u64 {
        let mut best = 0;
        let mut consider = |id: &SeqId, extra: u64| {
            if let Some(seq) = self.seqs.get(id) {
                let reach = (seq.computed + extra).min(seq.prompt.len() as u64) as usize;
                let common = seq.prompt[..reach]
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count() as u64;
                best = best.max(common);
            }
        };
        if let Plan::Prefill { batch, .. } | Plan::Mixed { batch, .. } = &self.plan {
            for (id, take) in batch {
                consider(id, *take);
            }
        }
        if let Some(id) = &self.chunked {
            consider(id, 0);
        }
        best
    }

    /// Plans the next step: a prefill batch if one can be formed (with
    /// the running batch's decodes under mixed chunks), else a decode step
    /// of the running batch, else nothing.
    pub fn plan_step(&mut self, params: &Params, now: Micros, out: &mut Vec<Event>) -> Plan {
        let plan = if params.role == Role::Decode {
            self.admit_for_transfer(params, now, out);
            self.decode_plan(params, now, out)
        } else {
            match self.prefill_batch(params, now) {
                Some(Plan::Prefill { batch, work }) if params.mixed_chunk && !self.running.is_empty() => {
                    self.mix_with_running(params, batch, work)
                }
                Some(plan) => plan,
                None => self.decode_plan(params, now, out),
            }
        };
        self.plan = plan.clone();
        plan
    }

    /// `mix_with_running`: the running batch decodes in the prefill's
    /// forward pass, if the KV has a slot for each of its next tokens (the
    /// admission left room for them); else the prefill runs alone.
    fn mix_with_running(&mut self, params: &Params, batch: Vec<(SeqId, u64)>, work: PrefillWork) -> Plan {
        let need = self.decode_need(params, &self.running);
        if !self.check_decode_mem(params, need) {
            return Plan::Prefill { batch, work };
        }
        for id in self.running.clone() {
            let computed = self.seqs.get(&id).map_or(0, |seq| seq.computed);
            self.set_alloc(params, id, computed + 1);
        }
        Plan::Mixed {
            batch,
            work,
            decoding: self.running.clone(),
            decode: self.decode_work(),
        }
    }

    /// Whether the prefill delayer counts this rank as able to prefill: a
    /// waiting request would pass admission's slot and KV checks (SGLang
    /// negotiates after them since PR #31835).
    pub fn would_prefill(&self, params: &Params) -> bool {
        let Some(seq) = self.waiting.front().and_then(|id| self.seqs.get(id)) else {
            return false;
        };
        if self.batch_is_full || self.running.len() as u64 >= params.max_running {
            return false;
        }
        let cached = if params.cache_on {
            self.cache.match_len(&seq.prompt) as u64
        } else {
            0
        };
        let extend = seq.fill_len().saturating_sub(cached).max(1);
        let reserve = seq.max_new.saturating_sub(seq.generated).min(params.clip);
        let room =
            (self.available(params) + self.cache.evictable_size()) as f64 - self.running_offset(params);
        ((extend + reserve + params.page) as f64) < room
    }

    /// Whether the rank has a step to run even if it takes no new prompt.
    pub fn busy_without_new_prefill(&self) -> bool {
        !self.running.is_empty() || self.chunked.is_some()
    }

    /// KV in use as a share of the rank's capacity (SGLang's token usage).
    pub fn token_usage(&self, params: &Params) -> f64 {
        let free = self.available(params) + self.cache.evictable_size();
        params.capacity.saturating_sub(free) as f64 / params.capacity.max(1) as f64
    }

    fn decode_plan(&mut self, params: &Params, now: Micros, out: &mut Vec<Event>) -> Plan {
        if self.running.is_empty() {
            return Plan::Idle;
        }
        self.update_running_batch(params, now, out);
        Plan::Decode(self.decode_work())
    }

    /// The running batch as a decode step sees it: its sequences and the
    /// KV tokens they read.
    pub fn decode_work(&self) -> DecodeWork {
        DecodeWork {
            seqs: self.running.len() as u64,
            kv_tokens: self
                .running
                .iter()
                .filter_map(|id| self.seqs.get(id))
                .map(|seq| seq.computed)
                .sum(),
        }
    }

    /// `get_new_batch_prefill`: admits waiting sequences in order.
    fn prefill_batch(&mut self, params: &Params, now: Micros) -> Option<Plan> {
        if (self.batch_is_full || self.waiting.is_empty()) && self.chunked.is_none() {
            return None;
        }
        let running = self.running.len() as u64;
        let slots = params.max_running.saturating_sub(running);
        if slots == 0 && self.chunked.is_none() {
            self.batch_is_full = true;
            return None;
        }
        // Mixed chunks: the running batch's decode tokens come out of the
        // step's budgets (`mixed_with_decode_tokens`).
        let mixed = if params.mixed_chunk { running as i64 } else { 0 };
        let mut adder = Adder {
            offset: self.running_offset(params) + mixed as f64,
            current: 0,
            rem_input: params.max_prefill as i64 - mixed,
            rem_chunk: params.chunk.map(|chunk| chunk as i64 - mixed),
            batch: Vec::new(),
        };
        if let Some(id) = self.chunked {
            self.add_chunked(params, id, &mut adder);
        }
        while let Some(&id) = self.waiting.front().filter(|_| !self.hold_prefill) {
            if adder.batch.len() as u64 >= slots {
                self.batch_is_full = true;
                break;
            }
            let (admitted, verdict) = self.add_one(params, now, id, &mut adder);
            if admitted {
                self.waiting.pop_front();
            }
            if verdict != Verdict::Continue {
                if verdict == Verdict::NoToken {
                    self.batch_is_full = true;
                }
                break;
            }
        }
        if adder.batch.is_empty() {
            return None;
        }
        let mut work = PrefillWork::default();
        for &(id, take) in &adder.batch {
            // The chunk attends to the sequence's cached prefix or earlier
            // chunks, and to itself.
            let computed = self.seqs.get(&id).map_or(0, |seq| seq.computed);
            self.set_alloc(params, id, computed + take);
            work.add(computed, take);
        }
        Some(Plan::Prefill {
            batch: adder.batch,
            work,
        })
    }

    /// `add_chunked_req`: the next chunk of the prompt being chunked.
    fn add_chunked(&mut self, params: &Params, id: SeqId, adder: &mut Adder) {
        let Some(seq) = self.seqs.get(&id) else {
            self.chunked = None;
            return;
        };
        let remaining = seq.fill_len() - seq.computed;
        let limit = adder.rem_chunk.unwrap_or(i64::MAX).max(0) as u64;
        let (take, last) = if remaining <= limit {
            (remaining, true)
        } else {
            (floor_page(limit, params.page), false)
        };
        if take == 0 {
            return;
        }
        let reserve = if last {
            seq.max_new.saturating_sub(seq.generated).min(params.clip)
        } else {
            0
        };
        adder.offset += (ceil_page(take, params.page) + reserve) as f64;
        adder.current += take;
        adder.rem_input -= take as i64;
        if let Some(chunk) = &mut adder.rem_chunk {
            *chunk -= take as i64;
        }
        adder.batch.push((id, take));
    }

    /// `PrefillAdder.add_one_req`: whether the sequence was admitted, and
    /// whether the pass goes on.
    fn add_one(&mut self, params: &Params, now: Micros, id: SeqId, adder: &mut Adder) -> (bool, Verdict) {
        let Some(seq) = self.seqs.get(&id) else {
            return (false, Verdict::Continue);
        };
        let fill_len = seq.fill_len();
        let (prefix, node) = if params.cache_on {
            // At least one token is always computed (it yields the logits).
            let fill = seq.fill(fill_len - 1);
            let (len, node) = self.cache.match_prefix(&fill);
            (len as u64, node)
        } else {
            (0, ROOT)
        };
        let reserve = seq.max_new.saturating_sub(seq.generated).min(params.clip);
        let extend = fill_len - prefix;
        // The matched prefix is pinned while the budget is checked.
        self.cache.lock(node);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.est_uncached = extend;
        }
        let total = extend + reserve + params.page;
        let (rem_total, _) = self.budget(params, adder);
        if total as f64 >= rem_total {
            self.cache.unlock(node);
            return (false, Verdict::NoToken);
        }
        let input = ceil_page(extend, params.page);
        let (take, truncated) = match adder.rem_chunk {
            None => {
                // Without chunking the first request may exceed the cap.
                if !adder.batch.is_empty() && input as i64 >= adder.rem_input {
                    self.cache.unlock(node);
                    return (false, Verdict::Other);
                }
                (extend, false)
            }
            Some(chunk) if input as i64 <= chunk => (extend, false),
            Some(chunk) => {
                let take = floor_page(chunk.max(0) as u64, params.page);
                if take == 0 {
                    self.cache.unlock(node);
                    return (false, Verdict::Other);
                }
                (take, true)
            }
        };
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.prefix_len = prefix;
            seq.node = node;
            seq.computed = prefix;
            seq.cached_tokens.get_or_insert(prefix);
        }
        self.hits.push_back((now, prefix, extend));
        adder.offset += (ceil_page(take, params.page) + if truncated { 0 } else { reserve }) as f64;
        adder.current += take;
        adder.rem_input -= take as i64;
        if let Some(chunk) = &mut adder.rem_chunk {
            *chunk -= take as i64;
        }
        adder.batch.push((id, take));
        if truncated {
            self.chunked = Some(id);
        }
        (true, self.verdict(params, adder))
    }

    /// Decode role: admits queued requests whose KV will be fetched from
    /// the prefill worker (no prefix cache on this side).
    fn admit_for_transfer(&mut self, params: &Params, now: Micros, out: &mut Vec<Event>) {
        if self.batch_is_full {
            return;
        }
        let mut offset = self.running_offset(params);
        while let Some(&id) = self.waiting.front() {
            let active = (self.running.len() + self.transferring.len()) as u64;
            if active >= params.max_running {
                self.batch_is_full = true;
                break;
            }
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let prompt = seq.prompt.len() as u64;
            let reserve = seq.max_new.saturating_sub(seq.generated).min(params.clip);
            let room = (self.available(params) + self.cache.evictable_size()) as f64 - offset;
            if (prompt + reserve + params.page) as f64 >= room {
                self.batch_is_full = true;
                break;
            }
            // The prompt's KV is allocated at once (`available` counts it
            // from now on); only its output is reserved.
            offset += reserve as f64;
            self.waiting.pop_front();
            self.set_alloc(params, id, prompt);
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.cached_tokens.get_or_insert(0);
                out.push(seq.event(now, EventKind::TransferStart));
            }
            self.transferring.push(id);
        }
    }

    /// Decode role: the KV of a request arrived (or will never arrive).
    pub fn finish_transfer(
        &mut self,
        params: &Params,
        now: Micros,
        id: SeqId,
        outcome: Result<(), String>,
        out: &mut Vec<Event>,
    ) {
        let Some(position) = self.transferring.iter().position(|seq| *seq == id) else {
            return;
        };
        self.transferring.remove(position);
        self.batch_is_full = false;
        match outcome {
            Ok(()) => {
                let Some(seq) = self.seqs.get_mut(&id) else {
                    return;
                };
                // The prefill computed the first token.
                seq.computed = seq.prompt.len() as u64;
                seq.generated = 1;
                out.push(seq.token_event(now));
                if seq.generated >= seq.stop_at {
                    self.finish(params, id);
                } else {
                    self.running.push(id);
                }
            }
            Err(message) => {
                if let Some(seq) = self.seqs.get(&id) {
                    out.push(seq.event(now, EventKind::Failed { message }));
                }
                self.release(id);
            }
        }
    }

    /// `update_running_batch`: makes room for the next token of every
    /// running request, retracting some if the KV cannot hold them.
    fn update_running_batch(&mut self, params: &Params, now: Micros, out: &mut Vec<Event>) {
        let initial = self.running.len();
        let need = self.decode_need(params, &self.running);
        if self.check_decode_mem(params, need) {
            if !params.full_reservation {
                self.ratio = (self.ratio - params.ratio_decay).max(params.min_ratio);
            }
        } else {
            self.retract(params, now, out);
        }
        if self.running.len() < initial {
            self.batch_is_full = false;
        }
        for id in self.running.clone() {
            let computed = self.seqs.get(&id).map_or(0, |seq| seq.computed);
            self.set_alloc(params, id, computed + 1);
        }
    }

    /// KV slots the next decode step needs (a new page where one is full).
    fn decode_need(&self, params: &Params, ids: &[SeqId]) -> u64 {
        ids.iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|seq| seq.computed % params.page == 0)
            .count() as u64
            * params.page
    }

    fn check_decode_mem(&mut self, params: &Params, need: u64) -> bool {
        self.make_room(params, need);
        self.available(params) >= need
    }

    /// `retract_decode`: sends running requests back to the queue, fewest
    /// output tokens first (ties: longest prompt first), until the rest
    /// can decode; then re-estimates the ratio from what remains.
    fn retract(&mut self, params: &Params, now: Micros, out: &mut Vec<Event>) {
        let mut order = std::mem::take(&mut self.running);
        let key = |rank: &Rank, id: &SeqId| {
            rank.seqs.get(id).map_or((0, std::cmp::Reverse(0)), |seq| {
                (seq.generated, std::cmp::Reverse(seq.prompt.len()))
            })
        };
        // Stable sort, descending: victims come off the end.
        order.sort_by_key(|id| std::cmp::Reverse(key(self, id)));
        let mut first = true;
        loop {
            let need = self.decode_need(params, &order);
            if !first && self.check_decode_mem(params, need) {
                break;
            }
            if order.len() <= 1 {
                break;
            }
            first = false;
            let Some(victim) = order.pop() else {
                break;
            };
            self.retract_one(victim, now, out);
        }
        self.running = order;
        let (decoded, max_new) = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .fold((0u64, 0u64), |(d, m), seq| (d + seq.generated, m + seq.max_new));
        let estimate = (decoded + RETRACT_DECODE_STEPS * self.running.len() as u64) as f64;
        self.ratio = if max_new == 0 {
            1.0
        } else {
            (estimate / max_new as f64).min(1.0)
        };
    }

    fn retract_one(&mut self, id: SeqId, now: Micros, out: &mut Vec<Event>) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let (node, alloc) = (seq.node, seq.alloc);
        seq.node = ROOT;
        seq.prefix_len = 0;
        seq.computed = 0;
        seq.alloc = 0;
        out.push(seq.event(now, EventKind::Retracted));
        self.cache.unlock(node);
        self.alloc_total -= alloc;
        self.queue(id);
    }

    /// Ends the step planned by `plan_step`.
    pub fn end_step(&mut self, params: &Params, start: Micros, now: Micros, out: &mut Vec<Event>) {
        match std::mem::take(&mut self.plan) {
            Plan::Idle => {
                self.count_publish(params, now);
            }
            Plan::Prefill { batch, .. } => {
                for (id, take) in batch {
                    self.end_prefill(params, now, id, take, out);
                }
                self.publish(params, now);
            }
            Plan::Decode(_) => {
                self.end_decode(params, self.running.clone(), start, now, out);
                self.count_publish(params, now);
            }
            Plan::Mixed { batch, decoding, .. } => {
                self.end_decode(params, decoding, start, now, out);
                for (id, take) in batch {
                    self.end_prefill(params, now, id, take, out);
                }
                self.publish(params, now);
            }
        }
    }

    /// The sequences `ids` decoded one token each.
    fn end_decode(
        &mut self,
        params: &Params,
        ids: Vec<SeqId>,
        start: Micros,
        now: Micros,
        out: &mut Vec<Event>,
    ) {
        let mut tokens = 0;
        for id in ids {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            seq.computed += 1;
            seq.generated += 1;
            tokens += 1;
            out.push(seq.token_event(now));
            if seq.generated >= seq.stop_at {
                self.finish(params, id);
            }
        }
        self.decode_steps.push_back((start, now, tokens));
        while self.decode_steps.len() > GEN_THROUGHPUT_STEPS {
            self.decode_steps.pop_front();
        }
    }

    fn end_prefill(&mut self, params: &Params, now: Micros, id: SeqId, take: u64, out: &mut Vec<Event>) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        seq.computed += take;
        if seq.computed < seq.fill_len() {
            // Another chunk follows.
            self.cache_unfinished(params, id);
            return;
        }
        if self.chunked == Some(id) {
            self.chunked = None;
        }
        seq.generated += 1;
        out.push(seq.token_event(now));
        if params.role == Role::Prefill || seq.generated >= seq.stop_at {
            self.finish(params, id);
        } else {
            self.cache_unfinished(params, id);
            self.running.push(id);
        }
    }

    /// `cache_unfinished_req`: the computed prompt goes into the cache now,
    /// so later requests sharing it hit while this one still runs.
    fn cache_unfinished(&mut self, params: &Params, id: SeqId) {
        if !params.cache_on {
            return;
        }
        let Some(seq) = self.seqs.get(&id) else {
            return;
        };
        let aligned = floor_page(seq.computed, params.page);
        if aligned <= seq.prefix_len {
            return;
        }
        let fill = seq.fill(aligned).into_owned();
        let old = seq.node;
        let computed = seq.computed;
        let (_, node) = self.cache.insert(&fill);
        self.cache.lock(node);
        self.cache.unlock(old);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.node = node;
            seq.prefix_len = aligned;
        }
        self.set_alloc(params, id, computed);
    }

    /// `cache_finished_req`: the sequence's KV goes into the cache (its
    /// last token has none) and the sequence leaves.
    fn finish(&mut self, params: &Params, id: SeqId) {
        self.running.retain(|seq| *seq != id);
        self.batch_is_full = false;
        if params.cache_on {
            if let Some(seq) = self.seqs.get(&id) {
                // The KV written: prompt + output but the last token.
                let aligned = floor_page(seq.computed, params.page);
                if aligned > seq.prefix_len {
                    let fill = seq.fill(aligned).into_owned();
                    self.cache.insert(&fill);
                }
            }
        }
        self.release(id);
    }

    /// Frees what a sequence holds and forgets it.
    fn release(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        self.cache.unlock(seq.node);
        self.alloc_total -= seq.alloc;
    }

    /// The client went away: SGLang aborts the request wherever it is.
    pub fn abort(&mut self, id: SeqId) {
        self.waiting.retain(|seq| *seq != id);
        self.running.retain(|seq| *seq != id);
        self.transferring.retain(|seq| *seq != id);
        if self.chunked == Some(id) {
            self.chunked = None;
        }
        self.batch_is_full = false;
        self.release(id);
    }

    /// Nothing to do: SGLang resets the ratio when the scheduler idles.
    pub fn idle(&mut self, params: &Params, now: Micros) {
        self.ratio = params.init_ratio;
        self.batch_is_full = false;
        self.publish(params, now);
    }

    pub fn has_work(&self) -> bool {
        !(self.waiting.is_empty() && self.running.is_empty() && self.chunked.is_none())
    }

    fn count_publish(&mut self, params: &Params, now: Micros) {
        self.publish_counter += 1;
        if self.publish_counter >= params.publish_interval {
            self.publish(params, now);
        }
    }

    /// Publishes the load snapshot the load endpoints and the DP
    /// controller read.
    pub fn publish(&mut self, params: &Params, now: Micros) {
        self.publish_counter = 0;
        self.published = self.snapshot(params, now);
    }

    /// The rank's load right now.
    pub fn snapshot(&mut self, params: &Params, now: Micros) -> RankSnapshot {
        let cutoff = now.saturating_sub(HIT_RATE_WINDOW);
        while self.hits.front().is_some_and(|(at, _, _)| *at < cutoff) {
            self.hits.pop_front();
        }
        let (hit, miss) = self
            .hits
            .iter()
            .fold((0u64, 0u64), |(h, m), (_, hit, miss)| (h + hit, m + miss));
        let cache_hit_rate = if hit + miss == 0 {
            0.0
        } else {
            hit as f64 / (hit + miss) as f64
        };
        let gen_throughput = match (self.decode_steps.front(), self.decode_steps.back()) {
            (Some((start, _, _)), Some((_, end, _))) if end > start => {
                let tokens: u64 = self.decode_steps.iter().map(|(_, _, tokens)| tokens).sum();
                tokens as f64 * 1e6 / (end - start) as f64
            }
            _ => 0.0,
        };
        let used = params
            .capacity
            .saturating_sub(self.available(params) + self.cache.evictable_size());
        let waiting_fill: u64 = self
            .waiting
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(Seq::fill_len)
            .sum();
        let mut waiting_uncached: u64 = self
            .waiting
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|seq| seq.est_uncached)
            .sum();
        if let Some(seq) = self.chunked.and_then(|id| self.seqs.get(&id)) {
            waiting_uncached += seq.fill_len() - seq.computed;
        }
        RankSnapshot {
            at: now,
            running: self.running.len() as u64,
            waiting: (self.waiting.len() + self.transferring.len()) as u64,
            waiting_uncached_tokens: waiting_uncached,
            used_tokens: used,
            total_tokens: used + waiting_fill,
            cache_hit_rate,
            gen_throughput,
        }
    }
}
