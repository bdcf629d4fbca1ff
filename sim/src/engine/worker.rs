//! One simulated server: its ranks, how they step (together under DP
//! attention, or each on its own) and what a step costs, its tokenizer, its
//! DP controller and SGLang's prefill delayer.

use super::cost::StepWork;
use super::rank::{Plan, Rank};
use super::{Arrival, Event, Micros, Params};
use crate::config::Dispatch;

/// How often the DP controller re-reads the published loads
/// (data_parallel_controller.py `refresh_load_budget`: at most every 20 ms).
const BUDGET_REFRESH: Micros = 20_000;

/// Ranks that step together: all of them under lockstep, else one each.
#[derive(Debug)]
pub(crate) struct Group {
    pub ranks: Vec<usize>,
    /// The step in progress: (start, end).
    pub step: Option<(Micros, Micros)>,
    /// Seeds the group's step-time noise (from the noise seed, the server
    /// and the group).
    noise_key: u64,
    /// Steps begun: the noise's counter.
    steps: u64,
    /// Prefill delayer: passes held back in a row.
    delayed: u32,
}

/// SplitMix64: a deterministic stream of well-mixed 64-bit values (the
/// step noise; vLLM's spread of requests over API processes, as the kernel
/// spreads connections over processes sharing a port).
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A uniform draw in [0, 1) from 53 bits of `x`.
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

impl Group {
    /// How much longer than modelled rank `rank`'s part of the current step
    /// takes: 1 without noise, else a draw fixed by the seed, the group,
    /// the step and the rank.
    fn slowdown(&self, params: &Params, rank: usize) -> f64 {
        let noise = &params.noise;
        if noise.is_none() {
            return 1.0;
        }
        let base = mix(self.noise_key ^ mix(self.steps) ^ mix(rank as u64).rotate_left(17));
        let (a, b, c) = (mix(base), mix(base ^ 1), mix(base ^ 2));
        // Box-Muller: a standard normal from two uniforms.
        let normal = (-2.0 * (1.0 - unit(a)).ln()).sqrt() * (std::f64::consts::TAU * unit(b)).cos();
        noise.factor(normal, unit(c))
    }
}

/// SGLang's `DPBudget`: the controller's view of each rank's load, the
/// published snapshots plus what it sent since.
#[derive(Debug)]
struct Budget {
    requests: Vec<u64>,
    tokens: Vec<u64>,
    seen: Vec<Option<Micros>>,
    last_refresh: Option<Micros>,
}

/// A server's tokenizer: one request after the other, each taking a fixed
/// delay plus a time per prompt token (none for token ids).
#[derive(Debug, Default)]
pub(crate) struct TokenizerQueue {
    /// When it is next free.
    free: Micros,
}

impl TokenizerQueue {
    /// When it would be done with a request arriving now.
    pub fn ready_at(&self, params: &Params, now: Micros, arrival: &Arrival) -> Micros {
        let per_token = if arrival.pretokenized {
            0.0
        } else {
            params.tokenizer_us_per_token * arrival.tokens() as f64
        };
        now.max(self.free) + (params.tokenizer_base_us + per_token).round() as Micros
    }

    /// Queues a request; returns when it is done.
    pub fn take(&mut self, params: &Params, now: Micros, arrival: &Arrival) -> Micros {
        let ready = self.ready_at(params, now, arrival);
        self.free = ready;
        ready
    }
}

/// Ranks that step together: all of them under lockstep, else one each;
/// `server` (its index in the fleet) seeds their noise.
pub(crate) fn groups(params: &Params, server: usize) -> Vec<Group> {
    let dp = params.dp_size;
    let sets: Vec<Vec<usize>> = if params.lockstep {
        vec![(0..dp).collect()]
    } else {
        (0..dp).map(|rank| vec![rank]).collect()
    };
    sets.into_iter()
        .enumerate()
        .map(|(index, ranks)| Group {
            ranks,
            step: None,
            noise_key: mix(params.noise_seed ^ mix(server as u64) ^ mix(index as u64).rotate_left(29)),
            steps: 0,
            delayed: 0,
        })
        .collect()
}

/// A server's ranks (vLLM: engines) and the groups they step in: what
/// `begin_step`, shared by SGLang workers and vLLM servers, asks of them.
pub(crate) trait GroupedRanks {
    fn groups_mut(&mut self) -> &mut [Group];

    /// Plans the next step of rank `index`; the work it puts in the step,
    /// or None when the rank has nothing to do.
    fn plan_rank(
        &mut self,
        params: &Params,
        index: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<StepWork>;

    /// Before a group plans its step (SGLang's prefill delayer).
    fn before_step(&mut self, _params: &Params, _group: usize) {}

    /// Rank `index` has nothing to do, nor has any rank of its group: it
    /// publishes its idle state.
    fn idle_rank(&mut self, params: &Params, index: usize, now: Micros);

    /// Plans one step of a group; its duration, or None when every rank of
    /// the group is idle. The step lasts as long as the slowest rank's own
    /// part, an idle rank waiting too (DP attention; a vLLM engine with
    /// nothing to do runs a dummy batch, the cheapest step), plus the
    /// routed experts' work of all ranks spread over the group
    /// (`CostModel::group_us`).
    fn begin_step(
        &mut self,
        params: &Params,
        group: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<Micros> {
        let ranks = self.groups_mut().get(group)?.ranks.clone();
        self.before_step(params, group);
        let mut works = Vec::new();
        let mut busy = Vec::new();
        for &index in &ranks {
            if let Some(work) = self.plan_rank(params, index, now, out) {
                works.push(work);
                busy.push(index);
            }
        }
        let state = &mut self.groups_mut()[group];
        state.steps += 1;
        let state = &*state;
        let duration = params
            .cost
            .group_us(ranks.len(), &works, |at| state.slowdown(params, busy[at]));
        match duration {
            Some(duration) => {
                self.groups_mut()[group].step = Some((now, now + duration));
                Some(duration)
            }
            None => {
                for &index in &ranks {
                    self.idle_rank(params, index, now);
                }
                None
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct Worker {
    pub ranks: Vec<Rank>,
    pub groups: Vec<Group>,
    lockstep: bool,
    pub tokenizer: TokenizerQueue,
    round_robin: usize,
    budget: Budget,
}

impl Worker {
    /// Server `index` of the fleet.
    pub fn new(params: &Params, index: usize) -> Self {
        let dp = params.dp_size;
        Self {
            ranks: (0..dp).map(|_| Rank::new(params)).collect(),
            groups: groups(params, index),
            lockstep: params.lockstep,
            tokenizer: TokenizerQueue::default(),
            round_robin: 0,
            budget: Budget {
                requests: vec![0; dp],
                tokens: vec![0; dp],
                seen: vec![None; dp],
                last_refresh: None,
            },
        }
    }

    pub fn group_of(&self, rank: usize) -> usize {
        if self.lockstep {
            0
        } else {
            rank
        }
    }

    /// The DP controller's choice for a request naming no rank.
    pub fn choose_rank(&mut self, params: &Params, now: Micros, arrival: &Arrival) -> usize {
        let dp = self.ranks.len().max(1);
        match params.dispatch {
            Dispatch::RoomModulo if arrival.room.is_some() => {
                (arrival.room.unwrap_or(0) % dp as u64) as usize
            }
            Dispatch::TotalTokens | Dispatch::TotalRequests => {
                self.refresh_budget(now);
                let budget = &mut self.budget;
                let rank = if params.dispatch == Dispatch::TotalRequests {
                    (0..dp).min_by_key(|&r| (budget.requests[r], r)).unwrap_or(0)
                } else {
                    (0..dp)
                        .min_by_key(|&r| (budget.tokens[r], budget.requests[r], r))
                        .unwrap_or(0)
                };
                budget.requests[rank] += 1;
                budget.tokens[rank] += arrival.tokens();
                rank
            }
            _ => {
                let rank = self.round_robin % dp;
                self.round_robin = (self.round_robin + 1) % dp;
                rank
            }
        }
    }

    /// Re-reads the published snapshots, at most every 20 ms, skipping a
    /// rank whose snapshot has not changed (its increments then stay).
    fn refresh_budget(&mut self, now: Micros) {
        if self
            .budget
            .last_refresh
            .is_some_and(|last| now < last + BUDGET_REFRESH)
        {
            return;
        }
        self.budget.last_refresh = Some(now);
        for (index, rank) in self.ranks.iter().enumerate() {
            let snapshot = &rank.published;
            if self.budget.seen[index] == Some(snapshot.at) {
                continue;
            }
            self.budget.seen[index] = Some(snapshot.at);
            self.budget.requests[index] = snapshot.running + snapshot.waiting;
            self.budget.tokens[index] = snapshot.total_tokens;
        }
    }

    /// Ends the group's step: tokens, finishes, published loads.
    pub fn end_step(&mut self, params: &Params, group: usize, now: Micros, out: &mut Vec<Event>) {
        let Some(state) = self.groups.get_mut(group) else {
            return;
        };
        let start = state.step.take().map_or(now, |(start, _)| start);
        for index in state.ranks.clone() {
            self.ranks[index].end_step(params, start, now, out);
        }
    }
}

impl GroupedRanks for Worker {
    fn groups_mut(&mut self) -> &mut [Group] {
        &mut self.groups
    }

    fn plan_rank(
        &mut self,
        params: &Params,
        index: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<StepWork> {
        match self.ranks[index].plan_step(params, now, out) {
            Plan::Idle => None,
            Plan::Prefill { work, .. } => Some(StepWork::prefill(work)),
            Plan::Decode(work) => Some(StepWork::decode(work)),
            Plan::Mixed { work, decode, .. } => Some(StepWork {
                prefill: work,
                decode,
            }),
        }
    }

    /// SGLang's `PrefillDelayer` (managers/prefill_delayer.py): each pass
    /// the ranks tell each other whether they could prefill; when some could
    /// and others could not, those that could hold their new prefills back
    /// (decoding instead) for up to `max_delay_passes - 1` passes in a row,
    /// so that the ranks prefill together; a rank whose KV usage is under
    /// the low watermark, if one is set, ends the wait. A pass in which no
    /// rank would run anything is not held: SGLang's idle loop spins
    /// through such passes at once.
    fn before_step(&mut self, params: &Params, group: usize) {
        if !params.prefill_delayer {
            return;
        }
        let Some(state) = self.groups.get(group) else {
            return;
        };
        let ranks = state.ranks.clone();
        let prefillable: Vec<bool> = ranks
            .iter()
            .map(|&index| self.ranks[index].would_prefill(params))
            .collect();
        let mixed = prefillable.iter().any(|p| *p) && !prefillable.iter().all(|p| *p);
        let watermark = params.prefill_delayer_watermark.is_some_and(|mark| {
            ranks
                .iter()
                .zip(&prefillable)
                .any(|(&index, &p)| p && self.ranks[index].token_usage(params) < mark)
        });
        let busy_anyway = ranks
            .iter()
            .any(|&index| self.ranks[index].busy_without_new_prefill());
        let state = &mut self.groups[group];
        let hold =
            if mixed && !watermark && busy_anyway && state.delayed + 1 < params.prefill_delayer_max_passes {
                state.delayed += 1;
                true
            } else {
                state.delayed = 0;
                false
            };
        for index in ranks {
            self.ranks[index].hold_prefill = hold;
        }
    }

    fn idle_rank(&mut self, params: &Params, index: usize, now: Micros) {
        self.ranks[index].idle(params, now);
    }
}
