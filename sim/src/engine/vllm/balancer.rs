//! vLLM's internal balancer over the engines of one server
//! (`DPLBAsyncMPClient.get_core_engine_for_request`,
//! vllm/v1/engine/core_client.py) and the DP coordinator that feeds it
//! (vllm/v1/engine/coordinator.py).
//!
//! Engines report their (waiting, running) counts to the coordinator when
//! they change; the coordinator publishes every engine's counts to the API
//! server processes at most every 100 ms when something changed, else every
//! 5 s; each API process replaces its view with what it receives and, between
//! publications, adds its own picks to the chosen engine's waiting count.
//! Which engines report, and the rule, depend on the release:
//!
//! - 0.14: only MoE engines (DP with expert parallelism, stepping together)
//!   report, after each step; a dense model's engines run as independent
//!   servers that report nothing, so the coordinator publishes zeros every
//!   5 s and the balancer sees only its own picks since then. Score
//!   `waiting * 4 + running`, the scan starting at the process's own offset
//!   every time (engine 0 with one API process), the first lowest wins.
//! - 0.34: every engine reports before and after each step, with its KV
//!   usage. Score `max(clients x in flight, waiting + running)`, plus
//!   `waiting x 6 x max(0, kv usage - 0.5)` when requests wait; the scan
//!   start rotates after each pick; in flight = this process's requests on
//!   the engine not yet finished.

use crate::config::VllmVersion;
use crate::engine::Micros;

/// The coordinator's publication interval while counts change.
pub const PUBLISH_INTERVAL: Micros = 100_000;
/// Its interval while nothing changes.
pub const IDLE_PUBLISH_INTERVAL: Micros = 5_000_000;

/// One engine's counts as the balancer sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counts {
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: f64,
}

/// One API server process's balancer.
#[derive(Debug, Clone)]
struct Client {
    view: Vec<Counts>,
    inflight: Vec<u64>,
    start: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct Balancer {
    version: VllmVersion,
    /// Whether the engines report their counts to the coordinator.
    engines_report: bool,
    /// The coordinator's latest counts per engine.
    reported: Vec<Counts>,
    /// When counts first changed since the last publication.
    changed_at: Option<Micros>,
    last_publish: Micros,
    clients: Vec<Client>,
}

impl Balancer {
    pub fn new(version: VllmVersion, engines: usize, clients: usize, engines_report: bool) -> Self {
        let clients = clients.max(1);
        let engines = engines.max(1);
        Self {
            version,
            engines_report,
            reported: vec![Counts::default(); engines],
            changed_at: None,
            last_publish: 0,
            clients: (0..clients)
                .map(|index| Client {
                    view: vec![Counts::default(); engines],
                    inflight: vec![0; engines],
                    // `eng_start_index = engines * client_index // clients`.
                    start: engines * index / clients,
                })
                .collect(),
        }
    }

    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Whether engines report before their step as well (0.34).
    pub fn reports_before_step(&self) -> bool {
        self.engines_report && self.version == VllmVersion::V0_34
    }

    /// Publications due by `now` (each replaces every API process's view).
    fn catch_up(&mut self, now: Micros) {
        loop {
            match self.changed_at {
                Some(changed) => {
                    let due = changed.max(self.last_publish + PUBLISH_INTERVAL);
                    if due > now {
                        return;
                    }
                    self.publish(due);
                }
                None => {
                    if now < self.last_publish + IDLE_PUBLISH_INTERVAL {
                        return;
                    }
                    let periods = (now - self.last_publish) / IDLE_PUBLISH_INTERVAL;
                    let due = self.last_publish + periods * IDLE_PUBLISH_INTERVAL;
                    self.publish(due);
                    return;
                }
            }
        }
    }

    fn publish(&mut self, at: Micros) {
        self.last_publish = at;
        self.changed_at = None;
        for client in &mut self.clients {
            client.view.clone_from(&self.reported);
        }
    }

    /// An engine reports its counts at `now` (if engines report at all;
    /// only a change of waiting or running counts is sent).
    pub fn report(&mut self, now: Micros, engine: usize, waiting: u64, running: u64, kv_usage: f64) {
        if !self.engines_report {
            return;
        }
        self.catch_up(now);
        let Some(current) = self.reported.get_mut(engine) else {
            return;
        };
        let counts = Counts {
            waiting: waiting as f64,
            running: running as f64,
            kv_usage,
        };
        if current.waiting != counts.waiting || current.running != counts.running {
            *current = counts;
            self.changed_at.get_or_insert(now);
        }
    }

    /// The engine for a request naming none, sent by API process `client`.
    pub fn choose(&mut self, now: Micros, client: usize) -> usize {
        self.catch_up(now);
        let version = self.version;
        let clients = self.clients.len() as f64;
        let Some(state) = self.clients.get_mut(client) else {
            return 0;
        };
        let engines = state.view.len();
        let mut best = 0;
        let mut best_score = f64::INFINITY;
        for i in 0..engines {
            let index = (state.start + i) % engines;
            let counts = state.view[index];
            let score = match version {
                VllmVersion::V0_14 => counts.waiting * 4.0 + counts.running,
                VllmVersion::V0_34 => {
                    let inflight = clients * state.inflight[index] as f64;
                    let mut score = inflight.max(counts.waiting + counts.running);
                    if counts.waiting > 0.0 {
                        score += counts.waiting * 6.0 * (counts.kv_usage - 0.5).max(0.0);
                    }
                    score
                }
            };
            if score < best_score {
                best_score = score;
                best = index;
            }
        }
        state.view[best].waiting += clients;
        if version == VllmVersion::V0_34 {
            state.start = (state.start + 1) % engines;
        }
        best
    }

    /// A request was placed on `engine` by process `client` (chosen or
    /// pinned): it is in flight there until it leaves.
    pub fn placed(&mut self, client: usize, engine: usize, seqs: u64) {
        if let Some(count) = self
            .clients
            .get_mut(client)
            .and_then(|c| c.inflight.get_mut(engine))
        {
            *count += seqs;
        }
    }

    /// A sequence of process `client` left `engine`.
    pub fn left(&mut self, client: usize, engine: usize) {
        if let Some(count) = self
            .clients
            .get_mut(client)
            .and_then(|c| c.inflight.get_mut(engine))
        {
            *count = count.saturating_sub(1);
        }
    }

    /// Process `client`'s view of the engines now (tests).
    #[cfg(test)]
    pub fn view(&mut self, now: Micros, client: usize) -> Vec<Counts> {
        self.catch_up(now);
        self.clients
            .get(client)
            .map(|c| c.view.clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v0_14_without_reports_spreads_by_its_own_picks_and_forgets_them_every_5_s() {
        let mut lb = Balancer::new(VllmVersion::V0_14, 3, 1, false);
        // No counts ever: its own increments make it a round robin from 0.
        let picks: Vec<usize> = (0..6).map(|i| lb.choose(1000 + i, 0)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        // Engine 0 gets one more, then the 5 s publication of zeros resets.
        assert_eq!(lb.choose(2000, 0), 0);
        assert_eq!(lb.choose(3000, 0), 1);
        assert_eq!(lb.choose(5_000_000, 0), 0);
        assert_eq!(lb.choose(5_000_001, 0), 1);
    }

    #[test]
    fn v0_14_scores_waiting_four_times_running_from_published_counts() {
        let mut lb = Balancer::new(VllmVersion::V0_14, 3, 1, true);
        lb.report(0, 0, 0, 5, 0.1);
        lb.report(0, 1, 1, 0, 0.1);
        lb.report(0, 2, 0, 3, 0.1);
        // Not published yet: the view is all zeros, engine 0 wins ties.
        assert_eq!(lb.choose(50_000, 0), 0);
        // Published at 100 ms (the first publication was at 0).
        let view = lb.view(100_000, 0);
        assert_eq!(view[1].waiting, 1.0);
        // Scores: 0 -> 5, 1 -> 4, 2 -> 3.
        assert_eq!(lb.choose(100_000, 0), 2);
        // Its own pick counts as waiting: 2 -> 7 now; 1 -> 4.
        assert_eq!(lb.choose(100_001, 0), 1);
        // A change is published no sooner than 100 ms after the last one.
        lb.report(150_000, 0, 0, 0, 0.0);
        assert_eq!(lb.view(199_999, 0)[0].running, 5.0);
        assert_eq!(lb.view(200_000, 0)[0].running, 0.0);
    }

    #[test]
    fn v0_34_counts_in_flight_penalises_waiting_under_kv_pressure_and_rotates() {
        let mut lb = Balancer::new(VllmVersion::V0_34, 2, 1, true);
        // Equal views: the start rotates, so picks alternate.
        assert_eq!(lb.choose(10, 0), 0);
        lb.placed(0, 0, 1);
        assert_eq!(lb.choose(11, 0), 1);
        lb.placed(0, 1, 1);
        // Engine 0: 2 waiting at 90% KV: 2 + 2 x 6 x 0.4 = 6.8; engine 1: 4 running.
        lb.report(200_000, 0, 2, 0, 0.9);
        lb.report(200_000, 1, 0, 4, 0.9);
        assert_eq!(lb.choose(300_000, 0), 1);
        // In flight counts when the published counts are lower.
        let mut lb = Balancer::new(VllmVersion::V0_34, 2, 1, true);
        lb.placed(0, 0, 3);
        assert_eq!(lb.choose(1, 0), 1);
        lb.left(0, 0);
        lb.left(0, 0);
        lb.left(0, 0);
    }

    #[test]
    fn several_api_processes_start_their_scans_at_their_own_offsets() {
        let mut lb = Balancer::new(VllmVersion::V0_14, 4, 2, false);
        assert_eq!(lb.clients(), 2);
        assert_eq!(lb.choose(1, 0), 0);
        assert_eq!(lb.choose(1, 1), 2);
        // Each process adds the number of processes to its own pick.
        assert_eq!(lb.view(2, 1)[2].waiting, 2.0);
    }
}
