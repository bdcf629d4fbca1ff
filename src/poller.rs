//! Load polling: one poller per Envoy process, elected through a lease in
//! shared data, sends one load request per worker per interval (what to
//! request, and what the answer means, is the load source's: `load/`) and
//! stores the snapshots where every thread's router reads them.

mod report;

use crate::config::{Config, Discovery, Worker};
use crate::discovery;
use crate::health_updates;
use crate::host::{Callout, CalloutError, CalloutResponse, Host};
use crate::load::{Answer, LoadReport, LoadSource, Poll, Reading, Source};
use crate::metrics::{self, PerWorker};
use crate::shared_data::{self, IfMissing, Members};
use hashbrown::{HashMap, HashSet};
use report::{apply_report, refuse};
use std::net::SocketAddr;

/// Header that tells the ORIGINAL_DST poll cluster which host to connect to.
pub const POLL_DESTINATION_HEADER: &str = "x-envoy-original-dst-host";

/// A load poll in flight.
#[derive(Debug, Clone, Copy)]
struct LoadCall {
    worker: SocketAddr,
    seq: u64,
    poll: Poll,
    /// A worker with one port per rank, polled port by port: the rank index
    /// this port answers for (None: the worker's whole report).
    part: Option<u32>,
}

/// The answers of one poll of a worker polled port by port, as they come.
#[derive(Debug, Default)]
struct Parts {
    /// By rank index: the port's report, or why it has none.
    answers: Vec<Option<Result<LoadReport, String>>>,
}

#[derive(Debug, Clone, Copy)]
enum Call {
    Load(LoadCall),
    /// The admin API's cluster listing (workers taken from a cluster).
    Membership,
    /// The admin API's cluster listing (`envoy_health`: its hosts' health).
    EnvoyHealth,
}

/// Per-VM poller state. Workers are keyed by address, so a membership change
/// between a poll and its answer cannot misfile the answer.
pub struct Poller {
    /// This VM's identity in the lease (0 until assigned).
    vm_id: u64,
    /// When this poller's configuration was applied (ms since the epoch).
    generation: u64,
    outstanding: HashMap<u32, Call>,
    /// Whether the last poll of each worker succeeded, to log changes only.
    healthy: HashMap<SocketAddr, bool>,
    /// Prefix index keys this VM knows exist. A shared-data key, once
    /// written, is never absent again (proxy-wasm has no delete), so each is
    /// checked once per VM instead of copying the whole index at every poll.
    indexes: HashSet<String>,
    /// Polls of workers polled port by port, by (worker, poll sequence).
    parts: HashMap<(SocketAddr, u64), Parts>,
}

/// How often every thread's root context ticks: fine enough for sub-second
/// intervals and quick lease takeover, coarse enough to cost nothing.
pub fn tick_period_ms(config: &Config) -> u64 {
    (config.poll_interval_ms / 4).clamp(25, 250)
}

fn lease_ttl_ms(config: &Config) -> u64 {
    4 * tick_period_ms(config)
}

impl Poller {
    /// `configured_at_ms`: when the plugin configuration was applied; the
    /// newest configuration's pollers take over the lease from older ones.
    pub fn new(configured_at_ms: u64) -> Poller {
        Poller {
            vm_id: 0,
            generation: configured_at_ms,
            outstanding: HashMap::new(),
            healthy: HashMap::new(),
            indexes: HashSet::new(),
            parts: HashMap::new(),
        }
    }

    /// A number unique to this VM among those sharing the data (also a tie-break salt).
    pub fn vm_id(&mut self, config: &Config, host: &dyn Host) -> u64 {
        if self.vm_id == 0 {
            self.vm_id = shared_data::next_vm_id(config, host);
        }
        self.vm_id
    }

    /// Takes or renews the lease; true when this VM holds it and a round is due.
    fn lease_round_due(&mut self, config: &Config, host: &dyn Host) -> bool {
        let me = self.vm_id(config, host);
        me != 0 && shared_data::claim_poll_round(config, host, me, self.generation, lease_ttl_ms(config))
    }

    /// Creates worker `index`'s prefix index at its first poll answered here
    /// (`shared_data::create_index`), then no more reads of it.
    fn create_index(&mut self, config: &Config, host: &dyn Host, index: usize, w: &Worker) {
        if config.prefix.is_none() {
            return;
        }
        let key = shared_data::Keys::of(config).prefix_index(&w.address);
        if !self.indexes.contains(&key) && shared_data::create_index(config, host, index) {
            self.indexes.insert(key);
        }
    }

    pub fn on_tick(&mut self, config: &Config, host: &dyn Host) {
        if !self.lease_round_due(config, host) {
            return;
        }
        if let Some(discovery) = config.discovery() {
            self.dispatch_admin(config, discovery, Call::Membership, host);
        }
        if let Some(envoy_health) = &config.envoy_health {
            self.dispatch_admin(config, envoy_health, Call::EnvoyHealth, host);
        }
        health_updates::poll_round(config, host);
        let now = host.now_ms();
        let states = shared_data::read_worker_states(config, host);
        // Every worker's state is written here at once: logged in one append.
        shared_data::logged_together(config, host, || {
            for ((index, w), state) in config.all_workers().enumerate().zip(&states) {
                let age = state
                    .as_ref()
                    .filter(|s| s.snapshot_seq > 0)
                    .map(|s| now.saturating_sub(s.snapshot_at_ms))
                    .unwrap_or(u64::MAX >> 1);
                host.gauge(&PerWorker::SnapshotAgeMs.of(&w.name), age);
                if self
                    .outstanding
                    .values()
                    .any(|c| matches!(c, Call::Load(call) if call.worker == w.address))
                {
                    host.count(&PerWorker::PollSkipped.of(&w.name), 1);
                    continue;
                }
                self.dispatch(config, host, index);
            }
        });
        // So an operator (and the soak) can see it stay bounded.
        host.gauge(
            metrics::SHARED_DATA_BYTES,
            shared_data::shared_bytes(config, host),
        );
    }

    /// Reads `discovery.cluster`'s hosts from the admin API, for `call`
    /// (membership or Envoy's health); one call of each kind at a time.
    fn dispatch_admin(&mut self, config: &Config, discovery: &Discovery, kind: Call, host: &dyn Host) {
        let same = |c: &Call| {
            matches!(
                (c, kind),
                (Call::Membership, Call::Membership) | (Call::EnvoyHealth, Call::EnvoyHealth)
            )
        };
        if self.outstanding.values().any(same) {
            return;
        }
        let path = discovery::admin_clusters_path(&discovery.cluster);
        let call = Callout {
            cluster: &discovery.admin_cluster,
            headers: &[
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", "dprank-admin"),
            ],
            body: None,
            timeout_ms: config.poll_timeout_ms,
        };
        match host.http_call(&call) {
            Ok(token) => {
                self.outstanding.insert(token, kind);
            }
            Err(e) => {
                let failed = match kind {
                    Call::EnvoyHealth => metrics::ENVOY_HEALTH_FAILED,
                    _ => metrics::MEMBERSHIP_FAILED,
                };
                host.count(failed, 1);
                log::warn!(
                    "cannot read cluster `{}` through `{}` ({e}): is the cluster defined?",
                    discovery.cluster,
                    discovery.admin_cluster
                );
            }
        }
    }

    fn dispatch(&mut self, config: &Config, host: &dyn Host, index: usize) {
        let Some(w) = config.worker(index) else {
            return;
        };
        let source = Source::of(config);
        let polled = shared_data::update_worker(config, host, index, IfMissing::Create, |state| {
            Some((state.begin_poll(), source.poll(&state.source)))
        });
        let Some((seq, poll)) = polled else {
            return;
        };
        let targets = w.load_targets();
        if targets.iter().any(|(_, part)| part.is_some()) {
            // Earlier polls of this worker are over: their late parts are dropped.
            self.parts.retain(|(worker, _), _| *worker != w.address);
            self.parts.insert(
                (w.address, seq),
                Parts {
                    answers: vec![None; targets.len()],
                },
            );
        }
        for (target, part) in targets {
            let authority = target.to_string();
            let call = Callout {
                cluster: &config.poll_cluster,
                headers: &[
                    (":method", "GET"),
                    (":path", poll.path),
                    (":authority", authority.as_str()),
                    (POLL_DESTINATION_HEADER, authority.as_str()),
                    ("accept", poll.accept),
                ],
                body: None,
                timeout_ms: config.poll_timeout_ms,
            };
            match host.http_call(&call) {
                Ok(token) => {
                    let worker = w.address;
                    self.outstanding.insert(
                        token,
                        Call::Load(LoadCall {
                            worker,
                            seq,
                            poll,
                            part,
                        }),
                    );
                }
                Err(e) => {
                    host.count(&PerWorker::PollFailed.of(&w.name), 1);
                    log::warn!(
                        "cannot poll {} through cluster `{}` ({e}): is the cluster defined?",
                        authority,
                        config.poll_cluster
                    );
                    self.parts.remove(&(w.address, seq));
                    return;
                }
            }
        }
    }

    /// One port's answer of a worker polled port by port; the whole
    /// report once every port has answered (Some(Err) when one failed),
    /// None while some have not.
    fn gather(
        &mut self,
        call: &LoadCall,
        part: u32,
        outcome: Result<Reading, String>,
    ) -> Option<Result<Reading, String>> {
        let key = (call.worker, call.seq);
        let parts = self.parts.get_mut(&key)?;
        // Rank ports are SGLang's: its readout is a complete report.
        let answer = outcome.and_then(|reading| match reading.readout::<LoadReport>() {
            Some(report) if report.ranks.len() == 1 => Ok(report.clone()),
            _ => Err(format!(
                "rank port {part} answered a report of more than its rank"
            )),
        });
        *parts.answers.get_mut(part as usize)? = Some(answer);
        if parts.answers.iter().any(Option::is_none) {
            return None;
        }
        let answers = self.parts.remove(&key)?.answers;
        let mut reports = Vec::with_capacity(answers.len());
        for (r, answer) in answers.into_iter().enumerate() {
            match answer? {
                Ok(report) => reports.push(report),
                Err(why) => return Some(Err(format!("rank port {r}: {why}"))),
            }
        }
        let first = reports.first().map_or(0, |r| r.first_rank);
        let mut merged = LoadReport {
            first_rank: first,
            ranks: Vec::with_capacity(reports.len()),
        };
        for (r, report) in reports.into_iter().enumerate() {
            if u64::from(report.first_rank) != u64::from(first) + r as u64 {
                return Some(Err(format!(
                    "rank port {r} reports rank {} (rank port 0: {first})",
                    report.first_rank
                )));
            }
            merged.ranks.extend(report.ranks);
        }
        Some(Ok(Reading::new(merged)))
    }

    /// Handles a callout's answer, or why there is none (a reset, a cut answer).
    pub fn on_response(
        &mut self,
        config: &Config,
        host: &dyn Host,
        token: u32,
        answer: &Result<CalloutResponse, CalloutError>,
    ) {
        match self.outstanding.remove(&token) {
            Some(Call::Load(call)) => self.on_load_response(config, host, call, answer),
            Some(Call::Membership) => on_membership_response(config, host, answer),
            Some(Call::EnvoyHealth) => on_envoy_health_response(config, host, answer),
            None => {}
        }
    }

    /// Polls worker `index` on its source's fallback endpoint, now and from
    /// now on: kept with the worker's state, so whichever thread polls next
    /// knows.
    fn fall_back(&mut self, config: &Config, host: &dyn Host, index: usize) {
        shared_data::update_worker(config, host, index, IfMissing::Create, |state| {
            Source::of(config).fall_back(&mut state.source);
            Some(())
        });
        self.dispatch(config, host, index);
    }

    fn on_load_response(
        &mut self,
        config: &Config,
        host: &dyn Host,
        call: LoadCall,
        answer: &Result<CalloutResponse, CalloutError>,
    ) {
        // The worker may have left the cluster since the poll was sent.
        let Some((index, w)) = config
            .all_workers()
            .enumerate()
            .find(|(_, w)| w.address == call.worker)
        else {
            return;
        };
        let source = Source::of(config);
        let status = answer.as_ref().ok().map(|r| r.status);
        let outcome = match answer
            .as_ref()
            .map(|r| source.answer(&call.poll, r.status, &r.body))
        {
            Ok(Answer::Report(reading)) => Ok(reading),
            Ok(Answer::Refused(why)) => {
                refuse(config, host, w, &why);
                return;
            }
            Ok(Answer::FallBack) => {
                log::info!(
                    "{} has no {}; polling {} from now on",
                    w.endpoint(),
                    call.poll.path,
                    source.fall_back(&mut Default::default()).path
                );
                self.fall_back(config, host, index);
                return;
            }
            Ok(Answer::Failed(reason)) => Err(reason),
            Err(e) => Err(e.to_string()),
        };
        let outcome = match call.part {
            None => outcome,
            Some(part) => match self.gather(&call, part, outcome) {
                Some(whole) => whole,
                None => return,
            },
        };
        let ok = match outcome {
            Ok(reading) => {
                apply_report(config, host, index, w, call.seq, &reading);
                self.create_index(config, host, index, w);
                health_updates::poll_answered(config, host, w.address);
                if shared_data::set_refused(config, host, w.address, false) {
                    log::info!("{} reports sensible ranks again", w.endpoint());
                }
                true
            }
            Err(reason) => {
                host.count(&PerWorker::PollFailed.of(&w.name), 1);
                // Envoy answers 503 itself when it cannot connect; 502/504
                // say the same from a proxy in between.
                if matches!(status, None | Some(502..=504)) {
                    health_updates::poll_unanswered(config, host, w.address);
                }
                if self.healthy.get(&call.worker) != Some(&false) {
                    log::warn!(
                        "load poll of {} failed: {reason}; keeping its last snapshot",
                        w.endpoint()
                    );
                }
                false
            }
        };
        if self.healthy.insert(call.worker, ok) == Some(false) && ok {
            log::info!("load poll of {} recovered", w.endpoint());
        }
    }
}

/// The body of the admin API's 200, or why there is none.
fn admin_answer(answer: &Result<CalloutResponse, CalloutError>) -> Result<&[u8], String> {
    match answer {
        Ok(r) if r.status == 200 => Ok(&r.body),
        Ok(r) => Err(format!("admin answered HTTP {}", r.status)),
        Err(e) => Err(format!("admin: {e}")),
    }
}

/// Stores which workers Envoy reports unhealthy (`envoy_health`).
fn on_envoy_health_response(
    config: &Config,
    host: &dyn Host,
    answer: &Result<CalloutResponse, CalloutError>,
) {
    let Some(envoy_health) = &config.envoy_health else {
        return;
    };
    let unhealthy =
        admin_answer(answer).and_then(|body| discovery::unhealthy_hosts(body, &envoy_health.cluster));
    match unhealthy {
        Ok(list) => health_updates::set_envoy_unhealthy(config, host, list),
        Err(e) => {
            // The last view stays: a lost admin read makes nobody healthy or unhealthy.
            host.count(metrics::ENVOY_HEALTH_FAILED, 1);
            log::warn!(
                "cannot read the health of cluster `{}`: {e}",
                envoy_health.cluster
            );
        }
    }
}

/// Stores a new membership for every thread; workers that left lose their state.
fn on_membership_response(config: &Config, host: &dyn Host, answer: &Result<CalloutResponse, CalloutError>) {
    let Some(discovery) = config.discovery() else {
        return;
    };
    let members = admin_answer(answer).and_then(|body| discovery::cluster_members(body, &discovery.cluster));
    let members = match members {
        Ok(m) => Members(m),
        Err(e) => {
            host.count(metrics::MEMBERSHIP_FAILED, 1);
            log::warn!("cannot read the members of cluster `{}`: {e}", discovery.cluster);
            return;
        }
    };
    if shared_data::publish_members(config, host, &members).is_none() {
        return;
    }
    host.count(metrics::MEMBERSHIP_CHANGES, 1);
    let list: Vec<String> = members.0.iter().map(|a| a.to_string()).collect();
    log::info!(
        "cluster `{}` now has {} worker(s): {}",
        discovery.cluster,
        members.0.len(),
        list.join(", ")
    );
}

#[cfg(test)]
mod tests;
