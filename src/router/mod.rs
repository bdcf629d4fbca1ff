//! Per-request routing: body in, decision out. Knows nothing of proxy-wasm;
//! `request.rs` applies the decision. Regular mode is here; PD mode in
//! `pd.rs`; every local answer in `replies.rs`.

mod by_header;
mod pd;
mod replies;

pub use by_header::{cost_from_length, route_by_headers};
pub use pd::{mark_unreachable, prefill_health, prefill_not_sent, prefill_outcome, PdRouted};
pub use replies::Reply;

use crate::body::{may_name_a_rank, BodyError, JsonObject};
use crate::config::{Config, CostEstimate, FailMode};
use crate::health::{self, Health};
use crate::host::Host;
use crate::metrics;
use crate::prefix::{PromptBlocks, RequestPrefix};
use crate::scheduler::{self, Candidate, Constraint, Context, Pool};
use crate::state::{Charge, PrefillTicket, Ticket};
use crate::store::{self, cache::StateCache};
use std::borrow::Cow;
use std::rc::Rc;

/// Why a request went through untouched (also the suffix of its counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    Method,
    Path,
    EmptyBody,
    Encoded,
    NotJson,
    NotObject,
    NoFreshData,
    /// A trusted client asked for a rank no fresh worker has.
    ClientRankUnavailable,
    /// Not JSON to dprank, yet it names a rank a lenient server parser could honour.
    UnreadableRank,
    /// Workers have fresh data, but none is in rotation (ejected by passive
    /// health, or unhealthy in Envoy).
    NoneInRotation,
}

impl PassReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PassReason::Method => "method",
            PassReason::Path => "path",
            PassReason::EmptyBody => "empty_body",
            PassReason::Encoded => "content_encoding",
            PassReason::NotJson => "not_json",
            PassReason::NotObject => "not_object",
            PassReason::NoFreshData => "no_fresh_data",
            PassReason::ClientRankUnavailable => "client_rank_unavailable",
            PassReason::UnreadableRank => "unreadable_rank",
            PassReason::NoneInRotation => "none_in_rotation",
        }
    }
}

/// A worker chosen for a request and, when load data allowed a choice, its rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// Index in `Config::all_workers`.
    pub worker: usize,
    pub rank: Option<u32>,
    /// Value for the route header (`ip:port`).
    pub endpoint: Rc<str>,
}

impl Chosen {
    fn new(cache: &StateCache, worker: usize, rank: Option<u32>) -> Chosen {
        Chosen {
            worker,
            rank,
            endpoint: cache.endpoint(worker),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    pub to: Chosen,
    /// Other workers with the same rank, cheapest first, for Envoy's retries.
    pub alternates: Vec<Chosen>,
    /// The rewritten body, or None to keep the client's (a trusted client rank).
    pub body: Option<Vec<u8>>,
    /// To release when the request ends; None if accounting could not be written.
    pub ticket: Option<Ticket>,
    /// The health record listed nothing when the request was routed: its
    /// success needs no write.
    pub health_was_clean: bool,
    /// When it was routed (the clock the choice read).
    pub routed_at_ms: u64,
    /// Prefix affinity: the prefill charged to the rank, to take back at
    /// the first response byte (or the end).
    pub prefill: Option<PrefillTicket>,
}

/// The route header's value: the chosen worker, then its alternates
/// (`override_host` takes the next one at each retry).
pub fn route_value<'a>(to: &'a Chosen, alternates: &[Chosen]) -> Cow<'a, str> {
    if alternates.is_empty() {
        return Cow::Borrowed(&to.endpoint);
    }
    let mut value = String::from(&*to.endpoint);
    for alt in alternates {
        value.push(',');
        value.push_str(&alt.endpoint);
    }
    Cow::Owned(value)
}

#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    Route(Routed),
    PassThrough {
        reason: PassReason,
        /// The body with untrusted client rank fields neutralised, if it had any.
        body: Option<Vec<u8>>,
    },
    /// PD mode: send `prefill_body` to the prefill worker, forward the decode body.
    Pd(PdRouted),
    Reject(Reply),
}

/// Counts a request that is not routed for a reason seen before its body.
pub fn pass_early(host: &dyn Host, reason: PassReason) {
    host.count(&metrics::passthrough(reason.as_str()), 1);
}

/// Counts a pass-through and, in closed mode, turns routing failures into errors.
fn pass_or_reject(config: &Config, host: &dyn Host, reason: PassReason, body: Option<Vec<u8>>) -> Decision {
    let refusal = match (config.fail_mode, reason) {
        // Passing it on would let the client pick its rank: refused in every mode.
        (_, PassReason::UnreadableRank) => Some(Reply::unreadable_rank()),
        (FailMode::Closed, PassReason::NotJson | PassReason::NotObject) => Some(Reply::not_an_object()),
        (FailMode::Closed, PassReason::ClientRankUnavailable) => Some(Reply::client_rank_unavailable()),
        (FailMode::Closed, PassReason::NoFreshData) => Some(Reply::no_fresh_data()),
        (FailMode::Closed, PassReason::NoneInRotation) => Some(Reply::none_in_rotation()),
        _ => None,
    };
    match refusal {
        Some(reply) => reject(host, reason, reply),
        None => {
            pass_early(host, reason);
            Decision::PassThrough { reason, body }
        }
    }
}

/// Counts a refusal and answers it.
fn reject(host: &dyn Host, reason: PassReason, reply: Reply) -> Decision {
    host.count(&metrics::rejected(reason.as_str()), 1);
    Decision::Reject(reply)
}

fn parse_body(body: &[u8]) -> Result<JsonObject<'_>, PassReason> {
    JsonObject::parse(body).map_err(|e| match e {
        BodyError::NotJson => PassReason::NotJson,
        BodyError::NotObject => PassReason::NotObject,
    })
}

/// The rank a trusted client asked for, if it asked with a valid integer.
fn client_rank(config: &Config, body: &JsonObject) -> Option<u32> {
    config.rank_field_names().into_iter().find_map(|name| {
        let raw = body.raw_value(name)?;
        std::str::from_utf8(raw).ok()?.parse::<u32>().ok()
    })
}

/// The routed pool (`prefill: false`) or PD's prefill pool, with their
/// states as last read into `cache`.
fn pool<'a>(config: &'a Config, cache: &'a StateCache, prefill: bool) -> Pool<'a> {
    let (workers, offset) = match (prefill, config.pd()) {
        (true, Some(pd)) => (pd.prefill.as_slice(), config.prefill_offset()),
        _ => (config.routed(), 0),
    };
    Pool {
        workers,
        states: cache
            .states()
            .get(offset..offset + workers.len())
            .unwrap_or_default(),
        loads: cache.loads(),
        offset,
    }
}

/// What a choice sees besides the pool: the health record and, for this
/// request, whether it may probe a worker or rank past its cooldown.
pub(crate) struct Sight<'h> {
    pub health: &'h Health,
    pub now_ms: u64,
    pub admit_probing: bool,
}

impl<'h> Sight<'h> {
    /// What this request sees of `health` (the record as last read into the
    /// VM's cache; empty if the configuration reads none), and the clock.
    pub(crate) fn new(config: &Config, host: &dyn Host, health: &'h Health, tie_breaker: u64) -> Sight<'h> {
        let now_ms = host.now_ms();
        let admit_probing = config
            .passive_health
            .as_ref()
            .is_some_and(|p| health.any_probing(now_ms) && health::is_probe(p.probe_share, tie_breaker));
        Sight {
            health,
            now_ms,
            admit_probing,
        }
    }

    fn context<'a>(&'a self, config: &Config, constraint: Constraint<'a>, tie_breaker: u64) -> Context<'a> {
        Context {
            now_ms: self.now_ms,
            stale_after_ms: config.stale_after_ms,
            constraint,
            tie_breaker,
            health: self.health,
            admit_probing: self.admit_probing,
            prefix: None,
            pick: config.pick,
            gateways: config.gateways,
        }
    }

    /// The best candidate: in rotation; else, when nothing is (and the
    /// request was not already a probe), one past its cooldown, like
    /// Envoy's panic threshold, rather than the fallback policy's pick. With
    /// up to `alternates` retry alternates for it, by load. Under prefix
    /// affinity the indexes of the workers each attempt scores are read
    /// into `prefix` first.
    #[allow(clippy::too_many_arguments)]
    fn pick(
        &self,
        config: &Config,
        host: &dyn Host,
        pool: &Pool,
        constraint: Constraint,
        tie_breaker: u64,
        mut prefix: Option<&mut RequestPrefix>,
        alternates: usize,
    ) -> Option<(Candidate, Vec<Candidate>)> {
        let ctx = self.context(config, constraint, tie_breaker);
        choose_reading(config, host, pool, ctx, prefix.as_deref_mut(), alternates).or_else(|| {
            let probing = !ctx.admit_probing && self.health.any_probing(self.now_ms);
            probing
                .then(|| {
                    let panic = Context {
                        admit_probing: true,
                        ..ctx
                    };
                    choose_reading(config, host, pool, panic, prefix, alternates)
                })
                .flatten()
        })
    }

    /// Why a pool with no candidate for `constraint` has none: every
    /// worker with fresh data is out of rotation, or there is no fresh data.
    fn no_candidate_reason(&self, config: &Config, pool: &Pool, constraint: Constraint) -> PassReason {
        if self.health.is_empty() {
            return PassReason::NoFreshData;
        }
        let blind = Context {
            health: &health::NO_HEALTH,
            ..self.context(config, constraint, 0)
        };
        match scheduler::choose(pool, &blind) {
            Some(_) => PassReason::NoneInRotation,
            None => PassReason::NoFreshData,
        }
    }
}

/// `scheduler::choose_with_alternates` under `ctx`, with prefix affinity
/// when `prefix` is given: the indexes of the workers the choice will
/// score, those the filters keep, are read into it first (each once per
/// request), so the scorers score what was read.
fn choose_reading(
    config: &Config,
    host: &dyn Host,
    pool: &Pool,
    ctx: Context,
    prefix: Option<&mut RequestPrefix>,
    alternates: usize,
) -> Option<(Candidate, Vec<Candidate>)> {
    let Some(prefix) = prefix else {
        return scheduler::choose_with_alternates(pool, &ctx, alternates);
    };
    scheduler::scored_workers(pool, &ctx, |worker| {
        if prefix.wants(worker) {
            prefix.insert(
                worker,
                store::read_prefix_index(config, host, pool.offset + worker),
            );
        }
    });
    let ctx = Context {
        prefix: Some(prefix),
        ..ctx
    };
    scheduler::choose_with_alternates(pool, &ctx, alternates)
}

/// The best (worker, rank) of a pool under a constraint, and up to
/// `alternates` workers Envoy should retry it on (by load, with its rank);
/// `worker` indexes `Config::all_workers`. A pin that names no candidate is
/// ignored (and counted): it is a preference, not a constraint.
#[allow(clippy::too_many_arguments)]
fn choose(
    config: &Config,
    host: &dyn Host,
    sight: &Sight,
    pool: &Pool,
    constraint: Constraint,
    tie_breaker: u64,
    mut prefix: Option<&mut RequestPrefix>,
    alternates: usize,
) -> Option<(Candidate, Vec<Candidate>)> {
    let mut pick = sight.pick(
        config,
        host,
        pool,
        constraint,
        tie_breaker,
        prefix.as_deref_mut(),
        alternates,
    );
    if pick.is_none() && constraint.pin.is_some() {
        host.count(metrics::PIN_IGNORED, 1);
        let unpinned = Constraint {
            pin: None,
            ..constraint
        };
        pick = sight.pick(config, host, pool, unpinned, tie_breaker, prefix, alternates);
    }
    pick
}

/// The retry alternates `choose` found, as route targets; counted when
/// there is none though the configuration asks for some.
fn retry_targets(config: &Config, host: &dyn Host, cache: &StateCache, found: &[Candidate]) -> Vec<Chosen> {
    if config.retry_alternates == 0 {
        return Vec::new();
    }
    if found.is_empty() {
        host.count(metrics::NO_ALTERNATE, 1);
    }
    found
        .iter()
        .map(|c| Chosen::new(cache, c.worker, Some(c.rank)))
        .collect()
}

/// Prefix affinity for one request, at the decision's `now_ms`; None when
/// it is off.
fn prefix_request<'a>(config: &'a Config, object: &JsonObject, now_ms: u64) -> Option<RequestPrefix<'a>> {
    let settings = config.prefix.as_ref()?;
    let streamed = object
        .raw_value("stream")
        .is_some_and(|v| v.trim_ascii() == b"true");
    let prompt = PromptBlocks::of(object, settings.block_bytes);
    Some(RequestPrefix::new(
        settings,
        prompt,
        streamed,
        output_budget(object),
        now_ms,
    ))
}

/// The request's estimated tokens (`cost_estimate`); under prefix affinity
/// the `bytes` estimate is the hashed prompt's, saving a pass over the body.
fn estimated_tokens(config: &Config, object: &JsonObject, prefix: Option<&RequestPrefix>) -> u64 {
    match (config.cost_estimate, prefix) {
        (CostEstimate::Bytes, Some(a)) => a.prompt.tokens().max(1),
        (how, _) => object.estimated_tokens(how),
    }
}

/// Output tokens a request asks for at most (`max_new_tokens` of
/// `/generate`, `max_tokens` or `max_completion_tokens` of the OpenAI
/// routes), clipped as SGLang clips its reservation; a default when absent.
fn output_budget(object: &JsonObject) -> u64 {
    const DEFAULT_OUTPUT: u64 = 256;
    const CLIP: u64 = 4096;
    let number = |raw: &[u8]| std::str::from_utf8(raw).ok()?.trim().parse::<u64>().ok();
    let from_params = object.raw_value("sampling_params").and_then(|raw| {
        let params: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(raw).ok()?;
        params.get("max_new_tokens")?.as_u64()
    });
    from_params
        .or_else(|| object.raw_value("max_tokens").and_then(number))
        .or_else(|| object.raw_value("max_completion_tokens").and_then(number))
        .unwrap_or(DEFAULT_OUTPUT)
        .min(CLIP)
}

/// What prefix affinity charges the chosen (worker, rank) for a request, and
/// whether its response is streamed.
struct Prefill {
    charge: Charge,
    streamed: bool,
}

impl Prefill {
    fn of(prefix: Option<&RequestPrefix>, pool_worker: usize, rank: u32) -> Option<Prefill> {
        prefix.map(|p| Prefill {
            charge: Charge {
                prompt: p.prompt.tokens(),
                cached: p.cached(pool_worker, rank as usize),
            },
            streamed: p.streamed,
        })
    }
}

/// Adds a routed request's estimate (and, under prefix affinity, its
/// prefill, in the same write) to its rank and counts the route.
fn account(
    config: &Config,
    host: &dyn Host,
    cache: &mut StateCache,
    worker: usize,
    rank: u32,
    cost: u64,
    prefill: Option<Prefill>,
) -> (Option<Ticket>, Option<PrefillTicket>) {
    let tickets = cache.write(config, host, worker, |state| {
        let ticket = state.add(worker, rank, cost)?;
        let prefill = prefill
            .as_ref()
            .and_then(|p| state.charge_prefill(worker, rank, p.charge, p.streamed));
        Some((ticket, prefill))
    });
    if tickets.is_none() {
        host.count(metrics::ACCOUNTING_SKIPPED, 1);
    }
    host.count(cache.routed_name(worker, rank), 1);
    tickets.map_or((None, None), |(t, p)| (Some(t), p))
}

/// Records the routed prompt in the chosen worker's prefix index, under
/// the cas of the value this request read (read again only if another
/// thread wrote in between).
fn record(
    config: &Config,
    host: &dyn Host,
    prefix: Option<&mut RequestPrefix>,
    cache: &StateCache,
    pool_offset: usize,
    worker: usize,
    rank: u32,
) {
    let Some(prefix) = prefix.filter(|p| p.records()) else {
        return;
    };
    let capacity = cache
        .states()
        .get(worker)
        .and_then(Option::as_ref)
        .and_then(|s| s.prefill.capacity(rank as usize));
    let first = prefix.take_value(worker - pool_offset);
    store::update_index(config, host, worker, first, prefix.record_on(rank, capacity));
}

/// Under prefix affinity, the request's prefill is over: its first response
/// byte came (streamed), or it ended. `config` is the one it was routed with.
pub fn prefill_started(config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache, ticket: &PrefillTicket) {
    cache.write_as_routed(config, host, ticket.worker, |state| {
        state.prefill_started(ticket);
        Some(())
    });
}

/// Gives back a routed request's estimate when its stream ends (and, under
/// prefix affinity, its prefill charge when no response byte came first);
/// `config` is the one it was routed with.
pub fn release(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    ticket: &Ticket,
    prefill: Option<&PrefillTicket>,
) {
    if prefill.is_none() && cache.covers(config, ticket) {
        // A snapshot counted the request: nothing is left to give back.
        return;
    }
    cache.write_as_routed(config, host, ticket.worker, |state| {
        let released = state.release(ticket);
        match prefill {
            Some(prefill) => {
                state.prefill_started(prefill);
                Some(())
            }
            None => released.then_some(()),
        }
    });
}

/// Decides where a request with this body goes. `cache` is this VM's copy
/// of the workers' states and health record (read here). `pin` is the test-only pin header
/// (already None unless the config enables it). `tie_breaker` varies per
/// request so equal loads spread.
pub fn route(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    if let Some(pd) = config.pd() {
        return pd::route_pd(config, pd, host, cache, body, pin, tie_breaker);
    }
    if body.is_empty() {
        // A chunked or HTTP/2 request whose body turned out empty.
        pass_early(host, PassReason::EmptyBody);
        return Decision::PassThrough {
            reason: PassReason::EmptyBody,
            body: None,
        };
    }
    let rank_names = config.rank_field_names();
    let object = match parse_body(body) {
        Ok(o) => o,
        Err(PassReason::NotJson) if !config.keep_client_rank && may_name_a_rank(body, &rank_names) => {
            return pass_or_reject(config, host, PassReason::UnreadableRank, None)
        }
        Err(reason) => return pass_or_reject(config, host, reason, None),
    };
    let trusted_rank = config
        .keep_client_rank
        .then(|| client_rank(config, &object))
        .flatten();
    cache.refresh(config, host);
    let pool = pool(config, cache, false);
    let sight = Sight::new(config, host, cache.health(), tie_breaker);
    let constraint = Constraint {
        only_rank: trusted_rank,
        pin,
    };
    let mut prefix = prefix_request(config, &object, sight.now_ms);
    let Some((chosen, found)) = choose(
        config,
        host,
        &sight,
        &pool,
        constraint,
        tie_breaker,
        prefix.as_mut(),
        config.retry_alternates as usize,
    ) else {
        let unconstrained = choose(config, host, &sight, &pool, Constraint::default(), 0, None, 0);
        if trusted_rank.is_some() && unconstrained.is_some() {
            return pass_or_reject(config, host, PassReason::ClientRankUnavailable, None);
        }
        let neutralised = (trusted_rank.is_none() && object.has_any(&rank_names))
            .then(|| object.rewritten(&[], &rank_names));
        let reason = sight.no_candidate_reason(config, &pool, Constraint::default());
        return pass_or_reject(config, host, reason, neutralised);
    };
    let Candidate { worker, rank, .. } = chosen;
    let alternates = retry_targets(config, host, cache, &found);
    let (health_was_clean, routed_at_ms, offset) =
        (sight.health.entries.is_empty(), sight.now_ms, pool.offset);
    let cost = estimated_tokens(config, &object, prefix.as_ref());
    let prefill = Prefill::of(prefix.as_ref(), worker - offset, rank);
    let (ticket, prefill) = account(config, host, cache, worker, rank, cost, prefill);
    record(config, host, prefix.as_mut(), cache, offset, worker, rank);
    let body = trusted_rank.is_none().then(|| {
        let set = [(config.rank_field.as_str(), rank.to_string())];
        object.rewritten(&set, &rank_names)
    });
    Decision::Route(Routed {
        to: Chosen::new(cache, worker, Some(rank)),
        alternates,
        body,
        ticket,
        health_was_clean,
        routed_at_ms,
        prefill,
    })
}

#[cfg(test)]
mod affinity_tests;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
