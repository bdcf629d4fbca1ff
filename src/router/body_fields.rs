//! What the router reads of a request's JSON body: a trusted client's own
//! rank, the request's cost estimate, and prefix affinity's prompt and
//! output budget.

use super::pipeline::PrefillCharge;
use crate::body::JsonObject;
use crate::config::{Config, CostEstimate};
use crate::prefix::{PromptBlocks, RequestPrefix};

/// The body field SGLang reads a request's scheduling priority from.
pub const PRIORITY_FIELD: &str = "priority";

/// Server priority (`admission.server_priority`) of a routed request of
/// `class` (None: the default class): None when it is off; else the
/// value its body carries, if its class has one (a client's own is nulled
/// either way: the gateway decides).
pub(crate) fn server_priority(config: &Config, class: Option<usize>) -> Option<Option<i64>> {
    let admission = config.admission.as_ref()?;
    admission.server_priority_of(class.unwrap_or(admission.default_class))
}

/// Adds server priority's field to a body's `set` and `neutralise` lists.
pub(super) fn with_priority<'a>(
    priority: Option<Option<i64>>,
    set: &mut Vec<(&'a str, String)>,
    neutralise: &mut Vec<&'a str>,
) {
    if let Some(value) = priority {
        if let Some(value) = value {
            set.push((PRIORITY_FIELD, value.to_string()));
        }
        neutralise.push(PRIORITY_FIELD);
    }
}

/// The rank a trusted client asked for, if it asked with a valid integer.
pub(super) fn client_rank(config: &Config, body: &JsonObject) -> Option<u32> {
    config.rank_field_names().into_iter().find_map(|name| {
        let raw = body.raw_value(name)?;
        std::str::from_utf8(raw).ok()?.parse::<u32>().ok()
    })
}

/// Prefix affinity for one request, at the decision's `now_ms`; None when
/// it is off.
pub(super) fn prefix_request<'a>(
    config: &'a Config,
    object: &JsonObject,
    now_ms: u64,
) -> Option<RequestPrefix<'a>> {
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

/// Admission without prefix affinity: the request's prompt, queued on its
/// rank (prefix affinity queues its uncached part itself).
pub(super) fn prefill_charge(
    config: &Config,
    object: &JsonObject,
    prefix: Option<&RequestPrefix>,
) -> Option<PrefillCharge> {
    if config.admission.is_none() || prefix.is_some() {
        return None;
    }
    let streamed = object
        .raw_value("stream")
        .is_some_and(|v| v.trim_ascii() == b"true");
    Some(PrefillCharge::plain(
        object.estimated_tokens(CostEstimate::Bytes).max(1),
        streamed,
    ))
}

/// The request's estimated tokens (`cost_estimate`); under prefix affinity
/// the `bytes` estimate is the hashed prompt's, saving a pass over the body.
pub(super) fn estimated_tokens(config: &Config, object: &JsonObject, prefix: Option<&RequestPrefix>) -> u64 {
    match (config.cost_estimate, prefix) {
        (CostEstimate::Bytes, Some(p)) => p.prompt.tokens().max(1),
        (how, _) => object.estimated_tokens(how),
    }
}

/// Output tokens a request asks for at most (`max_new_tokens` of
/// `/generate`, `max_tokens` or `max_completion_tokens` of the OpenAI
/// routes), clipped as SGLang clips its reservation; a default when absent.
pub(super) fn output_budget(object: &JsonObject) -> u64 {
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
