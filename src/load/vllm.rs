//! The per-engine figures of a vLLM server's `/metrics` (Prometheus text):
//! requests running and waiting, KV-cache usage and the prefix-cache
//! counters, each labelled `engine="N"` and `model_name`, and the server's
//! KV cache size from `vllm:cache_config_info`. Every other metric and label
//! is ignored. The engines are numbered as the server numbers them, one run
//! S..S+N-1 (a server of a multi-node deployment manages engines S.. of the
//! group), or the report is refused whole; a figure that is missing or unusable is
//! unknown (`None`). The rules and why: docs/vllm-metrics.md. How the
//! figures become dprank's load: `vllm/mapping.rs`.

pub mod mapping;

use super::prometheus::{self, Label, Line, Sample};
use super::{rank_run, Answer, LoadError, LoadSource, Poll, Reading, SourceMemory, MAX_RANK_NUMBER};
use crate::config::{Config, Engine, MAX_DP_SIZE};
use std::borrow::Cow;
use std::fmt;

/// The largest `/metrics` answer read (vLLM writes about 40 KiB per engine).
pub const MAX_METRICS_BYTES: usize = 8 << 20;

/// vLLM's `/metrics`, asked for plain text. The poll sends no
/// `accept-encoding`: a gzipped answer could not be read.
const METRICS: Poll = Poll {
    path: "/metrics",
    accept: "text/plain",
};

/// vLLM's load source: the per-engine figures of `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vllm<'c> {
    /// Only the figures of this `model_name`; None: the one model reported.
    pub model: Option<&'c str>,
}

impl Vllm<'_> {
    pub fn of(config: &Config) -> Vllm<'_> {
        let model = match &config.engine {
            Engine::Vllm { served_model_name } => served_model_name.as_deref(),
            _ => None,
        };
        Vllm { model }
    }
}

impl LoadSource for Vllm<'_> {
    fn poll(&self, _memory: &SourceMemory) -> Poll {
        METRICS
    }

    /// Engines that are not one run S..S+N-1 refuse the report, as
    /// SGLang's ranks do. Any other unusable answer is a failed poll, so that the
    /// worker keeps its last good snapshot until it goes stale: not vLLM's,
    /// too large, two models, cut short (vLLM ends every answer with a line
    /// feed), or an engine without a usable count of its running or waiting
    /// requests or its KV usage (vLLM writes all three for every engine).
    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer {
        if status != 200 {
            return Answer::Failed(format!("HTTP {status} from {}", poll.path));
        }
        if !body.is_empty() && !body.ends_with(b"\n") && body.len() <= MAX_METRICS_BYTES {
            return Answer::Failed("vLLM metrics answer cut short (no line feed at its end)".into());
        }
        let report = match parse_vllm_metrics(body, self.model) {
            Ok(report) => report,
            Err(VllmMetricsError::BadEngines(why)) => return Answer::Refused(why),
            Err(VllmMetricsError::TooManyEngines(engine)) => {
                return Answer::Refused(format!(
                "engine {engine}, past the limit of {MAX_DP_SIZE} engines numbered below {MAX_RANK_NUMBER}"
            ))
            }
            Err(e) => return Answer::Failed(e.to_string()),
        };
        match incomplete(&report) {
            Some(why) => Answer::Failed(why),
            None => Answer::Report(Reading::new(report)),
        }
    }
}

/// The first engine without a usable running or waiting count or KV usage.
fn incomplete(report: &VllmReport) -> Option<String> {
    report.engines.iter().enumerate().find_map(|(engine, f)| {
        let missing = [
            (f.running.is_none(), Figure::Running),
            (f.waiting.is_none(), Figure::Waiting),
            (f.kv_usage.is_none(), Figure::KvUsage),
        ]
        .into_iter()
        .find_map(|(missing, figure)| missing.then_some(figure))?;
        Some(format!(
            "vLLM metrics answer without a usable {} for engine {engine} (missing, NaN, negative or out of range)",
            missing.name()
        ))
    })
}

/// What one engine reports; `None` = missing or unusable.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineFigures {
    /// `vllm:num_requests_running`.
    pub running: Option<u64>,
    /// `vllm:num_requests_waiting`.
    pub waiting: Option<u64>,
    /// `vllm:kv_cache_usage_perc`, 0 to 1 (1 = full).
    pub kv_usage: Option<f64>,
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up since start.
    pub prefix_queries: Option<u64>,
    /// `vllm:prefix_cache_hits_total`: of those, tokens found cached.
    pub prefix_hits: Option<u64>,
}

/// A readable `/metrics` answer.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmReport {
    /// The number of the first engine (`engine` label): the server's
    /// `engines[i]` is engine `first_engine + i`.
    pub first_engine: u32,
    /// By engine, from the first.
    pub engines: Vec<EngineFigures>,
    /// The `model_name` the figures are labelled with.
    pub model_name: String,
    /// The KV cache of the server's engines together, in tokens:
    /// `num_gpu_blocks` x `block_size` of `vllm:cache_config_info` (vLLM
    /// sums the blocks of its engines there). None: not reported, not
    /// numbers, or two different values.
    pub kv_capacity_tokens: Option<u64>,
    /// Lines that broke the format (or a last line without its line feed):
    /// skipped.
    pub skipped_lines: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmMetricsError {
    /// The answer is larger than [`MAX_METRICS_BYTES`].
    TooLarge(usize),
    /// No per-engine figure at all: not a vLLM `/metrics` answer (an error
    /// page, compressed bytes, an empty body), or none for the model asked
    /// for (`seen`: a model it does report).
    NoFigures {
        model: Option<String>,
        seen: Option<String>,
    },
    /// Figures for two models, and no model name to choose one.
    SeveralModels(String, String),
    /// The engines are not one run S..S+N-1 (a gap, an engine label that is
    /// no engine number or is missing, the same figure twice for an engine).
    BadEngines(String),
    /// An engine number at or above `MAX_RANK_NUMBER`, or more than
    /// `MAX_DP_SIZE` engines.
    TooManyEngines(String),
}

impl fmt::Display for VllmMetricsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooLarge(n) => write!(f, "vLLM metrics answer of {n} bytes is over the {MAX_METRICS_BYTES}-byte limit"),
            Self::NoFigures { model: None, .. } => {
                write!(f, "no vLLM per-engine figures in the metrics answer")
            }
            Self::NoFigures {
                model: Some(m),
                seen: None,
            } => write!(f, "no vLLM per-engine figures for model {m:?} in the metrics answer"),
            Self::NoFigures {
                model: Some(m),
                seen: Some(other),
            } => write!(
                f,
                "no vLLM per-engine figures for model {m:?} in the metrics answer (it reports {other:?})"
            ),
            Self::SeveralModels(a, b) => write!(
                f,
                "vLLM metrics answer refused: figures for models {a:?} and {b:?}; configure the model name to read"
            ),
            Self::BadEngines(why) => write!(f, "vLLM metrics answer refused: its engines are not one run S..S+N-1 ({why})"),
            Self::TooManyEngines(engine) => {
                write!(f, "vLLM metrics answer names engine {engine} (limits: {MAX_DP_SIZE} engines, numbered below {MAX_RANK_NUMBER})")
            }
        }
    }
}

impl std::error::Error for VllmMetricsError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Figure {
    Running,
    Waiting,
    KvUsage,
    PrefixQueries,
    PrefixHits,
}

impl Figure {
    /// The figure a sample name carries: `vllm:` as vLLM names it, or `vllm_`
    /// as prometheus_client writes sample names in OpenMetrics text.
    fn of(sample_name: &str) -> Option<Figure> {
        let rest = sample_name
            .strip_prefix("vllm:")
            .or_else(|| sample_name.strip_prefix("vllm_"))?;
        Some(match rest {
            "num_requests_running" => Figure::Running,
            "num_requests_waiting" => Figure::Waiting,
            "kv_cache_usage_perc" => Figure::KvUsage,
            "prefix_cache_queries_total" => Figure::PrefixQueries,
            "prefix_cache_hits_total" => Figure::PrefixHits,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Figure::Running => "vllm:num_requests_running",
            Figure::Waiting => "vllm:num_requests_waiting",
            Figure::KvUsage => "vllm:kv_cache_usage_perc",
            Figure::PrefixQueries => "vllm:prefix_cache_queries_total",
            Figure::PrefixHits => "vllm:prefix_cache_hits_total",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }

    fn store(self, into: &mut EngineFigures, value: f64) {
        match self {
            Figure::Running => into.running = count(value),
            Figure::Waiting => into.waiting = count(value),
            Figure::KvUsage => into.kv_usage = Some(value).filter(|v| (0.0..=1.0).contains(v)),
            Figure::PrefixQueries => into.prefix_queries = count(value),
            Figure::PrefixHits => into.prefix_hits = count(value),
        }
    }
}

/// A non-negative count; finite fractions are rounded to the nearest integer.
fn count(v: f64) -> Option<u64> {
    (v.is_finite() && v >= 0.0 && v <= u64::MAX as f64).then(|| v.round() as u64)
}

/// An engine label as vLLM writes it (`str(index)`): decimal digits, no sign,
/// no leading zero. `Ok(None)` for digits too large for any engine.
fn engine_number(label: &str) -> Result<Option<usize>, ()> {
    let canonical = !label.is_empty()
        && label.bytes().all(|b| b.is_ascii_digit())
        && (label == "0" || !label.starts_with('0'));
    if !canonical {
        return Err(());
    }
    Ok(label.parse::<usize>().ok())
}

/// The figures of every engine in a `/metrics` answer. With `model`, only
/// samples labelled `model_name="<model>"` are read; without, the answer
/// must report one model only.
pub fn parse_vllm_metrics(body: &[u8], model: Option<&str>) -> Result<VllmReport, VllmMetricsError> {
    if body.len() > MAX_METRICS_BYTES {
        return Err(VllmMetricsError::TooLarge(body.len()));
    }
    // By engine number, sorted: its figures, and which it has reported
    // (one bit per figure).
    let mut engines: Vec<(usize, EngineFigures, u8)> = Vec::new();
    let mut read_model: Option<Cow<'_, str>> = None;
    let mut other_model: Option<Cow<'_, str>> = None;
    let mut skipped_lines = 0;
    let mut capacity = Capacity::Unseen;
    for line in prometheus::lines(body) {
        let sample = match line {
            Line::Sample(sample) => sample,
            Line::Invalid(_) | Line::Unterminated => {
                skipped_lines += 1;
                continue;
            }
            Line::Blank | Line::Help { .. } | Line::Type { .. } | Line::Eof | Line::Comment => continue,
        };
        let Some(figure) = Figure::of(sample.name) else {
            if is_cache_config(sample.name) {
                capacity.read(&sample);
            }
            continue;
        };
        let Some((model_name, engine_label)) = labels_of(&sample) else {
            skipped_lines += 1;
            continue;
        };
        if model.is_some_and(|wanted| model_name != wanted) {
            other_model.get_or_insert(model_name);
            continue;
        }
        match &read_model {
            None => read_model = Some(model_name),
            Some(first) if *first != model_name => {
                return Err(VllmMetricsError::SeveralModels(
                    first.to_string(),
                    model_name.into_owned(),
                ));
            }
            Some(_) => {}
        }
        let engine = engine_of(figure, engine_label)?;
        let at = match engines.binary_search_by_key(&engine, |e| e.0) {
            Ok(at) => at,
            Err(at) if engines.len() < MAX_DP_SIZE as usize => {
                engines.insert(at, (engine, EngineFigures::default(), 0));
                at
            }
            Err(_) => return Err(VllmMetricsError::TooManyEngines(engine.to_string())),
        };
        let Some((_, figures, bits)) = engines.get_mut(at) else {
            continue;
        };
        if *bits & figure.bit() != 0 {
            return Err(VllmMetricsError::BadEngines(format!(
                "{} for engine {engine} appears twice",
                figure.name()
            )));
        }
        *bits |= figure.bit();
        figure.store(figures, sample.value);
    }
    let Some(model_name) = read_model else {
        return Err(VllmMetricsError::NoFigures {
            model: model.map(str::to_string),
            seen: other_model.map(Cow::into_owned),
        });
    };
    let first_engine = match rank_run(engines.iter().map(|e| e.0 as u64), None) {
        Ok((first, _)) => first,
        Err(LoadError::BadRanks(why)) => return Err(VllmMetricsError::BadEngines(why)),
        Err(e) => return Err(VllmMetricsError::BadEngines(e.to_string())),
    };
    Ok(VllmReport {
        first_engine,
        engines: engines.into_iter().map(|e| e.1).collect(),
        model_name: model_name.into_owned(),
        kv_capacity_tokens: capacity.tokens(),
        skipped_lines,
    })
}

fn is_cache_config(sample_name: &str) -> bool {
    matches!(sample_name, "vllm:cache_config_info" | "vllm_cache_config_info")
}

/// The KV capacity `vllm:cache_config_info` gives, over its samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Capacity {
    Unseen,
    Tokens(u64),
    /// Two samples disagree, or one is unusable: unknown.
    Unknown,
}

impl Capacity {
    /// Reads one sample: its `engine` must be an engine number (vLLM writes
    /// one sample per engine, all alike; others are passed over), and
    /// `num_gpu_blocks` and `block_size` decimal integers.
    fn read(&mut self, sample: &Sample<'_>) {
        let Label::Value(engine) = sample.label("engine") else {
            return;
        };
        if !matches!(engine_number(&engine), Ok(Some(n)) if n < MAX_RANK_NUMBER as usize) {
            return;
        }
        let integer = |name: &str| match sample.label(name) {
            Label::Value(text) if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => {
                text.parse::<u64>().ok()
            }
            _ => None,
        };
        let tokens = integer("num_gpu_blocks")
            .zip(integer("block_size"))
            .and_then(|(blocks, size)| blocks.checked_mul(size))
            .filter(|t| *t > 0);
        *self = match (*self, tokens) {
            (Capacity::Unseen, Some(t)) => Capacity::Tokens(t),
            (Capacity::Tokens(seen), Some(t)) if seen == t => Capacity::Tokens(t),
            _ => Capacity::Unknown,
        };
    }

    fn tokens(self) -> Option<u64> {
        match self {
            Capacity::Tokens(t) => Some(t),
            Capacity::Unseen | Capacity::Unknown => None,
        }
    }
}

/// `model_name` (empty when absent) and `engine` of a sample; `None` when
/// either label is repeated (a line that breaks the format).
fn labels_of<'a>(sample: &Sample<'a>) -> Option<(Cow<'a, str>, Label<'a>)> {
    let model_name = match sample.label("model_name") {
        Label::Absent => Cow::Borrowed(""),
        Label::Value(name) => name,
        Label::Repeated => return None,
    };
    match sample.label("engine") {
        Label::Repeated => None,
        engine => Some((model_name, engine)),
    }
}

fn engine_of(figure: Figure, label: Label<'_>) -> Result<usize, VllmMetricsError> {
    let text = match label {
        Label::Value(text) => text,
        Label::Absent | Label::Repeated => {
            return Err(VllmMetricsError::BadEngines(format!(
                "{} without an engine label",
                figure.name()
            )))
        }
    };
    match engine_number(&text) {
        Err(()) => Err(VllmMetricsError::BadEngines(format!(
            "engine label {text:?} of {} is not an engine number",
            figure.name()
        ))),
        Ok(Some(n)) if n < MAX_RANK_NUMBER as usize => Ok(n),
        Ok(_) => Err(VllmMetricsError::TooManyEngines(text.into_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.14-0.33 with one API process (prometheus_client's default
    /// registry, text 0.0.4): python/process series first, each counter's
    /// `_created` samples in a gauge family of their own, labels sorted.
    const SINGLE_PROCESS: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12286.0
python_gc_objects_collected_total{generation="1"} 1244.0
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"} 1.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.170196889e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen3-8B",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="0",model_name="Qwen/Qwen3-8B",sleep_state="weights_offloaded"} 0.0
vllm:engine_sleep_state{engine="1",model_name="Qwen/Qwen3-8B",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="1",model_name="Qwen/Qwen3-8B",sleep_state="weights_offloaded"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.04123456789012345
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 1.2345678e+07
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 98304.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7640834123456e+09
vllm:prefix_cache_queries_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7640834123461e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 8.765432e+06
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 16384.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7640834123457e+09
vllm:prefix_cache_hits_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7640834123462e+09
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-8B"} 0.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 41.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-8B"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 37.0
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 0.7312
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="Qwen/Qwen3-8B"} 40.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 43.0
vllm:request_queue_time_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 43.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
vllm:request_queue_time_seconds_bucket{engine="1",le="0.3",model_name="Qwen/Qwen3-8B"} 37.0
vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf",model_name="Qwen/Qwen3-8B"} 37.0
vllm:request_queue_time_seconds_count{engine="1",model_name="Qwen/Qwen3-8B"} 37.0
# HELP vllm:request_queue_time_seconds_created Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds_created gauge
vllm:request_queue_time_seconds_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7640834123501e+09
vllm:request_queue_time_seconds_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7640834123502e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27306"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_gpu_blocks="27306"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 78.0
# HELP http_requests_created Total number of requests by method, status and handler.
# TYPE http_requests_created gauge
http_requests_created{handler="/v1/chat/completions",method="POST",status="2xx"} 1.7640834200001e+09
"#;

    fn figures(running: u64, waiting: u64, kv: f64, queries: u64, hits: u64) -> EngineFigures {
        EngineFigures {
            running: Some(running),
            waiting: Some(waiting),
            kv_usage: Some(kv),
            prefix_queries: Some(queries),
            prefix_hits: Some(hits),
        }
    }

    fn single_process_engines() -> Vec<EngineFigures> {
        vec![
            figures(3, 1, 0.04123456789012345, 12_345_678, 8_765_432),
            figures(0, 0, 0.0, 98_304, 16_384),
        ]
    }

    fn read(body: &str) -> VllmReport {
        match parse_vllm_metrics(body.as_bytes(), None) {
            Ok(report) => report,
            Err(e) => panic!("{e}\n{body}"),
        }
    }

    fn engines(body: &str) -> Vec<EngineFigures> {
        read(body).engines
    }

    fn refused(body: &str) -> String {
        match parse_vllm_metrics(body.as_bytes(), None) {
            Err(VllmMetricsError::BadEngines(why)) => why,
            other => panic!("{body}\ngave {other:?}"),
        }
    }

    /// `SINGLE_PROCESS` with `from` replaced by `to` (which must be there).
    fn edited(from: &str, to: &str) -> String {
        assert!(SINGLE_PROCESS.contains(from), "{from}");
        SINGLE_PROCESS.replacen(from, to, 1)
    }

    #[test]
    fn reads_a_single_process_server() {
        let report = read(SINGLE_PROCESS);
        assert_eq!(report.engines, single_process_engines());
        assert_eq!(report.model_name, "Qwen/Qwen3-8B");
        assert_eq!(report.kv_capacity_tokens, Some(27306 * 16));
        assert_eq!(report.skipped_lines, 0);
    }

    #[test]
    fn the_kv_capacity_needs_agreeing_usable_cache_config_samples() {
        let info = r#"vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",num_gpu_blocks="27306"} 1.0"#;
        let capacity = |to: &str| read(&edited(info, to)).kv_capacity_tokens;
        assert_eq!(capacity(""), Some(27306 * 16), "one sample is enough");
        assert_eq!(
            capacity(&info.replace("27306", "27307")),
            None,
            "two values: unknown"
        );
        for bad in ["None", "", "-5", "2.5e4", " 27306", "0"] {
            let to = info.replace(r#"num_gpu_blocks="27306""#, &format!(r#"num_gpu_blocks="{bad}""#));
            assert_eq!(capacity(&to), None, "{bad:?}");
        }
        let huge = info.replace("27306", "99999999999999999999");
        assert_eq!(capacity(&huge), None);
        let overflow = info
            .replace("27306", &u64::MAX.to_string())
            .replace(r#"block_size="16""#, r#"block_size="2""#);
        assert_eq!(capacity(&overflow), None);
        // Samples without an engine number are passed over, whatever they say.
        let other = info
            .replace(r#"engine="1""#, r#"engine="one""#)
            .replace("27306", "5");
        assert_eq!(capacity(&other), Some(27306 * 16));
        let without = SINGLE_PROCESS
            .lines()
            .filter(|l| !l.contains("cache_config_info"))
            .map(|l| format!("{l}\n"))
            .collect::<String>();
        assert_eq!(read(&without).kv_capacity_tokens, None);
    }

    fn answer(body: &[u8]) -> Answer {
        let vllm = Vllm { model: None };
        vllm.answer(&vllm.poll(&SourceMemory::default()), 200, body)
    }

    #[test]
    fn the_source_polls_metrics_and_refuses_only_bad_engines() {
        let vllm = Vllm { model: None };
        let poll = vllm.poll(&SourceMemory::default());
        assert_eq!((poll.path, poll.accept), ("/metrics", "text/plain"));
        assert!(
            matches!(answer(SINGLE_PROCESS.as_bytes()), Answer::Report(r) if r.readout::<VllmReport>().unwrap().engines.len() == 2)
        );
        assert_eq!(
            vllm.answer(&poll, 404, b"{}"),
            Answer::Failed("HTTP 404 from /metrics".into())
        );
        let gap = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
                   vllm:num_requests_running{engine=\"2\",model_name=\"m\"} 1\n";
        assert_eq!(
            answer(gap.as_bytes()),
            Answer::Refused("no rank 1 between 0 and 2".into())
        );
        let beyond = "vllm:num_requests_running{engine=\"65536\",model_name=\"m\"} 1\n";
        assert!(matches!(answer(beyond.as_bytes()), Answer::Refused(why) if why.contains("65536")));
        let two_models = format!(
            "{SINGLE_PROCESS}{}",
            SINGLE_PROCESS.replace("Qwen/Qwen3-8B", "other")
        );
        assert!(matches!(answer(two_models.as_bytes()), Answer::Failed(why) if why.contains("configure")));
        let only_qwen = Vllm {
            model: Some("Qwen/Qwen3-8B"),
        };
        assert!(matches!(
            only_qwen.answer(&poll, 200, two_models.as_bytes()),
            Answer::Report(_)
        ));
        for hostile in [
            &b"<html><body>busy</body></html>\n"[..],
            b"",
            &vec![b'#'; MAX_METRICS_BYTES + 1],
        ] {
            assert!(
                matches!(answer(hostile), Answer::Failed(_)),
                "{:?}",
                &hostile[..hostile.len().min(20)]
            );
        }
    }

    #[test]
    fn an_answer_cut_short_or_without_a_usable_gauge_fails_the_poll() {
        let cut = &SINGLE_PROCESS[..SINGLE_PROCESS.len() - 1];
        assert!(matches!(answer(cut.as_bytes()), Answer::Failed(why) if why.contains("cut short")));
        for (from, to) in [
            (
                r#"vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
                r#"vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} NaN"#,
            ),
            (
                r#"vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.04123456789012345"#,
                r#"vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 1.5"#,
            ),
            (
                r#"vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
                "",
            ),
        ] {
            let body = edited(from, to);
            assert!(
                matches!(answer(body.as_bytes()), Answer::Failed(why) if why.contains("without a usable")),
                "{to}"
            );
        }
        // The counters are not needed: without them the hit rate is unknown.
        let no_counters = edited(
            r#"vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 8.765432e+06"#,
            r#"vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} NaN"#,
        );
        assert!(matches!(answer(no_counters.as_bytes()), Answer::Report(_)));
    }

    /// vLLM 0.34 runs one API process per engine by default, so
    /// prometheus_client runs in multiprocess mode: no `_created` samples, no
    /// python/process series, gauges merged by their most recent value (no
    /// `pid` label), families and samples in the order of its files.
    #[test]
    fn reads_multiprocess_mode() {
        let body = r#"# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="2",model_name="Qwen/Qwen3-8B"} 0.0
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 4.194304e+06
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 512.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 2048.0
vllm:prefix_cache_queries_total{engine="2",model_name="Qwen/Qwen3-8B"} 0.0
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 5.24288e+06
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 812.0
vllm:iteration_tokens_total_count{engine="0",model_name="Qwen/Qwen3-8B"} 812.0
vllm:iteration_tokens_total_sum{engine="0",model_name="Qwen/Qwen3-8B"} 91345.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 0.0
vllm:num_requests_waiting{engine="2",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
vllm:num_requests_running{engine="2",model_name="Qwen/Qwen3-8B"} 0.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="2",model_name="Qwen/Qwen3-8B"} 0.0
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.3125
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.61328125
"#;
        assert_eq!(
            engines(body),
            vec![
                figures(12, 0, 0.61328125, 5_242_880, 4_194_304),
                figures(7, 2, 0.3125, 2048, 512),
                figures(0, 0, 0.0, 0, 0),
            ]
        );
    }

    /// Asked for OpenMetrics, prometheus_client 0.23 and later write sample
    /// names with `_` for `:` (HELP and TYPE keep `vllm:`), `_created` next
    /// to each `_total`, and `# EOF`; older ones keep `vllm:` everywhere.
    #[test]
    fn reads_openmetrics_text() {
        let body = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm_num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm_num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm_num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
vllm_num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm_kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.04123456789012345
vllm_kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm_prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 1.2345678e+07
vllm_prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7640834123456e+09
vllm_prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 98304.0
vllm_prefix_cache_queries_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7640834123461e+09
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm_prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 8.765432e+06
vllm_prefix_cache_hits_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7640834123457e+09
vllm_prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 16384.0
vllm_prefix_cache_hits_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7640834123462e+09
# EOF
"#;
        assert_eq!(engines(body), single_process_engines());
        assert_eq!(engines(&body.replace("vllm_", "vllm:")), single_process_engines());
        // The same figure under both spellings is a duplicate.
        let both =
            format!("{body}vllm:num_requests_running{{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"}} 0.0\n");
        assert!(refused(&both).contains("vllm:num_requests_running for engine 1 appears twice"));
    }

    #[test]
    fn other_metrics_labels_and_lines_change_nothing() {
        let noisy = format!(
            "{}{}",
            SINGLE_PROCESS
                .replace(
                    r#"vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0"#,
                    "  vllm:num_requests_running { model_name = \"Qwen/Qwen3-8B\", lora=\"\", engine=\"0\", } 3 1764083412345"
                )
                .replace('\n', "\r\n\r\n# a comment\r\n"),
            // Metrics dprank does not read, with engine labels of any kind.
            "vllm:cache_config_info{engine=\"\",block_size=\"16\"} 1.0\n\
             vllm:num_preemptions_total{engine=\"7\",model_name=\"Qwen/Qwen3-8B\"} 1.0\n\
             vllm:gpu_cache_usage_perc{engine=\"x\",model_name=\"Qwen/Qwen3-8B\"} 0.5\n\
             vllm:num_requests_running_created{engine=\"5\",model_name=\"Qwen/Qwen3-8B\"} 1.0\n\
             vllm:prefix_cache_queries{engine=\"5\",model_name=\"Qwen/Qwen3-8B\"} 1.0\n\
             num_requests_running{engine=\"5\",model_name=\"other\"} 1.0\n\
             not a sample at all\n\
             <html>\n"
        );
        let report = read(&noisy);
        assert_eq!(report.engines, single_process_engines());
        assert_eq!(report.skipped_lines, 2, "the two lines that break the format");
    }

    #[test]
    fn unusable_figures_are_unknown() {
        let body = edited(
            r#"vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
            r#"vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} NaN"#,
        )
        .replace(
            r#"vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0"#,
            r#"vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} -1.0"#,
        )
        .replace(
            r#"vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.04123456789012345"#,
            r#"vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 1.5"#,
        )
        .replace(
            r#"vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
            r#"vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} NaN"#,
        )
        .replace(
            r#"vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 1.2345678e+07"#,
            r#"vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} +Inf"#,
        )
        .replace(
            r#"vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 8.765432e+06"#,
            r#"vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 1e300"#,
        )
        .replace(
            r#"vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 16384.0"#,
            r#"vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 16384.0x"#,
        );
        let report = read(&body);
        assert_eq!(
            report.engines,
            vec![
                EngineFigures {
                    running: Some(3),
                    waiting: None,
                    kv_usage: None,
                    prefix_queries: None,
                    prefix_hits: None,
                },
                EngineFigures {
                    running: None,
                    waiting: Some(0),
                    kv_usage: None,
                    prefix_queries: Some(98_304),
                    prefix_hits: None,
                },
            ]
        );
        assert_eq!(report.skipped_lines, 1, "16384.0x");
        let fractions = edited(
            r#"vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0"#,
            r#"vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 2.5"#,
        )
        .replace(
            r#"vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
            r#"vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 1"#,
        );
        let got = engines(&fractions);
        assert_eq!((got[0].running, got[1].kv_usage), (Some(3), Some(1.0)));
    }

    #[test]
    fn a_figure_missing_for_one_engine_is_unknown() {
        let body = edited(
            "vllm:num_requests_waiting{engine=\"1\",model_name=\"Qwen/Qwen3-8B\"} 0.0\n",
            "",
        );
        let mut want = single_process_engines();
        want[1].waiting = None;
        assert_eq!(engines(&body), want);
        // An engine with only one figure is still an engine.
        let lone = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 5\n";
        assert_eq!(
            engines(lone),
            vec![
                EngineFigures {
                    running: Some(1),
                    ..EngineFigures::default()
                },
                EngineFigures {
                    prefix_hits: Some(5),
                    ..EngineFigures::default()
                },
            ]
        );
    }

    #[test]
    fn engines_are_one_run_named_as_the_server_names_them() {
        // Engine 1 only in a metric dprank does not read: it has a gap.
        let gap = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
                   vllm:num_requests_running{engine=\"2\",model_name=\"m\"} 1\n\
                   vllm:num_preemptions_total{engine=\"1\",model_name=\"m\"} 0\n";
        assert!(
            refused(gap).contains("no rank 1 between 0 and 2"),
            "{}",
            refused(gap)
        );
        // A server that runs engines 4..7 of a larger deployment (hybrid
        // load balancing), or engine 5 alone (external): read as named.
        for (first, n) in [(4usize, 4usize), (5, 1)] {
            let offset: String = (first..first + n)
                .flat_map(|e| {
                    [
                        "num_requests_running",
                        "num_requests_waiting",
                        "kv_cache_usage_perc",
                    ]
                    .map(|m| format!("vllm:{m}{{engine=\"{e}\",model_name=\"m\"}} 0.0\n"))
                })
                .collect();
            let report = parse_vllm_metrics(offset.as_bytes(), None).unwrap();
            assert_eq!((report.first_engine, report.engines.len()), (first as u32, n));
        }
    }

    #[test]
    fn a_duplicate_sample_refuses_the_report() {
        let twice = format!(
            "{SINGLE_PROCESS}vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"}} 0.5\n"
        );
        assert_eq!(
            refused(&twice),
            "vllm:kv_cache_usage_perc for engine 0 appears twice"
        );
        // prometheus_client's multiprocess mode `all` keeps one gauge per
        // process, told apart by a `pid` label: which one is right is unknown.
        let per_pid = "vllm:num_requests_running{engine=\"0\",model_name=\"m\",pid=\"101\"} 3.0\n\
                       vllm:num_requests_running{engine=\"0\",model_name=\"m\",pid=\"102\"} 0.0\n";
        assert_eq!(
            refused(per_pid),
            "vllm:num_requests_running for engine 0 appears twice"
        );
    }

    #[test]
    fn engine_labels_must_be_engine_numbers() {
        for bad in ["one", "01", "-1", "+1", "1.0", "", " 1", "1 ", "0x1", "١"] {
            let body = edited(
                r#"vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
                &format!(r#"vllm:num_requests_waiting{{engine="{bad}",model_name="Qwen/Qwen3-8B"}} 0.0"#),
            );
            assert_eq!(
                refused(&body),
                format!("engine label {bad:?} of vllm:num_requests_waiting is not an engine number")
            );
        }
        let unlabelled = edited(
            r#"vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
            r#"vllm:kv_cache_usage_perc{model_name="Qwen/Qwen3-8B"} 0.0"#,
        );
        assert_eq!(
            refused(&unlabelled),
            "vllm:kv_cache_usage_perc without an engine label"
        );
        // A repeated label breaks the line: skipped like any broken line.
        let repeated = edited(
            r#"vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.0"#,
            r#"vllm:kv_cache_usage_perc{engine="1",engine="2",model_name="Qwen/Qwen3-8B"} 0.0"#,
        );
        let report = read(&repeated);
        assert_eq!((report.engines[1].kv_usage, report.skipped_lines), (None, 1));
    }

    #[test]
    fn engines_beyond_max_dp_size_are_refused() {
        let last = MAX_DP_SIZE - 1;
        let all_engines: String = (0..MAX_DP_SIZE)
            .map(|e| format!("vllm:num_requests_running{{engine=\"{e}\",model_name=\"m\"}} {e}\n"))
            .collect();
        let report = read(&all_engines);
        assert_eq!(report.engines.len(), MAX_DP_SIZE as usize);
        assert_eq!(report.engines[last as usize].running, Some(u64::from(last)));
        for beyond in [MAX_DP_SIZE.to_string(), "99999999999999999999999".to_string()] {
            let body =
                format!("{all_engines}vllm:num_requests_waiting{{engine=\"{beyond}\",model_name=\"m\"}} 0\n");
            assert_eq!(
                parse_vllm_metrics(body.as_bytes(), None),
                Err(VllmMetricsError::TooManyEngines(beyond.clone()))
            );
        }
    }

    #[test]
    fn several_models_need_a_model_name() {
        let other = SINGLE_PROCESS.replace("Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct");
        let both = format!("{SINGLE_PROCESS}{other}");
        assert_eq!(
            parse_vllm_metrics(both.as_bytes(), None),
            Err(VllmMetricsError::SeveralModels(
                "Qwen/Qwen3-8B".into(),
                "meta-llama/Llama-3.1-8B-Instruct".into()
            ))
        );
        let qwen = parse_vllm_metrics(both.as_bytes(), Some("Qwen/Qwen3-8B"));
        assert_eq!(
            qwen.map(|r| (r.engines, r.model_name)),
            Ok((single_process_engines(), "Qwen/Qwen3-8B".into()))
        );
        // Other models' samples are not looked at, whatever their engines.
        let garbled_other = format!(
            "{SINGLE_PROCESS}vllm:num_requests_running{{engine=\"zz\",model_name=\"x\"}} 1\n\
             vllm:num_requests_running{{model_name=\"x\"}} 1\n"
        );
        let qwen = parse_vllm_metrics(garbled_other.as_bytes(), Some("Qwen/Qwen3-8B"));
        assert_eq!(qwen.map(|r| r.engines), Ok(single_process_engines()));
        assert_eq!(
            parse_vllm_metrics(SINGLE_PROCESS.as_bytes(), Some("qwen")),
            Err(VllmMetricsError::NoFigures {
                model: Some("qwen".into()),
                seen: Some("Qwen/Qwen3-8B".into())
            })
        );
        // A model name with escapes is compared unescaped.
        let escaped = SINGLE_PROCESS.replace("Qwen/Qwen3-8B", r#"my \"best\" model\\v2"#);
        let got = parse_vllm_metrics(escaped.as_bytes(), Some(r#"my "best" model\v2"#));
        assert_eq!(got.map(|r| r.engines), Ok(single_process_engines()));
        // Samples without a model_name are a model of their own ("").
        let unnamed = format!("{SINGLE_PROCESS}vllm:num_requests_running{{engine=\"0\"}} 1\n");
        assert_eq!(
            parse_vllm_metrics(unnamed.as_bytes(), None),
            Err(VllmMetricsError::SeveralModels(
                "Qwen/Qwen3-8B".into(),
                String::new()
            ))
        );
    }

    fn no_figures(body: &[u8]) {
        assert_eq!(
            parse_vllm_metrics(body, None),
            Err(VllmMetricsError::NoFigures {
                model: None,
                seen: None
            }),
            "{}",
            String::from_utf8_lossy(body)
        );
    }

    #[test]
    fn answers_that_are_no_vllm_metrics() {
        no_figures(b"");
        no_figures(b"\n\n");
        no_figures(b"<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title></head>\n<body>upstream error</body></html>\n");
        no_figures(
            br#"{"object":"error","message":"Not Found","type":"NotFoundError","param":null,"code":404}"#,
        );
        no_figures(br#"[{"dp_rank":0,"num_tokens":5120},{"dp_rank":1,"num_tokens":0}]"#);
        // A server without vLLM's engine series (before its engines started).
        let python_only: String = SINGLE_PROCESS
            .lines()
            .take(10)
            .map(|l| format!("{l}\n"))
            .collect();
        no_figures(python_only.as_bytes());
        // The same answer gzipped (a client that sent Accept-Encoding).
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(SINGLE_PROCESS.as_bytes()).unwrap();
        no_figures(&gz.finish().unwrap());
    }

    #[test]
    fn a_truncated_answer_loses_its_last_line() {
        let cut_at = SINGLE_PROCESS.find("98304.0").map(|at| at + "98".len()).unwrap();
        let report = read(&SINGLE_PROCESS[..cut_at]);
        let mut want = single_process_engines();
        want[1].prefix_queries = None;
        want[0].prefix_hits = None;
        want[1].prefix_hits = None;
        assert_eq!(report.engines, want, "98 of 98304 is not read");
        assert_eq!(report.skipped_lines, 1);
        // Cut inside the first family: the engines after the cut are gone.
        let cut_at = SINGLE_PROCESS
            .find("vllm:num_requests_running{engine=\"1\"")
            .unwrap()
            + 20;
        assert_eq!(engines(&SINGLE_PROCESS[..cut_at]).len(), 1);
    }

    #[test]
    fn huge_answers_cost_bounded_work() {
        let over = vec![b'#'; MAX_METRICS_BYTES + 1];
        assert_eq!(
            parse_vllm_metrics(&over, None),
            Err(VllmMetricsError::TooLarge(MAX_METRICS_BYTES + 1))
        );
        // Just under the limit: padding comments, then the report.
        let mut body = Vec::with_capacity(MAX_METRICS_BYTES);
        while body.len() + 100 + SINGLE_PROCESS.len() < MAX_METRICS_BYTES {
            body.extend_from_slice(&[b'#'; 99]);
            body.push(b'\n');
        }
        body.extend_from_slice(SINGLE_PROCESS.as_bytes());
        assert_eq!(
            parse_vllm_metrics(&body, None).map(|r| r.engines),
            Ok(single_process_engines())
        );
        // One hostile line as long as allowed: a label set that never ends,
        // then one with thousands of labels.
        let mut endless = b"vllm:num_requests_running{engine=\"0\",model_name=\"".to_vec();
        endless.resize(MAX_METRICS_BYTES - 1, b'a');
        endless.push(b'\n');
        assert!(matches!(
            parse_vllm_metrics(&endless, None),
            Err(VllmMetricsError::NoFigures { .. })
        ));
        let mut many = b"vllm:num_requests_running{".to_vec();
        while many.len() < MAX_METRICS_BYTES - 64 {
            many.extend_from_slice(b"engine=\"0\",");
        }
        many.extend_from_slice(b"model_name=\"m\"} 1\n");
        let report = parse_vllm_metrics(&many, None).map(|r| r.skipped_lines);
        assert_eq!(
            report,
            Err(VllmMetricsError::NoFigures {
                model: None,
                seen: None
            })
        );
    }

    #[test]
    fn errors_say_what_was_wrong() {
        let cases = [
            (
                VllmMetricsError::TooLarge(9 << 20),
                "9437184 bytes is over the 8388608-byte limit",
            ),
            (
                VllmMetricsError::NoFigures {
                    model: None,
                    seen: None,
                },
                "no vLLM per-engine figures in the metrics answer",
            ),
            (
                VllmMetricsError::NoFigures {
                    model: Some("a".into()),
                    seen: Some("b".into()),
                },
                "no vLLM per-engine figures for model \"a\" in the metrics answer (it reports \"b\")",
            ),
            (
                VllmMetricsError::SeveralModels("a".into(), "b".into()),
                "refused: figures for models \"a\" and \"b\"; configure the model name to read",
            ),
            (
                VllmMetricsError::BadEngines("no rank 1 between 0 and 2".into()),
                "refused: its engines are not one run S..S+N-1 (no rank 1 between 0 and 2)",
            ),
            (
                VllmMetricsError::TooManyEngines("70000".into()),
                "names engine 70000 (limits: 4096 engines, numbered below 65536)",
            ),
        ];
        for (error, text) in cases {
            assert!(error.to_string().contains(text), "{error}");
        }
    }
}
