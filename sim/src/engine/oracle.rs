//! The clairvoyant greedy chooser (`--dispatch oracle`, alias
//! `clairvoyant`): fleet-wide, exact, instantaneous. For a request naming
//! no rank it projects, on every (worker, rank) of the process and from the
//! exact state of the model, when the request would get its first token,
//! and picks the earliest. It knows what no router can (every queue, every
//! cache, every reservation, this instant, and how long every answer will
//! be); it is greedy, one request at a time, so it is a reference, not a
//! bound: a router can beat it.
//!
//! The projection, per candidate rank:
//! - the request's uncached tokens: its prompt minus the longest prefix the
//!   rank's cache holds or a prompt being prefilled there now will have put
//!   there (prompts only waiting do not count: SGLang computes prompts
//!   admitted in the same batch in full);
//! - the queue ahead, in order: the prompt being chunked, the waiting
//!   requests, requests already placed on the rank still in the tokenizer;
//!   each needs, like SGLang's admission, its uncached tokens + its output
//!   (clipped) in free + evictable KV minus the running requests'
//!   `new_token_ratio` x remaining output, and a running slot; if it does
//!   not fit, the projection waits for running requests to finish (after
//!   their remaining tokens at the current decode step time) and frees
//!   their KV;
//! - prefill steps of at most the chunk budget, each lasting its prefill
//!   time or, under lockstep, the other ranks' decode step if longer; no
//!   step starts before the current one ends, and the request's own prefill
//!   not before its tokenizer is done.
//!
//! To that projected first token it adds the delay the choice imposes on
//! requests expected to arrive later (the fleet's recent arrival rate, per
//! group of ranks): the request's KV lengthens every step of its group by
//! what it raises the group's largest batch, for as long as it runs. Under
//! lockstep this is what keeps the oracle from piling requests onto one hot
//! rank whose batch slows its whole worker; without it a greedy
//! earliest-first-token rule trailed round robin.
//!
//! Ties go to the candidate with fewer uncached tokens, then fewer tokens
//! on the rank, then the lowest (worker, rank).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::cost::{DecodeWork, PrefillWork};
use super::rank::{Plan, Rank};
use super::worker::Worker;
use super::{Arrival, Fleet, Micros, Params};

/// Tokens of `prompt` that would still have to be prefilled on `rank`:
/// what neither its cache nor the prompts it is prefilling now hold. (A
/// prompt only waiting does not count: admitted in the same batch, SGLang
/// computes both in full.)
pub(crate) fn uncached(rank: &Rank, prompt: &[u32]) -> u64 {
    let cached = rank.cache.match_len(prompt) as u64;
    let hit = cached
        .max(rank.in_flight_match(prompt))
        .min(prompt.len().saturating_sub(1) as u64);
    prompt.len() as u64 - hit
}

/// One unit of work in the projected queue.
struct Item {
    uncached: u64,
    /// KV its sequence holds before the uncached part (what the prefill
    /// attends to besides itself).
    context: u64,
    tokens: u64,
    /// The output cap admission reserves from.
    max_new: u64,
    /// The output it will generate, which decides how long it runs.
    output: u64,
    not_before: Micros,
}

/// How candidates compare: projected first token plus the expected delay
/// imposed on later arrivals, uncached tokens, tokens on the rank, worker,
/// rank.
type Score = (Micros, u64, u64, usize, usize);

/// The span of recent arrivals the arrival rate is estimated from.
pub(crate) const RATE_WINDOW: Micros = 10_000_000;

/// Arrivals per second in the fleet, from the recent ones.
pub(crate) fn arrival_rate(recent: &VecDeque<Micros>, now: Micros) -> f64 {
    let Some(first) = recent.front() else {
        return 0.0;
    };
    let span = now.saturating_sub(*first).max(1_000_000);
    recent.len() as f64 * 1e6 / span as f64
}

/// The batch a rank will decode: its running requests, what it is
/// prefilling and the prompts waiting for it.
fn rank_decode(rank: &Rank) -> DecodeWork {
    let running = rank.decode_work();
    let waiting = rank.waiting.iter().filter_map(|id| rank.seqs.get(id));
    DecodeWork {
        seqs: running.seqs + rank.waiting.len() as u64,
        kv_tokens: running.kv_tokens + waiting.map(|seq| seq.prompt.len() as u64).sum::<u64>(),
    }
}

/// A worker's decode steps, read once per arrival for all its candidate
/// ranks (each candidate looks at every rank of its group).
struct WorkerSteps {
    /// Per rank: its running batch's decode step (µs).
    running_us: Vec<Micros>,
    /// Per rank: whether it has work (an idle rank does not hold a step).
    busy: Vec<bool>,
    /// Per rank: the batch it will decode ([`rank_decode`]).
    planned: Vec<DecodeWork>,
    /// Per group: the slowest planned decode step of its ranks (µs).
    slowest_planned_us: Vec<Micros>,
}

impl WorkerSteps {
    fn read(params: &Params, worker: &Worker) -> Self {
        let running_us = worker
            .ranks
            .iter()
            .map(|rank| params.cost.decode_us(rank.decode_work()))
            .collect();
        let busy = worker.ranks.iter().map(Rank::has_work).collect();
        let planned: Vec<DecodeWork> = worker.ranks.iter().map(rank_decode).collect();
        let slowest_planned_us = worker
            .groups
            .iter()
            .map(|group| {
                group
                    .ranks
                    .iter()
                    .map(|&other| params.cost.decode_us(planned[other]))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        WorkerSteps {
            running_us,
            busy,
            planned,
            slowest_planned_us,
        }
    }
}

/// The delay a request adds to the requests expected to reach its group of
/// ranks while it runs: its sequence and its KV (prompt + half its output,
/// on average) lengthen every step of the group by what they raise the
/// group's slowest decode step, and an arrival waits half a step more on
/// average.
fn later_delay(
    params: &Params,
    worker: &Worker,
    steps: &WorkerSteps,
    r: usize,
    new: &Item,
    rate_per_group: f64,
) -> Micros {
    let slowest = steps.slowest_planned_us[worker.group_of(r)];
    let mut grown = steps.planned[r];
    grown.seqs += 1;
    grown.kv_tokens += new.tokens + new.output / 2;
    let longer_step = params.cost.decode_us(grown).saturating_sub(slowest) as f64;
    let lifetime = new.output as f64 * slowest as f64;
    let arrivals = rate_per_group * lifetime / 1e6;
    (arrivals * longer_step / 2.0).round() as Micros
}

/// The (worker, rank) with the earliest projected first token, counting
/// the delay its choice imposes on later arrivals.
pub(crate) fn choose(fleet: &Fleet, now: Micros, arrival: &Arrival) -> (usize, usize) {
    let params = &fleet.params;
    let groups: usize = fleet.sglang().iter().map(|worker| worker.groups.len()).sum();
    let rate_per_group = arrival_rate(&fleet.recent_arrivals, now) / groups.max(1) as f64;
    let mut best: Option<(Score, (usize, usize))> = None;
    for (w, worker) in fleet.sglang().iter().enumerate() {
        let ready = worker.tokenizer.ready_at(params, now, arrival);
        let steps = WorkerSteps::read(params, worker);
        for (r, rank) in worker.ranks.iter().enumerate() {
            let uncached: u64 = arrival.prompts.iter().map(|prompt| uncached(rank, prompt)).sum();
            let new = Item {
                uncached,
                context: arrival.tokens().saturating_sub(uncached),
                tokens: arrival.tokens(),
                max_new: arrival.max_new_tokens * arrival.prompts.len().max(1) as u64,
                output: arrival.output_tokens(),
                not_before: ready,
            };
            let imposed = later_delay(params, worker, &steps, r, &new, rate_per_group);
            let first_token = project(params, worker, &steps, r, now, new);
            let load = rank.published.total_tokens;
            let key = (first_token + imposed, uncached, load, w, r);
            if best.as_ref().is_none_or(|(best_key, _)| key < *best_key) {
                best = Some((key, (w, r)));
            }
        }
    }
    best.map_or((0, 0), |(_, choice)| choice)
}

/// Projected time from `now` until the new request's first token on rank
/// `r` of `worker`.
fn project(
    params: &Params,
    worker: &Worker,
    steps: &WorkerSteps,
    r: usize,
    now: Micros,
    new: Item,
) -> Micros {
    let rank = &worker.ranks[r];
    let group = &worker.groups[worker.group_of(r)];
    let start = group.step.map_or(now, |(_, end)| end.max(now));
    let others = group
        .ranks
        .iter()
        .filter(|&&other| other != r && steps.busy[other])
        .map(|&other| steps.running_us[other])
        .max()
        .unwrap_or(0);
    let step = steps.running_us[r].max(others);

    let clip = params.clip;
    let mut budget = (rank.available(params) + rank.cache.evictable_size()) as f64;
    let mut slots = (rank.running.len() + rank.transferring.len()) as u64;
    // Running requests finish after their remaining tokens; each frees its
    // KV and its reservation. Keyed by decode time from `start`.
    let mut finishes: BinaryHeap<Reverse<(Micros, u64)>> = BinaryHeap::new();
    // Prompts being prefilled now join the running batch when the step
    // ends (a chunk that is not the last stays the chunked prompt).
    let joining: Vec<u64> = match &rank.plan {
        Plan::Prefill { batch, .. } | Plan::Mixed { batch, .. } => batch
            .iter()
            .filter(|(id, take)| {
                rank.seqs
                    .get(id)
                    .is_some_and(|seq| seq.computed + take >= seq.prompt.len() as u64 + seq.generated)
            })
            .map(|(id, _)| *id)
            .collect(),
        _ => Vec::new(),
    };
    slots += joining.len() as u64;
    for seq in rank
        .running
        .iter()
        .chain(&rank.transferring)
        .chain(&joining)
        .filter_map(|id| rank.seqs.get(id))
    {
        let reserved = seq.max_new.saturating_sub(seq.generated);
        budget -= reserved.min(clip) as f64 * rank.ratio;
        let remaining = seq.stop_at.saturating_sub(seq.generated);
        let kv = (seq.prompt.len() as u64 + seq.generated).max(seq.computed);
        finishes.push(Reverse((remaining * step, kv + remaining)));
    }

    let mut queue: Vec<Item> = Vec::new();
    if let Some(seq) = rank.chunked.and_then(|id| rank.seqs.get(&id)) {
        // Admitted already: only its prefill is left.
        queue.push(Item {
            uncached: seq.prompt.len() as u64 + seq.generated - seq.computed,
            context: seq.computed,
            tokens: 0,
            max_new: 0,
            output: 0,
            not_before: 0,
        });
    }
    for seq in rank.waiting.iter().filter_map(|id| rank.seqs.get(id)) {
        let uncached = seq.oracle_uncached.unwrap_or(seq.est_uncached);
        let tokens = seq.prompt.len() as u64 + seq.generated;
        queue.push(Item {
            uncached,
            context: tokens.saturating_sub(uncached),
            tokens,
            max_new: seq.max_new.saturating_sub(seq.generated),
            output: seq.stop_at.saturating_sub(seq.generated),
            not_before: 0,
        });
    }
    for queued in rank
        .pending
        .iter()
        .filter(|queued| queued.ready_at <= new.not_before)
    {
        queue.push(Item {
            uncached: queued.uncached,
            context: queued.tokens.saturating_sub(queued.uncached),
            tokens: queued.tokens,
            max_new: queued.max_new,
            output: queued.output,
            not_before: queued.ready_at,
        });
    }
    let last = queue.len();
    queue.push(new);

    let per_step = params.chunk.unwrap_or(u64::MAX).min(params.max_prefill).max(1);
    let mut t = start;
    let mut prefill_spent: Micros = 0;
    let mut open = PrefillWork::default();
    let close = |t: &mut Micros, open: &mut PrefillWork, spent: &mut Micros| {
        if open.tokens > 0 {
            let duration = params.cost.prefill_us(*open).max(others);
            *t += duration;
            *spent += duration;
            *open = PrefillWork::default();
        }
    };
    for (index, item) in queue.into_iter().enumerate() {
        let admitted_already = index == 0 && rank.chunked.is_some();
        if !admitted_already {
            let need = (item.uncached + item.max_new.min(clip) + params.page) as f64;
            while need > budget || slots >= params.max_running {
                close(&mut t, &mut open, &mut prefill_spent);
                let Some(Reverse((decode_at, freed))) = finishes.pop() else {
                    break;
                };
                t = t.max(start + decode_at + prefill_spent);
                budget += freed as f64;
                slots = slots.saturating_sub(1);
            }
            budget -= need;
            slots += 1;
        }
        if item.not_before > t {
            close(&mut t, &mut open, &mut prefill_spent);
            t = item.not_before;
        }
        let mut remaining = item.uncached.max(1);
        let mut context = item.context;
        loop {
            if open.tokens >= per_step {
                close(&mut t, &mut open, &mut prefill_spent);
            }
            let take = remaining.min(per_step - open.tokens);
            open.add(context, take);
            context += take;
            remaining -= take;
            if remaining == 0 {
                break;
            }
        }
        if index == last {
            close(&mut t, &mut open, &mut prefill_spent);
            return t.saturating_sub(now);
        }
        if item.output > 0 {
            let joined = t.saturating_sub(start + prefill_spent);
            finishes.push(Reverse((joined + item.output * step, item.tokens + item.output)));
        }
    }
    t.saturating_sub(now)
}
