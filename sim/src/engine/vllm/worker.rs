//! One simulated vLLM server (`vllm serve --data-parallel-size N`): its
//! engines, how they step (each on its own for a dense model; together for
//! an MoE model under expert parallelism, where an engine with nothing to
//! do runs a dummy batch so the others' collective layers can proceed), its
//! tokenizer and its internal balancer.

use super::balancer::Balancer;
use super::engine::Engine;
use crate::engine::cost::StepWork;
use crate::engine::worker::{groups, mix, Group, GroupedRanks, TokenizerQueue};
use crate::engine::{Event, Micros, Params};

#[derive(Debug)]
pub(crate) struct Worker {
    pub engines: Vec<Engine>,
    pub groups: Vec<Group>,
    lockstep: bool,
    pub tokenizer: TokenizerQueue,
    pub balancer: Balancer,
    /// Requests received so far (which API process takes the next one).
    received: u64,
}

impl Worker {
    /// Server `index` of the fleet.
    pub fn new(params: &Params, index: usize) -> Self {
        let dp = params.dp_size;
        Self {
            engines: (0..dp).map(|_| Engine::new(params)).collect(),
            groups: groups(params, index),
            lockstep: params.lockstep,
            tokenizer: TokenizerQueue::default(),
            balancer: Balancer::new(params.vllm_version, dp, params.api_servers, params.engines_report),
            received: 0,
        }
    }

    pub fn group_of(&self, engine: usize) -> usize {
        if self.lockstep {
            0
        } else {
            engine
        }
    }

    /// The API process the next request reaches.
    pub fn next_client(&mut self) -> usize {
        self.received += 1;
        let clients = self.balancer.clients() as u64;
        if clients <= 1 {
            0
        } else {
            (mix(self.received) % clients) as usize
        }
    }

    /// Ends the group's step: tokens, finishes, reports.
    pub fn end_step(&mut self, params: &Params, group: usize, now: Micros, out: &mut Vec<Event>) {
        let Some(state) = self.groups.get_mut(group) else {
            return;
        };
        state.step = None;
        for index in state.ranks.clone() {
            let engine = &mut self.engines[index];
            for left in engine.end_step(params, now, out) {
                self.balancer.left(left.client, index);
            }
            let (waiting, running) = engine.counts();
            let kv = engine.pool.usage();
            self.balancer.report(now, index, waiting, running, kv);
        }
    }
}

impl GroupedRanks for Worker {
    fn groups_mut(&mut self) -> &mut [Group] {
        &mut self.groups
    }

    /// Where the balancer hears from engines before their steps (0.34),
    /// the engine reports first.
    fn plan_rank(
        &mut self,
        params: &Params,
        index: usize,
        now: Micros,
        out: &mut Vec<Event>,
    ) -> Option<StepWork> {
        let engine = &mut self.engines[index];
        if self.balancer.reports_before_step() {
            let (waiting, running) = engine.counts();
            let kv = engine.pool.usage();
            self.balancer.report(now, index, waiting, running, kv);
        }
        engine
            .plan_step(params, now, out)
            .map(|(prefill, decode)| StepWork { prefill, decode })
    }

    fn idle_rank(&mut self, _params: &Params, index: usize, now: Micros) {
        self.engines[index].publish(now);
    }
}
