//! Header mode (`rank_transport: header`): the choice made from the request
//! headers alone, before any body byte has arrived. The cost is what the
//! request lifecycle estimated from `content-length`.

use super::{account, choose, pass_or_reject, pool, Chosen, Decision, PassReason, Routed};
use crate::config::Config;
use crate::host::Host;
use crate::scheduler::{Candidate, Constraint};
use crate::store::cache::StateCache;
use std::rc::Rc;

/// Decides where a request goes without its body. `cache` is this VM's copy
/// of the workers' states (read here); `pin` the test-only pin header;
/// `cost` the tokens the request adds to its rank until a poll counts it.
pub fn route_by_headers(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    cost: u64,
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    cache.refresh(config, host);
    let pool = pool(config, cache, false);
    let constraint = Constraint { only_rank: None, pin };
    let Some(Candidate { worker, rank, .. }) = choose(config, host, &pool, constraint, tie_breaker) else {
        return pass_or_reject(config, host, PassReason::NoFreshData, None);
    };
    let ticket = account(config, host, cache, worker, rank, cost);
    Decision::Route(Routed {
        to: Chosen::new(cache, worker, Some(rank)),
        body: None,
        ticket,
    })
}
