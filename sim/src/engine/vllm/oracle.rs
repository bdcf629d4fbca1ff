//! The clairvoyant greedy chooser (`--dispatch oracle`) over vLLM engines:
//! fleet-wide, exact about the present, and told every answer's length. For
//! a request naming no engine it projects, on every (server, engine) of the
//! process, when the request's prompt would be computed, and picks the
//! earliest, plus the delay its sequence would add to later arrivals (as
//! the SGLang chooser does, `crate::engine::oracle`).
//!
//! The projection follows vLLM's unified steps: after the step in progress,
//! every step gives each decoding request one token and the rest of the
//! token budget to prompts, in queue order (the rest of partial prefills,
//! then waiting prompts minus what the cache holds for them, then requests
//! placed there still in the tokenizer, then this one); a step costs what
//! the cost model says for its prefill chunks and decodes (under lockstep,
//! at least the other engines' decode steps). If the blocks free now
//! cannot hold the prompts ahead and this one, it waits for running
//! requests to finish, shortest answer left first. Preemption and requests
//! joining the decodes while it waits are not projected.

use std::collections::VecDeque;

use super::engine::Engine;
use super::worker::Worker;
use crate::engine::cost::{DecodeWork, PrefillWork};
use crate::engine::oracle::arrival_rate;
use crate::engine::{Arrival, Micros, Params};

/// How candidates compare: projected first token plus the delay imposed on
/// later arrivals, uncached tokens, requests on the engine, server, engine.
type Score = (Micros, u64, u64, usize, usize);

/// One prompt (or the rest of one) waiting for the budget.
struct Item {
    tokens: u64,
    context: u64,
    not_before: Micros,
}

/// What an engine's decode step reads after the step in progress.
fn decode_work(engine: &Engine) -> DecodeWork {
    let mut work = DecodeWork::default();
    for request in engine.running.iter().filter_map(|id| engine.reqs.get(id)) {
        if request.generated > 0 || request.computed + 1 >= request.num_tokens() {
            work.seqs += 1;
            work.kv_tokens += request.num_tokens();
        }
    }
    work
}

/// The delay placing the request here adds to later arrivals of the group:
/// its sequence and KV lengthen the group's slowest decode step for its
/// whole answer; arrivals meanwhile wait half of that on average.
fn later_delay(
    params: &Params,
    worker: &Worker,
    index: usize,
    tokens: u64,
    output: u64,
    rate_per_group: f64,
) -> Micros {
    let group = &worker.groups[worker.group_of(index)];
    let slowest = group
        .ranks
        .iter()
        .map(|&other| params.cost.decode_us(decode_work(&worker.engines[other])))
        .max()
        .unwrap_or(0);
    let mut grown = decode_work(&worker.engines[index]);
    grown.seqs += 1;
    grown.kv_tokens += tokens + output / 2;
    let longer = params.cost.decode_us(grown).saturating_sub(slowest) as f64;
    let lifetime = output as f64 * slowest as f64;
    let arrivals = rate_per_group * lifetime / 1e6;
    (arrivals * longer / 2.0).round() as Micros
}

/// Projected time from `now` until the prompt of `arrival` is computed on
/// `index` of `worker` (its first token), given `uncached` tokens to compute.
fn project(
    params: &Params,
    worker: &Worker,
    index: usize,
    now: Micros,
    ready: Micros,
    tokens: u64,
    uncached: u64,
) -> Micros {
    let engine = &worker.engines[index];
    let group = &worker.groups[worker.group_of(index)];
    let start = group.step.map_or(now, |(_, end)| end.max(now));
    let others = group
        .ranks
        .iter()
        .filter(|&&other| other != index && worker.engines[other].has_work())
        .map(|&other| params.cost.decode_us(decode_work(&worker.engines[other])))
        .max()
        .unwrap_or(0);
    let decode = decode_work(engine);
    let planned = |id| {
        engine
            .plan
            .as_ref()
            .and_then(|plan| plan.scheduled.iter().find(|(other, _, _)| *other == id))
            .map_or(0, |(_, new, _)| *new)
    };
    let mut queue: VecDeque<Item> = VecDeque::new();
    for &id in &engine.running {
        let Some(request) = engine.reqs.get(&id) else {
            continue;
        };
        let done = request.computed + planned(id);
        let left = request.num_tokens().saturating_sub(done);
        if left > 1 || request.generated == 0 && left > 0 {
            queue.push_back(Item {
                tokens: left,
                context: done,
                not_before: 0,
            });
        }
    }
    for request in engine.waiting.iter().filter_map(|id| engine.reqs.get(id)) {
        let uncached = request
            .oracle_uncached
            .unwrap_or(request.num_tokens())
            .min(request.num_tokens());
        queue.push_back(Item {
            tokens: uncached.max(1),
            context: request.num_tokens().saturating_sub(uncached),
            not_before: 0,
        });
    }
    for queued in engine.pending.iter().filter(|queued| queued.ready_at <= ready) {
        queue.push_back(Item {
            tokens: queued.uncached.max(1),
            context: queued.tokens.saturating_sub(queued.uncached),
            not_before: queued.ready_at,
        });
    }
    let ahead: u64 = queue.iter().map(|item| item.tokens).sum();
    queue.push_back(Item {
        tokens: uncached.max(1),
        context: tokens.saturating_sub(uncached),
        not_before: ready,
    });

    let mut t = start;
    // KV: wait for running requests to finish while the free blocks cannot
    // hold the prompts ahead and this one.
    let need = (ahead + uncached).div_ceil(params.block_size.max(1));
    let mut free = engine.pool.free_blocks();
    if need > free {
        let step = params.cost.decode_us(decode).max(others);
        let mut finishing: Vec<(u64, u64)> = engine
            .running
            .iter()
            .filter_map(|id| engine.reqs.get(id))
            .map(|request| {
                (
                    request.stop_at.saturating_sub(request.generated),
                    request.blocks.len() as u64,
                )
            })
            .collect();
        finishing.sort_unstable();
        for (left, blocks) in finishing {
            t = t.max(start + left * step);
            free += blocks;
            if free >= need {
                break;
            }
        }
    }
    let per_step = params.max_batched.saturating_sub(decode.seqs).max(1);
    let mut open = PrefillWork::default();
    let close = |t: &mut Micros, open: &mut PrefillWork| {
        let duration = params.cost.mixed_us(*open, decode).max(others);
        *t += duration;
        *open = PrefillWork::default();
    };
    let last = queue.len() - 1;
    for (position, mut item) in queue.into_iter().enumerate() {
        if item.not_before > t {
            if open.tokens > 0 {
                close(&mut t, &mut open);
            }
            t = t.max(item.not_before);
        }
        loop {
            if open.tokens >= per_step {
                close(&mut t, &mut open);
            }
            let take = item.tokens.min(per_step - open.tokens);
            open.add(item.context, take);
            item.context += take;
            item.tokens -= take;
            if item.tokens == 0 {
                break;
            }
        }
        if position == last {
            close(&mut t, &mut open);
        }
    }
    t.saturating_sub(now)
}

/// The (server, engine) with the earliest projected first token, counting
/// the delay the choice imposes on later arrivals.
pub(crate) fn choose(
    params: &Params,
    workers: &[Worker],
    recent: &VecDeque<Micros>,
    now: Micros,
    arrival: &Arrival,
) -> (usize, usize) {
    let groups: usize = workers.iter().map(|worker| worker.groups.len()).sum();
    let rate_per_group = arrival_rate(recent, now) / groups.max(1) as f64;
    let tokens = arrival.tokens();
    let output = arrival.output_tokens();
    let mut best: Option<(Score, (usize, usize))> = None;
    for (w, worker) in workers.iter().enumerate() {
        let ready = worker.tokenizer.ready_at(params, now, arrival);
        for (e, engine) in worker.engines.iter().enumerate() {
            let uncached: u64 = arrival
                .prompts
                .iter()
                .map(|prompt| prompt.len() as u64 - engine.cached_prefix(params, prompt))
                .sum();
            let first = project(params, worker, e, now, ready, tokens, uncached);
            let imposed = later_delay(params, worker, e, tokens, output, rate_per_group);
            let (waiting, running) = engine.counts();
            let key = (first + imposed, uncached, waiting + running, w, e);
            if best.as_ref().is_none_or(|(best_key, _)| key < *best_key) {
                best = Some((key, (w, e)));
            }
        }
    }
    best.map_or((0, 0), |(_, choice)| choice)
}

/// Uncached tokens of each prompt on an engine, as the chooser projects
/// them when it places a request there.
pub(crate) fn uncached(params: &Params, engine: &Engine, prompt: &[u32]) -> u64 {
    prompt.len() as u64 - engine.cached_prefix(params, prompt)
}
