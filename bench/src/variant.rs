//! Variants: how requests reach the simulated ranks. A variant is written as
//! a spec, `base[:key=value]...`, or as an alias that expands to one, so new
//! variants (another poll interval, four gateways, a filter setting) need no
//! code: `dprank:gw=4`, `dprank:poll=400`, `dprank:set.cost_estimate="words"`,
//! `smg:policy=least_load:gw=2`.
//!
//! Every variant runs on a fresh fleet of the same simulated workers; what
//! differs is the front (Envoy with or without dprank, smg), the workers' own
//! rank choice for requests that name no rank (`--dispatch`), and how many
//! gateways share the fleet.

use std::path::Path;
use std::process::Command;

use serde_json::{Map, Value};

use crate::envoy::Balancer;
use crate::loadgen::Spread;

/// The workers' own choice of rank for a request that names none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// SGLang's default in-server controller.
    RoundRobin,
    /// SGLang's `--load-balance-method total_tokens`: the rank with the
    /// fewest tokens.
    InServer,
    /// The simulator's clairvoyant greedy chooser (`--dispatch oracle`):
    /// fleet-wide, exact, knows every answer's length; greedy, not a bound.
    Clairvoyant,
    /// `bootstrap_room % dp_size` (SGLang prefill servers, PD).
    RoomModulo,
}

/// dprank's poll interval, in simulated or wall milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    SimMs(u64),
    WallMs(u64),
}

impl Poll {
    /// The interval to configure (wall ms) at `time_scale`, no shorter than
    /// the filter's minimum.
    pub fn wall_ms(self, time_scale: f64) -> u64 {
        let ms = match self {
            Poll::SimMs(ms) => (ms as f64 / time_scale).round() as u64,
            Poll::WallMs(ms) => ms,
        };
        ms.max(dprank::config::MIN_POLL_INTERVAL_MS)
    }

    pub fn sim_ms(self, time_scale: f64) -> f64 {
        self.wall_ms(time_scale) as f64 * time_scale
    }
}

/// dprank's default poll interval (`poll_interval_ms` 1000) as the variant
/// reads it: one simulated second, as on a real fleet.
pub const DPRANK_DEFAULT_POLL: Poll = Poll::SimMs(1000);
/// smg's default `--load-monitor-interval`, wall seconds.
pub const SMG_DEFAULT_INTERVAL_S: u32 = 10;

#[derive(Debug, Clone, PartialEq)]
pub enum Front {
    /// Envoy without dprank: its cluster balancer over workers.
    Envoy(Balancer),
    /// Envoy + dprank (envoy/dprank.yaml), filter keys overridden by `set`.
    Dprank { poll: Poll, set: Map<String, Value> },
    /// `smg launch [--dp-aware] --policy P`.
    Smg {
        policy: String,
        interval_s: Option<u32>,
        /// With `--dp-aware` smg picks the rank; without, it picks the
        /// worker and the worker's own controller picks the rank.
        dp_aware: bool,
        args: Vec<String>,
    },
    /// Envoy + dprank in PD mode (envoy/pd.yaml).
    DprankPd { poll: Poll, set: Map<String, Value> },
    /// A model of the Gateway API Inference Extension's endpoint picker
    /// (default profile, per pod; `offline/gie.rs`): offline only.
    Gie { reading: GieReading },
    /// `smg launch --pd-disaggregation [--dp-minimum-tokens-scheduler]`.
    SmgPd {
        prefill: String,
        decode: String,
        minimum_tokens: bool,
        interval_s: Option<u32>,
        args: Vec<String>,
    },
}

/// How the Inference Extension model reads a pod's per-engine metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GieReading {
    /// The first sample of each series (engine 0's), as the EPP does.
    FirstSample,
    /// Waiting summed, KV usage averaged over the engines.
    Sum,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    /// The spec as written (tables show it).
    pub name: String,
    pub front: Front,
    pub dispatch: Dispatch,
    /// Gateways sharing the fleet (separate processes).
    pub gateways: usize,
    /// How the L4 balancer spreads requests over them (`spread=`).
    pub spread: Spread,
    /// Extra simulator flags for this variant.
    pub sim_args: Vec<String>,
    /// Virtual time only: a model of the Inference Extension's saturation
    /// detector before dprank's routing (`ie=on`).
    pub ie_detector: bool,
}

/// Admission's limits when `wait=` and `queue-timeout=` do not set them,
/// as docs/overload.md recommends: the wait limit is this share of the
/// cell's TTFT target, the queue's time-out the target itself (a request
/// held longer misses it anyway).
pub const ADMIT_WAIT_SHARE_OF_TTFT: f64 = 0.5;

/// Built-in variants: name, expansion, what it is.
pub const ALIASES: [(&str, &str, &str); 29] = [
    ("rr", "rr", "Envoy round robin over workers, each worker round robin over its ranks (SGLang's default controller; on vLLM servers, vLLM's internal balancer)"),
    ("in-server", "in-server", "the servers' own balancer: each SGLang worker sends a request to its rank with the fewest tokens (`--load-balance-method total_tokens`), each vLLM server's internal balancer picks its engine; Envoy least_request over workers"),
    ("in-server-delayer", "in-server:sim.prefill-delayer=on", "in-server with SGLang's prefill delayer switched on (`--enable-prefill-delayer`): ranks that could prefill wait up to 30 passes while others could not, so that they prefill together (SGLang workers only)"),
    ("in-server-mixed", "in-server:sim.mixed-chunk=on", "in-server with SGLang's mixed chunks switched on (`--enable-mixed-chunk`): a prefill step carries the running decodes (SGLang workers only)"),
    ("in-server-best", "in-server:sim.prefill-delayer=on:sim.mixed-chunk=on", "in-server with both of SGLang's switches against the lockstep stall: the prefill delayer and mixed chunks (SGLang workers only)"),
    ("in-server-rr", "in-server:lb=round_robin", "the servers' own balancer (SGLang `total_tokens`, vLLM's internal balancer) behind Envoy round robin over workers"),
    ("gie", "gie", "a model of the Gateway API Inference Extension's endpoint picker, default profile: prefix-cache (weight 3), queue (2) and KV-cache utilisation (2) scorers per pod over its own index of routed prompts and metrics polled every 50 ms, reading the first sample of each series (engine 0's on a DP server) as its metric mapping does; each server's own balancer picks the engine (offline only)"),
    ("gie-sum", "gie:metrics=sum", "the Inference Extension model reading a pod's waiting requests summed and its KV usage averaged over its engines (a charitable reading; offline only)"),
    ("clairvoyant", "clairvoyant", "the clairvoyant greedy chooser: the simulator places each request where its projected first token is earliest, seeing every rank's exact queue, reservations and cache at that moment and every answer's length; greedy (one request at a time), a reference, not a bound; behind Envoy round robin"),
    ("oracle", "clairvoyant", "the clairvoyant greedy chooser (its earlier name)"),
    ("dprank", "dprank", "Envoy + dprank, shipped configuration, polling every simulated second"),
    ("dprank-load-only", "dprank:set.prefix_affinity=false", "Envoy + dprank without prefix affinity: loads alone, polling every simulated second"),
    ("dprank-reject", "dprank:admit=reject", "Envoy + dprank with admission: every rank's expected wait past half the TTFT target answers 429 (critical requests: the whole target)"),
    ("dprank-queue", "dprank:admit=queue", "Envoy + dprank with admission: past half the TTFT target of expected wait a request is held in the filter (critical first) for at most the target, then 503"),
    ("ie-model", "dprank:ie=on", "virtual time only: a model of the Gateway API Inference Extension's saturation detector (mean over workers of max(waiting/5, kv/0.8) >= 1, metrics every 50 ms) refusing the low class with 429 when saturated, before dprank's routing"),
    ("smg-limit", "smg:policy=cache_aware:limit=64:queue-timeout=1", "smg --dp-aware --policy cache_aware --max-concurrent-requests 64 --queue-size 100 --queue-timeout-secs 1"),
    ("dprank-wall-1s", "dprank:poll-wall=1000", "Envoy + dprank polling every wall second: the control for smg's load monitor at its freshest (--load-monitor-interval 1)"),
    ("smg-cache-aware-workers", "smg:policy=cache_aware:dp-aware=off:dispatch=in-server:interval=1", "smg --policy cache_aware without --dp-aware: smg picks the worker (its own in-flight counts and request text), each worker's minimum-tokens controller picks the rank; loads polled every wall second"),
    ("smg-cache-aware", "smg:policy=cache_aware", "smg --dp-aware --policy cache_aware (smg's default policy)"),
    ("smg-least-load", "smg:policy=least_load", "smg --dp-aware --policy least_load"),
    ("smg-power-of-two", "smg:policy=power_of_two", "smg --dp-aware --policy power_of_two"),
    ("smg-prefix-hash", "smg:policy=prefix_hash", "smg --dp-aware --policy prefix_hash"),
    ("smg-round-robin", "smg:policy=round_robin", "smg --dp-aware --policy round_robin (the earlier benchmarks' smg)"),
    ("smg-workers-least-load", "smg:policy=least_load:dp-aware=off:dispatch=in-server:interval=1", "smg --policy least_load without --dp-aware: smg picks the worker from polled loads (--load-monitor-interval 1, its freshest) and each worker's own minimum-tokens controller picks the rank"),
    ("dprank-pd", "dprank-pd", "Envoy + dprank in PD mode, polling every simulated second"),
    ("old-rule", "old-rule", "smg --pd-disaggregation without --dp-minimum-tokens-scheduler: no rank injected, prefill rank = bootstrap_room % dp_size"),
    ("smg-pd-cache-aware", "smg-pd:policy=cache_aware", "smg --pd-disaggregation --dp-minimum-tokens-scheduler, cache_aware worker policy (default)"),
    ("smg-pd-least-load", "smg-pd:policy=least_load", "the same with --prefill-policy/--decode-policy least_load"),
    ("smg-pd-power-of-two", "smg-pd:policy=power_of_two", "the same with power_of_two"),
];

impl Variant {
    /// Parses a spec or alias.
    pub fn parse(spec: &str) -> Result<Variant, String> {
        let spec = spec.trim();
        let mut parts = spec.split(':');
        let head = parts.next().unwrap_or_default();
        let expanded = ALIASES
            .iter()
            .find(|(alias, _, _)| *alias == head)
            .map_or(head, |(_, expansion, _)| expansion);
        let mut tokens: Vec<&str> = expanded.split(':').collect();
        tokens.extend(parts);
        let base = tokens[0];
        let mut variant = Variant {
            name: spec.to_string(),
            front: match base {
                "rr" | "clairvoyant" | "oracle" => Front::Envoy(Balancer::RoundRobin),
                "in-server" => Front::Envoy(Balancer::LeastRequest),
                "gie" => Front::Gie {
                    reading: GieReading::FirstSample,
                },
                "dprank" => Front::Dprank {
                    poll: DPRANK_DEFAULT_POLL,
                    set: Map::new(),
                },
                "dprank-pd" => Front::DprankPd {
                    poll: DPRANK_DEFAULT_POLL,
                    set: Map::new(),
                },
                "smg" => Front::Smg {
                    policy: "cache_aware".into(),
                    interval_s: None,
                    dp_aware: true,
                    args: Vec::new(),
                },
                "old-rule" | "smg-pd" => Front::SmgPd {
                    prefill: if base == "old-rule" { "round_robin" } else { "cache_aware" }.into(),
                    decode: if base == "old-rule" { "round_robin" } else { "cache_aware" }.into(),
                    minimum_tokens: base == "smg-pd",
                    interval_s: None,
                    args: Vec::new(),
                },
                other => {
                    return Err(format!(
                        "unknown variant `{other}`; bases: rr, in-server, clairvoyant, gie, dprank, smg, dprank-pd, old-rule, smg-pd; aliases: {}",
                        ALIASES.map(|a| a.0).join(", ")
                    ))
                }
            },
            dispatch: match base {
                "in-server" | "gie" => Dispatch::InServer,
                "clairvoyant" | "oracle" => Dispatch::Clairvoyant,
                _ => Dispatch::RoundRobin,
            },
            gateways: 1,
            spread: Spread::Request,
            sim_args: Vec::new(),
            ie_detector: false,
        };
        for token in &tokens[1..] {
            variant
                .apply(token)
                .map_err(|e| format!("variant `{spec}`: {e}"))?;
        }
        Ok(variant)
    }

    fn apply(&mut self, token: &str) -> Result<(), String> {
        let (key, value) = match token.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (token, None),
        };
        let need = |what: &str| value.ok_or_else(|| format!("`{key}` needs a value ({what})"));
        if key == "gw" {
            self.gateways = need("gateways")?
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=32).contains(n))
                .ok_or("`gw` must be 1..=32")?;
            return Ok(());
        }
        if key == "spread" {
            self.spread = match need("request or tenant")? {
                "request" => Spread::Request,
                "tenant" => Spread::Tenant,
                other => return Err(format!("`spread` is request or tenant, not `{other}`")),
            };
            return Ok(());
        }
        if let Some(flag) = key.strip_prefix("sim.") {
            self.sim_args.push(format!("--{flag}"));
            self.sim_args.extend(value.map(str::to_string));
            return Ok(());
        }
        match &mut self.front {
            Front::Dprank { poll, set } | Front::DprankPd { poll, set } => match key {
                "poll" => *poll = Poll::SimMs(parse_ms(need("simulated ms")?)?),
                "poll-wall" => *poll = Poll::WallMs(parse_ms(need("wall ms")?)?),
                "admit" => {
                    let mode = need("reject or queue")?;
                    if !matches!(mode, "reject" | "queue") {
                        return Err(format!("`admit` is reject or queue, not `{mode}`"));
                    }
                    with_admission(set, |block| {
                        block.insert("when_saturated".into(), Value::from(mode));
                    });
                }
                "wait" | "queue-timeout" | "max-queued" | "drain" | "requests" => {
                    let n = parse_ms(need("a whole number")?)?;
                    let field = match key {
                        "wait" => "max_wait_ms",
                        "queue-timeout" => "queue_timeout_ms",
                        "max-queued" => "max_queued",
                        "requests" => "max_requests_per_rank",
                        _ => "prefill_tokens_per_s",
                    };
                    with_admission(set, |block| {
                        block.insert(field.into(), Value::from(n));
                    });
                }
                "slo" => {
                    // The cell's SLO targets, filled in by `for_cell`.
                    with_admission(set, |block| {
                        block.insert("slo".into(), Value::Bool(true));
                    });
                }
                "server-priority" => {
                    // The class's priority in the body, and the simulated
                    // SGLang with --enable-priority-scheduling to read it.
                    with_admission(set, |block| {
                        block.insert(
                            "server_priority".into(),
                            serde_json::json!({ "critical": 1, "standard": 0, "sheddable": -1 }),
                        );
                    });
                    self.sim_args.push("--enable-priority-scheduling".into());
                }
                "standard-requests" => {
                    let n = parse_ms(need("a whole number")?)?;
                    with_admission(set, |block| {
                        block.insert(
                            "class_max_requests_per_rank".into(),
                            serde_json::json!({ "standard": n }),
                        );
                    });
                }
                "kv" => {
                    let raw = need("a share of KV, 0..=1")?;
                    let share: f64 = raw
                        .parse()
                        .ok()
                        .filter(|v: &f64| *v > 0.0 && *v <= 1.0)
                        .ok_or_else(|| format!("`kv` is a share in (0, 1], not `{raw}`"))?;
                    with_admission(set, |block| {
                        block.insert("max_kv_usage".into(), Value::from(share));
                    });
                }
                "ie" => {
                    self.ie_detector = match need("on or off")? {
                        "on" => true,
                        "off" => false,
                        other => return Err(format!("`ie` is on or off, not `{other}`")),
                    }
                }
                _ if key.starts_with("set.") => {
                    let raw = need("a JSON value")?;
                    let parsed: Value = serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()));
                    set.insert(key["set.".len()..].to_string(), parsed);
                }
                _ => return Err(format!("unknown key `{key}` (dprank keys: gw, spread, poll, poll-wall, admit, wait, queue-timeout, max-queued, drain, requests, standard-requests, slo, server-priority, kv, ie, set.<filter key>, sim.<flag>)")),
            },
            Front::Smg {
                policy,
                interval_s,
                dp_aware,
                args,
            } => match key {
                "policy" => *policy = need("an smg policy")?.to_string(),
                "interval" => *interval_s = Some(parse_seconds(need("whole wall seconds")?)?),
                "dp-aware" => {
                    *dp_aware = match need("on or off")? {
                        "on" => true,
                        "off" => false,
                        other => return Err(format!("`dp-aware` is on or off, not `{other}`")),
                    }
                }
                "dispatch" => {
                    self.dispatch = match need("the workers' own rank choice")? {
                        "in-server" => Dispatch::InServer,
                        "round-robin" => Dispatch::RoundRobin,
                        other => return Err(format!("`dispatch` is in-server or round-robin, not `{other}`")),
                    }
                }
                _ if key.starts_with("arg.") => {
                    args.push(format!("--{}", &key["arg.".len()..]));
                    args.extend(value.map(str::to_string));
                }
                "limit" | "queue" | "queue-timeout" => {
                    let raw = need("a whole number")?;
                    let n: u64 = raw
                        .parse()
                        .map_err(|_| format!("`{key}` is a whole number, not `{raw}`"))?;
                    let flag = match key {
                        "limit" => "--max-concurrent-requests",
                        "queue" => "--queue-size",
                        _ => "--queue-timeout-secs",
                    };
                    args.push(flag.to_string());
                    args.push(n.to_string());
                }
                "cache-threshold" | "balance-abs" | "balance-rel" => {
                    let raw = need("a number")?;
                    let number: f64 = raw
                        .parse()
                        .ok()
                        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
                        .ok_or_else(|| format!("`{key}` is a non-negative number, not `{raw}`"))?;
                    let flag = match key {
                        "cache-threshold" => "--cache-threshold",
                        "balance-abs" => "--balance-abs-threshold",
                        _ => "--balance-rel-threshold",
                    };
                    args.push(flag.to_string());
                    args.push(number.to_string());
                }
                _ => {
                    return Err(format!(
                        "unknown key `{key}` (smg keys: gw, spread, policy, interval, dp-aware, dispatch, cache-threshold, balance-abs, balance-rel, limit, queue, queue-timeout, arg.<flag>, sim.<flag>)"
                    ))
                }
            },
            Front::SmgPd {
                prefill,
                decode,
                interval_s,
                args,
                ..
            } => match key {
                "policy" => {
                    *prefill = need("an smg policy")?.to_string();
                    *decode = prefill.clone();
                }
                "prefill" => *prefill = need("an smg policy")?.to_string(),
                "decode" => *decode = need("an smg policy")?.to_string(),
                "interval" => *interval_s = Some(parse_seconds(need("whole wall seconds")?)?),
                _ if key.starts_with("arg.") => {
                    args.push(format!("--{}", &key["arg.".len()..]));
                    args.extend(value.map(str::to_string));
                }
                _ => {
                    return Err(format!(
                        "unknown key `{key}` (smg PD keys: gw, spread, policy, prefill, decode, interval, arg.<flag>, sim.<flag>)"
                    ))
                }
            },
            Front::Envoy(balancer) => match key {
                "lb" => {
                    *balancer = match need("round_robin or least_request")? {
                        "round_robin" => Balancer::RoundRobin,
                        "least_request" => Balancer::LeastRequest,
                        other => return Err(format!("`lb` is round_robin or least_request, not `{other}`")),
                    }
                }
                _ => return Err(format!("unknown key `{key}` (keys: gw, spread, lb, sim.<flag>)")),
            },
            Front::Gie { reading } => match key {
                "metrics" => {
                    *reading = match need("first or sum")? {
                        "first" => GieReading::FirstSample,
                        "sum" => GieReading::Sum,
                        other => return Err(format!("`metrics` is first or sum, not `{other}`")),
                    }
                }
                _ => return Err(format!("unknown key `{key}` (gie keys: gw, metrics, sim.<flag>)")),
            },
        }
        Ok(())
    }

    /// Whether the variant runs on a prefill/decode fleet.
    pub fn is_pd(&self) -> bool {
        matches!(self.front, Front::DprankPd { .. } | Front::SmgPd { .. })
    }

    pub fn uses_smg(&self) -> bool {
        matches!(self.front, Front::Smg { .. } | Front::SmgPd { .. })
    }

    /// What information the router acts on and how fresh it is, at `time_scale`.
    pub fn freshness(&self, time_scale: f64) -> String {
        let smg_interval = |interval: Option<u32>| {
            let s = interval.unwrap_or(SMG_DEFAULT_INTERVAL_S);
            let default = if interval.is_none() { ", its default" } else { "" };
            format!(
                "{s} s wall{default} = {} s simulated",
                fmt_num(f64::from(s) * time_scale)
            )
        };
        match &self.front {
            Front::Gie { reading } => match reading {
                GieReading::FirstSample => {
                    "EPP model: pod metrics polled every 50 ms (engine 0's sample) + its own index of routed prompts; the server's balancer picks the engine".into()
                }
                GieReading::Sum => {
                    "EPP model: pod metrics polled every 50 ms (summed over engines) + its own index of routed prompts; the server's balancer picks the engine".into()
                }
            },
            Front::Envoy(_) => match self.dispatch {
                Dispatch::InServer => {
                    "each worker's own balancer: SGLang's DP controller (published loads re-read every 20 ms + requests sent since) or vLLM's (coordinator counts every 100 ms + its own picks since)"
                        .into()
                }
                Dispatch::Clairvoyant => {
                    "exact, instantaneous, fleet-wide, every answer's length (clairvoyant)".into()
                }
                _ => "none (round robin)".into(),
            },
            Front::Dprank { poll, .. } | Front::DprankPd { poll, .. } => format!(
                "polled loads every {} ms simulated ({} ms wall) + own estimates of requests since",
                fmt_num(poll.sim_ms(time_scale)),
                poll.wall_ms(time_scale)
            ),
            Front::Smg {
                policy,
                interval_s,
                dp_aware: false,
                ..
            } => {
                let rank = match self.dispatch {
                    Dispatch::InServer => "each worker's own minimum-tokens choice of rank",
                    _ => "each worker's own round robin over ranks",
                };
                match policy.as_str() {
                    "least_load" | "power_of_two" => {
                        format!("smg: worker loads polled every {}; {rank}", smg_interval(*interval_s))
                    }
                    _ => format!("smg: own in-flight counts per worker; {rank}"),
                }
            }
            // With --dp-aware smg 1.13 polls no loads whatever the policy
            // and interval (measured; the load-polls column shows it).
            Front::Smg { policy, .. } => match policy.as_str() {
                "round_robin" | "random" => "none".into(),
                "cache_aware" | "prefix_hash" | "consistent_hashing" => {
                    "own in-flight request counts + request text (no load polling with --dp-aware)".into()
                }
                _ => "own in-flight request counts (no load polling with --dp-aware)".into(),
            },
            Front::SmgPd {
                minimum_tokens,
                interval_s,
                ..
            } => {
                if *minimum_tokens {
                    format!("polled num_used_tokens every {} + 1.3 x words per pick", smg_interval(*interval_s))
                } else {
                    "none (prefill rank = bootstrap_room % dp_size)".into()
                }
            }
        }
    }

    /// A sentence for result files: an alias's own text when the spec only
    /// adds gateways or simulator flags to it (said after it), else what
    /// the front runs.
    pub fn describe(&self) -> String {
        let bare: Vec<&str> = self
            .name
            .split(':')
            .filter(|part| !["gw=", "spread=", "sim."].iter().any(|p| part.starts_with(p)))
            .collect();
        let bare = bare.join(":");
        let alias = ALIASES.iter().find(|(a, _, _)| *a == bare).map(|a| a.2);
        let mut out = match alias {
            Some(text) => text.to_string(),
            None => self.describe_front(),
        };
        if self.gateways > 1 {
            out.push_str(&format!("; {} gateways share the fleet", self.gateways));
            if self.spread == Spread::Tenant {
                out.push_str(", each tenant kept on one");
            }
        }
        if !self.sim_args.is_empty() {
            out.push_str(&format!("; simulator flags `{}`", self.sim_args.join(" ")));
        }
        out
    }

    fn describe_front(&self) -> String {
        let poll = |p: &Poll| match p {
            Poll::SimMs(ms) => format!("every {ms} ms simulated"),
            Poll::WallMs(ms) => format!("every {ms} ms wall"),
        };
        let keys = |set: &Map<String, Value>| {
            set.iter()
                .map(|(k, v)| format!("; `{k}: {v}`"))
                .collect::<String>()
        };
        let interval = |i: &Option<u32>| {
            i.map(|s| format!(" --load-monitor-interval {s}"))
                .unwrap_or_default()
        };
        let args = |a: &[String]| a.iter().map(|x| format!(" {x}")).collect::<String>();
        match &self.front {
            Front::Envoy(balancer) => format!("Envoy, {balancer:?}"),
            Front::Gie { reading } => format!("Inference Extension EPP model, default profile, {reading:?}"),
            Front::Dprank { poll: p, set } => format!("Envoy + dprank polling {}{}", poll(p), keys(set)),
            Front::DprankPd { poll: p, set } => {
                format!("Envoy + dprank in PD mode polling {}{}", poll(p), keys(set))
            }
            Front::Smg {
                policy,
                interval_s,
                dp_aware,
                args: a,
            } => format!(
                "smg{} --policy {policy}{}{}",
                if *dp_aware { " --dp-aware" } else { "" },
                interval(interval_s),
                args(a)
            ),
            Front::SmgPd {
                prefill,
                decode,
                minimum_tokens,
                interval_s,
                args: a,
            } => format!(
                "smg --pd-disaggregation{} --prefill-policy {prefill} --decode-policy {decode}{}{}",
                if *minimum_tokens {
                    " --dp-minimum-tokens-scheduler"
                } else {
                    ""
                },
                interval(interval_s),
                args(a)
            ),
        }
    }
}

impl Variant {
    /// This variant for a cell with TTFT target `ttft_ms` (simulated) run at
    /// `time_scale`: a dprank admission block without a wait limit gets half
    /// the target, and in queue mode without a time-out the target
    /// ([`ADMIT_WAIT_SHARE_OF_TTFT`]); then its times, simulated ms like
    /// every time a variant names, become the wall ms the filter counts in
    /// (divided by `time_scale`; virtual time runs at 1).
    pub fn for_cell(&self, ttft_ms: f64, tpot_ms: f64, time_scale: f64) -> Variant {
        let mut out = self.clone();
        let (Front::Dprank { set, .. } | Front::DprankPd { set, .. }) = &mut out.front else {
            return out;
        };
        if !(set.contains_key("admission") && ttft_ms.is_finite() && ttft_ms >= 1.0) {
            return out;
        }
        with_admission(set, |block| {
            if block.get("slo") == Some(&Value::Bool(true)) {
                // SLO admission: the targets alone (the wait cap defaults
                // to the TTFT target in the filter).
                let slo = serde_json::json!({
                    "ttft_ms": ttft_ms.round().max(1.0) as u64,
                    "tpot_ms": tpot_ms.round().max(1.0) as u64,
                });
                block.insert("slo".into(), slo);
            } else {
                let wait = (ttft_ms * ADMIT_WAIT_SHARE_OF_TTFT).round().max(1.0) as u64;
                block.entry("max_wait_ms").or_insert(Value::from(wait));
            }
            if block.get("when_saturated").and_then(Value::as_str) == Some("queue") {
                block
                    .entry("queue_timeout_ms")
                    .or_insert(Value::from(ttft_ms.round() as u64));
            }
            if time_scale.is_finite() && time_scale > 0.0 && time_scale != 1.0 {
                let wall = |v: &mut Value| {
                    if let Some(ms) = v.as_u64() {
                        *v = Value::from((ms as f64 / time_scale).round().max(1.0) as u64);
                    }
                };
                for key in ["max_wait_ms", "queue_timeout_ms"] {
                    block.get_mut(key).map(wall);
                }
                if let Some(Value::Object(slo)) = block.get_mut("slo") {
                    slo.values_mut().for_each(wall);
                }
                if let Some(Value::Object(classes)) = block.get_mut("class_max_wait_ms") {
                    classes.values_mut().for_each(wall);
                }
            }
        });
        out
    }
}

/// Changes the `admission` block of a dprank variant's filter keys (made
/// if absent).
fn with_admission(set: &mut Map<String, Value>, change: impl FnOnce(&mut Map<String, Value>)) {
    let mut block = match set.remove("admission") {
        Some(Value::Object(map)) => map,
        _ => Map::new(),
    };
    change(&mut block);
    set.insert("admission".into(), Value::Object(block));
}

fn parse_ms(text: &str) -> Result<u64, String> {
    text.parse::<u64>()
        .ok()
        .filter(|ms| *ms > 0)
        .ok_or_else(|| format!("`{text}` is not a positive number of ms"))
}

fn parse_seconds(text: &str) -> Result<u32, String> {
    text.parse::<u32>()
        .ok()
        .filter(|s| *s >= 1)
        .ok_or_else(|| format!("`{text}` is not a whole number of seconds >= 1 (smg's interval)"))
}

fn fmt_num(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        format!("{v:.1}")
    }
}

/// What the simulator binary supports, read from its `--help`, so variants
/// that need newer simulator behaviour are skipped (with a reason) on older
/// builds instead of failing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SimFeatures {
    pub dispatch: Vec<String>,
    pub prefix_cache: bool,
    /// `--enable-cache-report`: cached tokens in OpenAI usage (SGLang's flag).
    pub cache_report: bool,
    /// `--cost-model`: the calibrated presets.
    pub cost_model: bool,
    /// `--engine vllm`: vLLM servers.
    pub vllm: bool,
    /// `--noise-seed`: seeded step noise (the split presets).
    pub noise_seed: bool,
}

impl SimFeatures {
    pub fn detect(sim: &Path) -> Result<SimFeatures, String> {
        let output = Command::new(sim)
            .arg("--help")
            .output()
            .map_err(|e| format!("cannot run {} --help: {e}", sim.display()))?;
        Ok(SimFeatures::from_help(&String::from_utf8_lossy(&output.stdout)))
    }

    pub fn from_help(help: &str) -> SimFeatures {
        let known = [
            "round_robin",
            "minimum_tokens",
            "total_tokens",
            "total_requests",
            "room_modulo",
            "oracle",
        ];
        SimFeatures {
            dispatch: known
                .iter()
                .filter(|d| {
                    help.contains(&format!("- {d}:"))
                        || help.contains(&format!("{d}|"))
                        || help.contains(&format!("|{d}"))
                })
                .map(|d| d.to_string())
                .collect(),
            prefix_cache: help.contains("--prefix-cache"),
            cache_report: help.contains("--enable-cache-report"),
            cost_model: help.contains("--cost-model"),
            vllm: help.contains("--engine"),
            noise_seed: help.contains("--noise-seed"),
        }
    }

    /// Whether this simulator build can run `preset`.
    pub fn check_preset(&self, preset: &crate::preset::SimPreset) -> Result<(), String> {
        if preset.vllm && !self.vllm {
            return Err(format!(
                "simulator preset `{}` needs `dprank-sim --engine vllm`, which this simulator build lacks (`make tools`)",
                preset.name
            ));
        }
        if preset.sim_args.contains(&"--cost-model") && !self.cost_model {
            return Err(format!(
                "simulator preset `{}` needs `dprank-sim --cost-model`, which this simulator build lacks (the calibrated cost model is not merged, or the binary is old: `make tools`)",
                preset.name
            ));
        }
        Ok(())
    }

    /// The `--dispatch` value for `d`, or why this simulator cannot run it.
    /// A vLLM server has one balancer of its own (`vllm`): it is the
    /// in-server and the round-robin variants' choice alike.
    pub fn dispatch_arg(&self, d: Dispatch, vllm: bool) -> Result<&'static str, String> {
        let has = |name: &str| self.dispatch.iter().any(|x| x == name);
        if vllm {
            return match d {
                Dispatch::Clairvoyant => Ok("oracle"),
                Dispatch::RoomModulo => Err("vLLM servers run no prefill/decode roles here".into()),
                Dispatch::InServer | Dispatch::RoundRobin => Ok("vllm"),
            };
        }
        match d {
            Dispatch::RoundRobin => Ok("round_robin"),
            Dispatch::RoomModulo => Ok("room_modulo"),
            // Older simulator builds call it `minimum_tokens`.
            Dispatch::InServer if has("total_tokens") => Ok("total_tokens"),
            Dispatch::InServer if has("minimum_tokens") => Ok("minimum_tokens"),
            Dispatch::InServer => Err("the simulator has no minimum-tokens dispatch".into()),
            Dispatch::Clairvoyant if has("oracle") => Ok("oracle"),
            Dispatch::Clairvoyant => {
                Err("this simulator build has no `--dispatch oracle` (the clairvoyant chooser)".into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_limits_follow_the_ttft_target_unless_set() {
        let block =
            |spec: &str, ttft: f64| match Variant::parse(spec).unwrap().for_cell(ttft, 50.0, 1.0).front {
                Front::Dprank { set, .. } => set.get("admission").cloned(),
                _ => None,
            };
        assert_eq!(
            block("dprank-queue", 800.0),
            Some(serde_json::json!({"when_saturated": "queue", "max_wait_ms": 400, "queue_timeout_ms": 800}))
        );
        assert_eq!(
            block("dprank-reject", 800.0),
            Some(serde_json::json!({"when_saturated": "reject", "max_wait_ms": 400})),
            "no time-out in reject mode (the filter refuses one)"
        );
        assert_eq!(
            block("dprank:admit=queue:wait=100:queue-timeout=300", 800.0),
            Some(serde_json::json!({"when_saturated": "queue", "max_wait_ms": 100, "queue_timeout_ms": 300}))
        );
        assert_eq!(
            block("dprank:admit=reject:requests=48", 800.0),
            Some(
                serde_json::json!({"when_saturated": "reject", "max_requests_per_rank": 48, "max_wait_ms": 400})
            )
        );
        assert_eq!(
            block("dprank:admit=reject:requests=48:standard-requests=40", 800.0),
            Some(
                serde_json::json!({"when_saturated": "reject", "max_requests_per_rank": 48,
                "class_max_requests_per_rank": {"standard": 40}, "max_wait_ms": 400})
            )
        );
        assert_eq!(
            block("dprank:admit=reject:slo", 800.0),
            Some(serde_json::json!({"when_saturated": "reject", "slo": {"ttft_ms": 800, "tpot_ms": 50}})),
            "the targets alone"
        );
        assert_eq!(
            block("dprank:admit=reject:slo:requests=60", 800.0),
            Some(
                serde_json::json!({"when_saturated": "reject", "max_requests_per_rank": 60,
                "slo": {"ttft_ms": 800, "tpot_ms": 50}})
            ),
            "a cap beside them"
        );
        assert_eq!(
            block("dprank:admit=reject:server-priority", 800.0),
            Some(serde_json::json!({"when_saturated": "reject", "max_wait_ms": 400,
                "server_priority": {"critical": 1, "standard": 0, "sheddable": -1}}))
        );
        assert_eq!(
            Variant::parse("dprank:admit=reject:server-priority")
                .unwrap()
                .sim_args,
            ["--enable-priority-scheduling"],
            "the simulated servers read it"
        );
        assert_eq!(block("dprank", 800.0), None, "no admission, none added");
        let on_harness = |spec: &str| match Variant::parse(spec).unwrap().for_cell(800.0, 50.0, 2.0).front {
            Front::Dprank { set, .. } => set.get("admission").cloned(),
            _ => None,
        };
        assert_eq!(
            on_harness("dprank:admit=queue:wait=100"),
            Some(serde_json::json!({"when_saturated": "queue", "max_wait_ms": 50, "queue_timeout_ms": 400})),
            "at time scale 2 the filter counts half as many wall ms"
        );
        assert_eq!(
            on_harness("dprank:admit=reject:requests=48"),
            Some(
                serde_json::json!({"when_saturated": "reject", "max_requests_per_rank": 48, "max_wait_ms": 200})
            ),
            "request limits have no unit to scale"
        );
        for spec in [
            "dprank-queue",
            "dprank-reject",
            "dprank:admit=reject:requests=48:standard-requests=40",
        ] {
            let v = Variant::parse(spec).unwrap().for_cell(800.0, 50.0, 1.0);
            assert!(
                crate::offline::driver::dprank_config(&v, 2, false).is_ok(),
                "{spec}"
            );
        }
    }

    #[test]
    fn descriptions_say_what_runs() {
        let with_gateways = Variant::parse("smg-cache-aware:gw=4").unwrap().describe();
        assert_eq!(
            with_gateways,
            "smg --dp-aware --policy cache_aware (smg's default policy); 4 gateways share the fleet"
        );
        let keyed = Variant::parse("dprank:set.gateways=4:poll=200:gw=4")
            .unwrap()
            .describe();
        assert_eq!(
            keyed,
            "Envoy + dprank polling every 200 ms simulated; `gateways: 4`; 4 gateways share the fleet"
        );
        let smg = Variant::parse("smg:policy=least_load:interval=1")
            .unwrap()
            .describe();
        assert_eq!(
            smg,
            "smg --dp-aware --policy least_load --load-monitor-interval 1"
        );
        let by_tenant = Variant::parse("dprank:gw=4:spread=tenant").unwrap();
        assert_eq!(by_tenant.spread, Spread::Tenant);
        assert_eq!(
            by_tenant.describe(),
            "Envoy + dprank, shipped configuration, polling every simulated second; 4 gateways share the fleet, each tenant kept on one"
        );
        assert!(Variant::parse("dprank:spread=client").is_err());
        for v in ["dprank:poll=200", "dprank:gw=1", "smg-pd:policy=least_load:gw=2"] {
            assert!(!Variant::parse(v).unwrap().describe().contains('{'), "{v}");
        }
    }

    #[test]
    fn the_in_server_balancer_at_its_best_switches_sglang_options_on() {
        let best = Variant::parse("in-server-best").unwrap();
        assert_eq!(best.dispatch, Dispatch::InServer);
        assert_eq!(best.sim_args, ["--prefill-delayer", "on", "--mixed-chunk", "on"]);
        let rr = Variant::parse("rr:sim.prefill-delayer=on").unwrap();
        assert_eq!(
            (rr.dispatch, rr.sim_args),
            (
                Dispatch::RoundRobin,
                vec!["--prefill-delayer".to_string(), "on".into()]
            )
        );
        let parsed = crate::offline::sim_config(
            crate::preset::preset("deepseek-v3-ep").unwrap(),
            crate::preset::Kv::Small,
            8,
            &best.sim_args,
        )
        .unwrap();
        assert!(parsed.prefill_delayer() && parsed.mixed_chunk());
    }

    #[test]
    fn aliases_expand_and_keys_apply() {
        let v = Variant::parse("smg-least-load:gw=2:interval=1").unwrap();
        assert_eq!(v.name, "smg-least-load:gw=2:interval=1");
        assert_eq!(v.gateways, 2);
        assert_eq!(
            v.front,
            Front::Smg {
                policy: "least_load".into(),
                interval_s: Some(1),
                dp_aware: true,
                args: vec![]
            }
        );
        let w = Variant::parse("smg-workers-least-load").unwrap();
        assert!(matches!(w.front, Front::Smg { dp_aware: false, .. }));
        assert_eq!(w.dispatch, Dispatch::InServer);
        assert!(
            w.freshness(5.0).contains("1 s wall = 5 s simulated"),
            "{}",
            w.freshness(5.0)
        );
        let d = Variant::parse(
            r#"dprank:poll=400:set.cost_estimate="words":set.prefix_affinity=false:sim.lockstep"#,
        )
        .unwrap();
        match &d.front {
            Front::Dprank { poll, set } => {
                assert_eq!(*poll, Poll::SimMs(400));
                assert_eq!(set["cost_estimate"], "words");
                assert_eq!(set["prefix_affinity"], false);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(d.sim_args, vec!["--lockstep"]);
        assert_eq!(Variant::parse("in-server").unwrap().dispatch, Dispatch::InServer);
        assert_eq!(Variant::parse("oracle").unwrap().dispatch, Dispatch::Clairvoyant);
        assert_eq!(
            Variant::parse("clairvoyant").unwrap().dispatch,
            Dispatch::Clairvoyant
        );
        // Old records name it `oracle`: it still parses, as the same chooser.
        assert_eq!(
            Variant::parse("oracle").unwrap().front,
            Variant::parse("clairvoyant").unwrap().front
        );
        let tuned =
            Variant::parse("smg-cache-aware:cache-threshold=0.6:balance-abs=4:balance-rel=1.1").unwrap();
        match &tuned.front {
            Front::Smg { args, .. } => assert_eq!(
                args,
                &[
                    "--cache-threshold",
                    "0.6",
                    "--balance-abs-threshold",
                    "4",
                    "--balance-rel-threshold",
                    "1.1"
                ]
            ),
            other => panic!("{other:?}"),
        }
        assert!(Variant::parse("smg:cache-threshold=x").is_err());
        assert_eq!(
            Variant::parse("dprank-wall-1s").unwrap().front,
            Variant::parse("dprank:poll-wall=1000").unwrap().front
        );
        let pd = Variant::parse("smg-pd:prefill=least_load:interval=1").unwrap();
        assert!(pd.is_pd() && pd.uses_smg());
        let old = Variant::parse("old-rule").unwrap();
        assert!(matches!(
            old.front,
            Front::SmgPd {
                minimum_tokens: false,
                ..
            }
        ));
    }

    #[test]
    fn every_alias_parses() {
        for (alias, _, _) in ALIASES {
            let v = Variant::parse(alias).unwrap();
            assert_eq!(v.name, alias);
            assert!(!v.describe().is_empty() && !v.freshness(5.0).is_empty());
        }
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (spec, needle) in [
            ("nope", "unknown variant"),
            ("dprank:poll=0", "positive"),
            ("dprank:gw=0", "1..=32"),
            ("smg:interval=0", "seconds"),
            ("rr:poll=5", "unknown key"),
            ("dprank:gw", "needs a value"),
            ("smg:dp-aware=maybe", "on or off"),
            ("smg:dispatch=oracle", "in-server or round-robin"),
        ] {
            let err = Variant::parse(spec).unwrap_err();
            assert!(err.contains(needle), "{spec}: {err}");
        }
    }

    #[test]
    fn poll_intervals_convert_between_wall_and_simulated_time() {
        assert_eq!(Poll::SimMs(1000).wall_ms(5.0), 200);
        assert_eq!(Poll::SimMs(1000).wall_ms(20.0), 100); // the filter's floor
        assert_eq!(Poll::WallMs(1000).sim_ms(5.0), 5000.0);
        let v = Variant::parse("dprank").unwrap();
        assert!(
            v.freshness(5.0).contains("1000 ms simulated (200 ms wall)"),
            "{}",
            v.freshness(5.0)
        );
        let s = Variant::parse("smg-pd-least-load").unwrap();
        assert!(
            s.freshness(5.0)
                .contains("10 s wall, its default = 50 s simulated"),
            "{}",
            s.freshness(5.0)
        );
    }

    #[test]
    fn features_come_from_the_help_text() {
        let old = SimFeatures::from_help("          - round_robin:    x\n          - minimum_tokens: y\n");
        assert_eq!(old.dispatch_arg(Dispatch::InServer, false), Ok("minimum_tokens"));
        assert!(old.dispatch_arg(Dispatch::Clairvoyant, false).is_err());
        let new = SimFeatures::from_help(
            "--dispatch round_robin|total_tokens|total_requests|room_modulo|oracle\n--prefix-cache on|off",
        );
        assert_eq!(new.dispatch_arg(Dispatch::InServer, false), Ok("total_tokens"));
        assert_eq!(new.dispatch_arg(Dispatch::Clairvoyant, false), Ok("oracle"));
        assert!(new.prefix_cache && !new.cache_report && !old.prefix_cache);
        assert_eq!(new.dispatch_arg(Dispatch::InServer, true), Ok("vllm"));
        assert_eq!(new.dispatch_arg(Dispatch::RoundRobin, true), Ok("vllm"));
        assert_eq!(new.dispatch_arg(Dispatch::Clairvoyant, true), Ok("oracle"));
        assert!(!new.vllm && SimFeatures::from_help("--engine <ENGINE>").vllm);
    }
}
