//! One simulated server: its ranks, how they step (together under DP
//! attention, or each on its own), its tokenizer and its DP controller.

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

/// Ranks that step together: all of them under lockstep, else one each.
pub(crate) fn groups(dp: usize, lockstep: bool) -> Vec<Group> {
    if lockstep {
        vec![Group {
            ranks: (0..dp).collect(),
            step: None,
        }]
    } else {
        (0..dp)
            .map(|rank| Group {
                ranks: vec![rank],
                step: None,
            })
            .collect()
    }
}

/// A server's ranks (vLLM: engines) and the groups they step in: what
/// `begin_step`, shared by SGLang workers and vLLM servers, asks of them.
pub(crate) trait GroupedRanks {
    fn groups_mut(&mut self) -> &mut [Group];

    /// Plans the next step of rank `index`; its duration, or None when the
    /// rank has nothing to do.
    fn plan_rank(
        &mut self,
        params: &Params,
        index: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<Micros>;

    /// Rank `index` has nothing to do, nor has any rank of its group: it
    /// publishes its idle state.
    fn idle_rank(&mut self, params: &Params, index: usize, now: Micros);

    /// Plans one step of a group; its duration, or None when every rank of
    /// the group is idle. The step lasts as long as the slowest rank's, an
    /// idle rank waiting too (DP attention; a vLLM engine with nothing to
    /// do runs a dummy batch, the cheapest step).
    fn begin_step(
        &mut self,
        params: &Params,
        group: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<Micros> {
        let ranks = self.groups_mut().get(group)?.ranks.clone();
        let mut longest = None;
        for &index in &ranks {
            longest = longest.max(self.plan_rank(params, index, now, out));
        }
        match longest {
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
    pub fn new(params: &Params) -> Self {
        let dp = params.dp_size;
        Self {
            ranks: (0..dp).map(|_| Rank::new(params)).collect(),
            groups: groups(dp, params.lockstep),
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
    ) -> Option<Micros> {
        match self.ranks[index].plan_step(params, now, out) {
            Plan::Idle => None,
            Plan::Prefill { work, .. } => Some(params.cost.prefill_us(work)),
            Plan::Decode(work) => Some(params.cost.decode_us(work)),
        }
    }

    fn idle_rank(&mut self, params: &Params, index: usize, now: Micros) {
        self.ranks[index].idle(params, now);
    }
}
