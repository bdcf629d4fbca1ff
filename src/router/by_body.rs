//! Body mode (`rank_transport: body`, the default): the choice made once
//! the whole JSON body is buffered, the chosen rank written into it. What
//! differs from the other paths: the cost comes from the body, prefix
//! affinity applies, a trusted client's rank constrains the choice, and a
//! request that cannot be routed keeps no client rank field.

use super::body_fields::{
    client_rank, estimated_tokens, prefill_charge, prefix_request, server_priority, with_priority,
};
use super::outcome::{pass_or_reject, reject, PassReason, RejectReason};
use super::pipeline::{self, Committed, Leg, Legs, Path, PrefillCharge, RouteArgs, Unchosen};
use super::snapshot::{Moment, Side, Snapshot};
use super::{Decision, Routed};
use crate::admission::Overloaded;
use crate::body::{may_name_a_rank, BodyError, JsonObject};
use crate::config::Config;
use crate::host::Host;
use crate::prefix::RequestPrefix;
use crate::scheduler::Constraint;
use crate::shared_data::cache::StateCache;
use std::rc::Rc;

/// Decides where a request with this (non-empty) body goes.
pub(super) fn route_body(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    args: &RouteArgs,
) -> Result<Decision, Overloaded> {
    let object = match JsonObject::parse(body) {
        Ok(object) => object,
        Err(e) => return Ok(unreadable(config, host, body, e)),
    };
    let trusted_rank = config
        .keep_client_rank
        .then(|| client_rank(config, &object))
        .flatten();
    let path = BodyPath {
        config,
        object,
        trusted_rank,
        class: args.class,
    };
    pipeline::run(config, host, cache, args, path)
}

/// Body mode's path through the pipeline.
struct BodyPath<'c, 'b> {
    config: &'c Config,
    object: JsonObject<'b>,
    /// A trusted client's rank: the choice is made among ranks with it, and
    /// the client's rank fields stay.
    trusted_rank: Option<u32>,
    /// Admission's class, for the server priority written.
    class: Option<usize>,
}

impl<'c> Path<'c> for BodyPath<'c, '_> {
    fn legs<'p>(&self, config: &Config, pin: Option<&'p str>) -> Legs<'p> {
        Legs {
            first: Leg {
                side: Side::Forward,
                constraint: Constraint {
                    only_rank: self.trusted_rank,
                    pin,
                },
                alternates: config.retry_alternates as usize,
            },
            second: None,
        }
    }

    fn prefix(&self, config: &'c Config, now_ms: u64) -> Option<RequestPrefix<'c>> {
        prefix_request(config, &self.object, now_ms)
    }

    fn unchosen(&self, host: &dyn Host, snapshot: &Snapshot) -> Unchosen {
        Unchosen::Decided(no_candidate(
            self.config,
            host,
            snapshot,
            &self.object,
            self.trusted_rank,
        ))
    }

    fn cost(&self, config: &Config, prefix: Option<&RequestPrefix>) -> u64 {
        estimated_tokens(config, &self.object, prefix)
    }

    fn prefill_charge(&self, config: &Config, prefix: Option<&RequestPrefix>) -> Option<PrefillCharge> {
        prefill_charge(config, &self.object, prefix)
    }

    /// The rank goes into the body, unless the client's own stays; so does
    /// the server priority, if any. No value (an unpinned worker): the
    /// client's rank fields are still neutralised, and the worker's own
    /// balancer picks.
    fn reply(
        self,
        _host: &dyn Host,
        first: Committed,
        _second: Option<Committed>,
        moment: Moment,
    ) -> Decision {
        let config = self.config;
        let (mut set, mut neutralise) = match self.trusted_rank {
            None => (
                first
                    .chosen
                    .value
                    .map(|v| vec![(config.rank_field.as_str(), v.to_string())])
                    .unwrap_or_default(),
                config.rank_field_names(),
            ),
            Some(_) => (Vec::new(), Vec::new()),
        };
        with_priority(server_priority(config, self.class), &mut set, &mut neutralise);
        let body = (!neutralise.is_empty()).then(|| self.object.rewritten(&set, &neutralise));
        Decision::Route(Routed::new(first, moment, body))
    }
}

/// A body that is no JSON object: one that is not JSON but names a rank is
/// refused (a lenient server parser could honour it); the rest pass, or are
/// refused in closed mode.
fn unreadable(config: &Config, host: &dyn Host, body: &[u8], e: BodyError) -> Decision {
    let reason = PassReason::from(e);
    if reason == PassReason::NotJson
        && !config.keep_client_rank
        && may_name_a_rank(body, &config.rank_field_names())
    {
        let refusal = RejectReason::UnreadableRank;
        return reject(host, refusal, refusal.reply());
    }
    pass_or_reject(config, host, reason, None)
}

/// No candidate: a trusted client's rank nobody fresh has, or why nobody
/// could be chosen; the body passes with any client rank field neutralised.
fn no_candidate(
    config: &Config,
    host: &dyn Host,
    snapshot: &Snapshot,
    object: &JsonObject,
    trusted_rank: Option<u32>,
) -> Decision {
    let anyone = Leg {
        side: Side::Forward,
        constraint: Constraint::default(),
        alternates: 0,
    };
    if trusted_rank.is_some() && pipeline::choose(host, snapshot, &anyone, None).is_some() {
        return pass_or_reject(config, host, PassReason::ClientRankUnavailable, None);
    }
    let rank_names = config.rank_field_names();
    let neutralised =
        (trusted_rank.is_none() && object.has_any(&rank_names)).then(|| object.rewritten(&[], &rank_names));
    let reason = pipeline::no_candidate_reason(snapshot, Side::Forward);
    pass_or_reject(config, host, reason, neutralised)
}
