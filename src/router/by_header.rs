//! Header mode (`rank_transport: header`): the rank goes in request
//! headers (the lifecycle writes them) and the body is never changed. The
//! choice is made from the headers alone, before any body byte has arrived
//! (the cost from `content-length`, no prefix affinity), or, under prefix
//! affinity, at the end of the body, whose prompt is read as in body mode.
//! What differs from body mode either way: no client rank, no body written,
//! and a body that is no JSON object is the server's to refuse (routed by
//! load).

use super::body_fields::{estimated_tokens, prefill_charge, prefix_request};
use super::outcome::pass_or_reject;
use super::pipeline::{self, Committed, Leg, Legs, Path, PrefillCharge, RouteArgs, Unchosen};
use super::snapshot::{Moment, Side, Snapshot};
use super::{Decision, Routed};
use crate::admission::Overloaded;
use crate::body::JsonObject;
use crate::config::{Config, CostEstimate, HeaderTransport};
use crate::host::Host;
use crate::prefix::RequestPrefix;
use crate::scheduler::Constraint;
use crate::shared_data::cache::StateCache;
use std::rc::Rc;

/// Tokens a request adds to its rank, from its `content-length` alone:
/// length / 4 (`cost_estimate: bytes`, JSON syntax included), 1 per request
/// (`one`), or the configured default when the length is not known.
pub fn cost_from_length(config: &Config, settings: &HeaderTransport, content_length: Option<u64>) -> u64 {
    match (config.cost_estimate, content_length) {
        (CostEstimate::One, _) => 1,
        (_, Some(length)) => length.div_ceil(4).max(1),
        (_, None) => settings.cost_without_length,
    }
}

/// Decides where a request goes without its body, `cost` the tokens its
/// headers say it adds to its rank until a poll counts it. Alternates get
/// the chosen rank as in body mode: the rank headers travel unchanged with
/// every retry.
pub(super) fn route_by_length(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    cost: u64,
    args: &RouteArgs,
) -> Result<Decision, Overloaded> {
    let path = HeaderPath {
        config,
        object: None,
        cost: Cost::Given(cost),
    };
    pipeline::run(config, host, cache, args, path)
}

/// Header mode under prefix affinity: decides at the end of the (non-empty)
/// body, scoring the prompt it holds as body mode does, and leaves the body
/// as it came. A body that is no JSON object is routed by load, its cost
/// from its length.
pub(super) fn route_by_prompt(
    config: &Rc<Config>,
    settings: &HeaderTransport,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    args: &RouteArgs,
) -> Result<Decision, Overloaded> {
    let path = HeaderPath {
        config,
        object: JsonObject::parse(body).ok(),
        cost: Cost::OfBody(cost_from_length(config, settings, Some(body.len() as u64))),
    };
    pipeline::run(config, host, cache, args, path)
}

/// Where header mode's cost comes from.
#[derive(Debug, Clone, Copy)]
enum Cost {
    /// The headers' (`content-length`).
    Given(u64),
    /// The body's JSON object; this, from its length, if it is none.
    OfBody(u64),
}

/// Header mode's path through the pipeline: the forwarded pool, a test pin
/// if any, the configured alternates, no body written.
struct HeaderPath<'c, 'b> {
    config: &'c Config,
    /// The body's JSON object, when the decision waits for the body.
    object: Option<JsonObject<'b>>,
    cost: Cost,
}

impl<'c> Path<'c> for HeaderPath<'c, '_> {
    fn legs<'p>(&self, config: &Config, pin: Option<&'p str>) -> Legs<'p> {
        Legs {
            first: Leg {
                side: Side::Forward,
                constraint: Constraint { only_rank: None, pin },
                alternates: config.retry_alternates as usize,
            },
            second: None,
        }
    }

    fn prefix(&self, config: &'c Config, now_ms: u64) -> Option<RequestPrefix<'c>> {
        self.object
            .as_ref()
            .and_then(|o| prefix_request(config, o, now_ms))
    }

    /// Nobody can be chosen: passed on with no rank header (or refused in
    /// closed mode), the body untouched.
    fn unchosen(&self, host: &dyn Host, snapshot: &Snapshot) -> Unchosen {
        let reason = pipeline::no_candidate_reason(snapshot, Side::Forward);
        Unchosen::Decided(pass_or_reject(self.config, host, reason, None))
    }

    fn cost(&self, config: &Config, prefix: Option<&RequestPrefix>) -> u64 {
        match (&self.object, self.cost) {
            (Some(object), _) => estimated_tokens(config, object, prefix),
            (None, Cost::Given(cost) | Cost::OfBody(cost)) => cost,
        }
    }

    /// Admission's queue: without a JSON object the length is all there is
    /// of the prompt, and whether the answer streams is not known, so it
    /// leaves the queue when a poll counts it (or at its end).
    fn prefill_charge(&self, config: &Config, prefix: Option<&RequestPrefix>) -> Option<PrefillCharge> {
        match &self.object {
            Some(object) => prefill_charge(config, object, prefix),
            None => {
                let cost = self.cost(config, prefix);
                config
                    .admission
                    .as_ref()
                    .map(|_| PrefillCharge::plain(cost, false))
            }
        }
    }

    fn reply(
        self,
        _host: &dyn Host,
        first: Committed,
        _second: Option<Committed>,
        moment: Moment,
    ) -> Decision {
        Decision::Route(Routed::new(first, moment, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_data::testing::config;

    #[test]
    fn cost_comes_from_the_length_or_the_default() {
        let c = config(r#","rank_transport":"header","cost_without_length":77"#);
        let h = c.header_transport().unwrap();
        assert_eq!(cost_from_length(&c, h, Some(4001)), 1001);
        assert_eq!(cost_from_length(&c, h, Some(1)), 1);
        assert_eq!(cost_from_length(&c, h, None), 77);
        let one = config(r#","rank_transport":"header","cost_estimate":"one""#);
        assert_eq!(
            cost_from_length(&one, one.header_transport().unwrap(), Some(4001)),
            1
        );
    }
}
