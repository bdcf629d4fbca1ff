//! Open-loop replay of a trace against one or more HTTP endpoints, with
//! per-rank load sampling from the workers' `/v1/loads`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::client::{get_text, pooled_client, stream_request, PooledClient, StreamOutcome};
use crate::trace::{generate_body, TraceRequest};

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Base URLs (`http://host:port`); request i goes to `targets[i % n]`.
    pub targets: Vec<String>,
    pub path: String,
    /// Workers whose `/v1/loads` are sampled (may be empty).
    pub workers: Vec<SocketAddr>,
    /// Trace times are simulated seconds; wall time = simulated / time_scale.
    pub time_scale: f64,
    pub sample_every: Duration,
    /// Per-request limit (wall); a request still running then is an error.
    pub request_timeout: Duration,
    pub progress: bool,
    pub label: String,
}

/// Tokens per rank, every rank of every worker in worker order, at `t_s`
/// simulated seconds after the first arrival.
#[derive(Debug, Clone)]
pub struct LoadSample {
    pub t_s: f64,
    pub tokens: Vec<u64>,
}

#[derive(Debug, Clone)]
pub struct LoadReport {
    pub label: String,
    pub sent: usize,
    pub ok: usize,
    pub errors: usize,
    pub error_examples: Vec<String>,
    /// Simulated milliseconds of every successful request.
    pub ttft_ms: Vec<f64>,
    pub e2e_ms: Vec<f64>,
    /// Inter-token gaps, simulated microseconds.
    pub itl_us: Histogram<u64>,
    /// Successful requests per simulated second, first arrival to last completion.
    pub throughput_rps: f64,
    /// Output tokens per simulated second.
    pub token_throughput: f64,
    pub samples: Vec<LoadSample>,
    /// Time-averaged max/mean of per-rank tokens while arrivals last.
    pub imbalance: Option<f64>,
    /// Simulated seconds during which arrivals happen.
    pub arrival_window_s: f64,
}

/// Exact percentile (nearest rank) of unsorted values; NaN if empty.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl LoadReport {
    pub fn ttft_p(&self, p: f64) -> f64 {
        percentile(&self.ttft_ms, p)
    }
    pub fn e2e_p(&self, p: f64) -> f64 {
        percentile(&self.e2e_ms, p)
    }
    /// Inter-token latency percentile, simulated ms.
    pub fn itl_p(&self, p: f64) -> f64 {
        if self.itl_us.is_empty() {
            return f64::NAN;
        }
        self.itl_us.value_at_quantile(p / 100.0) as f64 / 1000.0
    }

    pub fn summary(&self) -> String {
        format!(
            "{}: {} sent, {} ok, {} errors | TTFT p50 {:.0} p99 {:.0} ms | ITL p50 {:.1} p99 {:.1} ms | E2E p50 {:.0} p99 {:.0} ms | {:.2} req/s | imbalance {} (times simulated)",
            self.label,
            self.sent,
            self.ok,
            self.errors,
            self.ttft_p(50.0),
            self.ttft_p(99.0),
            self.itl_p(50.0),
            self.itl_p(99.0),
            self.e2e_p(50.0),
            self.e2e_p(99.0),
            self.throughput_rps,
            self.imbalance.map_or("n/a".into(), |v| format!("{v:.3}")),
        )
    }
}

/// Parses `/v1/loads` (or the `/get_load` array) into tokens per rank,
/// preferring `num_total_tokens`, then `num_tokens`, then `num_used_tokens`.
pub fn parse_rank_tokens(text: &str) -> Option<Vec<u64>> {
    let value: serde_json::Value = serde_json::from_str(text).ok()?;
    let loads = match &value {
        serde_json::Value::Array(items) => items.clone(),
        serde_json::Value::Object(map) => map.get("loads")?.as_array()?.clone(),
        _ => return None,
    };
    let mut ranks: Vec<(u64, u64)> = loads
        .iter()
        .filter_map(|l| {
            let rank = l.get("dp_rank")?.as_u64()?;
            let tokens = ["num_total_tokens", "num_tokens", "num_used_tokens"]
                .iter()
                .find_map(|k| l.get(*k).and_then(|v| v.as_u64()))?;
            Some((rank, tokens))
        })
        .collect();
    ranks.sort_unstable();
    Some(ranks.into_iter().map(|(_, t)| t).collect())
}

/// max/mean of one sample; None when the fleet is (nearly) empty.
pub fn sample_imbalance(tokens: &[u64]) -> Option<f64> {
    let max = *tokens.iter().max()? as f64;
    let mean = tokens.iter().sum::<u64>() as f64 / tokens.len() as f64;
    (mean >= 1.0).then(|| max / mean)
}

async fn sample_loads(
    client: PooledClient,
    workers: Vec<SocketAddr>,
    every: Duration,
    time_scale: f64,
    start: Instant,
    mut stop: watch::Receiver<bool>,
) -> Vec<LoadSample> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        let t_s = start.elapsed().as_secs_f64() * time_scale;
        let mut tokens = Vec::new();
        let mut complete = true;
        for worker in &workers {
            let uri = format!("http://{worker}/v1/loads?include=core");
            match get_text(&client, &uri)
                .await
                .ok()
                .and_then(|t| parse_rank_tokens(&t))
            {
                Some(t) => tokens.extend(t),
                None => complete = false,
            }
        }
        if complete && !tokens.is_empty() {
            samples.push(LoadSample { t_s, tokens });
        }
    }
    samples
}

/// Replays `trace` and measures it.
pub async fn run_trace(trace: &[TraceRequest], options: &LoadOptions) -> Result<LoadReport, String> {
    if options.targets.is_empty() {
        return Err("no target".into());
    }
    let client = pooled_client();
    let progress = if options.progress {
        let bar = ProgressBar::new(trace.len() as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:>24} [{elapsed_precise}] {wide_bar} {pos}/{len} done, {per_sec}",
        ) {
            bar.set_style(style);
        }
        bar.set_message(options.label.clone());
        bar
    } else {
        ProgressBar::hidden()
    };

    let start = Instant::now();
    let (stop_tx, stop_rx) = watch::channel(false);
    let sampler = tokio::spawn(sample_loads(
        client.clone(),
        options.workers.clone(),
        options.sample_every,
        options.time_scale,
        start,
        stop_rx,
    ));

    let uris: Arc<Vec<String>> = Arc::new(
        options
            .targets
            .iter()
            .map(|t| format!("{}{}", t.trim_end_matches('/'), options.path))
            .collect(),
    );
    let mut tasks: JoinSet<(StreamOutcome, Instant)> = JoinSet::new();
    let mut outcomes = Vec::with_capacity(trace.len());
    let mut last_end = start;
    for (i, request) in trace.iter().copied().enumerate() {
        let due = start + Duration::from_secs_f64(request.at_s / options.time_scale);
        tokio::time::sleep_until(due.into()).await;
        let client = client.clone();
        let uris = uris.clone();
        let timeout = options.request_timeout;
        tasks.spawn(async move {
            let uri = &uris[i % uris.len()];
            let body = Bytes::from(generate_body(
                request.input_tokens,
                request.output_tokens,
                true,
                i as u64,
            ));
            let outcome = match tokio::time::timeout(timeout, stream_request(&client, uri, body)).await {
                Ok(outcome) => outcome,
                Err(_) => StreamOutcome {
                    error: Some(format!("no complete response within {timeout:?}")),
                    e2e: timeout,
                    ..StreamOutcome::default()
                },
            };
            (outcome, Instant::now())
        });
        // Reap finished requests as we go so memory stays flat.
        while let Some(done) = tasks.try_join_next() {
            if let Some((outcome, end)) = collect(done, &progress) {
                last_end = last_end.max(end);
                outcomes.push(outcome);
            }
        }
    }
    let arrivals_end = start.elapsed();
    while let Some(done) = tasks.join_next().await {
        if let Some((outcome, end)) = collect(done, &progress) {
            last_end = last_end.max(end);
            outcomes.push(outcome);
        }
    }
    let _ = stop_tx.send(true);
    let samples = sampler.await.unwrap_or_default();
    progress.finish_and_clear();

    let scale = options.time_scale;
    let to_ms = |d: Duration| d.as_secs_f64() * 1000.0 * scale;
    let mut itl_us = Histogram::<u64>::new(3).map_err(|e| format!("histogram: {e}"))?;
    let mut report = LoadReport {
        label: options.label.clone(),
        sent: trace.len(),
        ok: 0,
        errors: trace.len().saturating_sub(outcomes.len()),
        error_examples: Vec::new(),
        ttft_ms: Vec::new(),
        e2e_ms: Vec::new(),
        itl_us: Histogram::new(3).map_err(|e| format!("histogram: {e}"))?,
        throughput_rps: 0.0,
        token_throughput: 0.0,
        samples: Vec::new(),
        imbalance: None,
        arrival_window_s: arrivals_end.as_secs_f64() * scale,
    };
    let mut tokens = 0u64;
    for outcome in outcomes {
        match (&outcome.error, outcome.ttft) {
            (None, Some(ttft)) => {
                report.ok += 1;
                report.ttft_ms.push(to_ms(ttft));
                report.e2e_ms.push(to_ms(outcome.e2e));
                tokens += u64::from(outcome.tokens);
                for gap in &outcome.itls {
                    let _ = itl_us.record((gap.as_secs_f64() * 1e6 * scale) as u64);
                }
            }
            (error, _) => {
                report.errors += 1;
                if report.error_examples.len() < 5 {
                    report
                        .error_examples
                        .push(error.clone().unwrap_or_else(|| "no token received".into()));
                }
            }
        }
    }
    report.itl_us = itl_us;
    let span_s = (last_end - start).as_secs_f64() * scale;
    if span_s > 0.0 {
        report.throughput_rps = report.ok as f64 / span_s;
        report.token_throughput = tokens as f64 / span_s;
    }
    let window = report.arrival_window_s;
    let ratios: Vec<f64> = samples
        .iter()
        .filter(|s| s.t_s <= window)
        .filter_map(|s| sample_imbalance(&s.tokens))
        .collect();
    if !ratios.is_empty() {
        report.imbalance = Some(ratios.iter().sum::<f64>() / ratios.len() as f64);
    }
    report.samples = samples;
    Ok(report)
}

fn collect(
    done: Result<(StreamOutcome, Instant), tokio::task::JoinError>,
    progress: &ProgressBar,
) -> Option<(StreamOutcome, Instant)> {
    progress.inc(1);
    done.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_tokens_from_both_load_shapes() {
        let v1 = r#"{"loads":[{"dp_rank":1,"num_used_tokens":5,"num_total_tokens":9},{"dp_rank":0,"num_used_tokens":3}]}"#;
        assert_eq!(parse_rank_tokens(v1), Some(vec![3, 9]));
        let legacy = r#"[{"dp_rank":0,"num_tokens":4},{"dp_rank":1,"num_tokens":6}]"#;
        assert_eq!(parse_rank_tokens(legacy), Some(vec![4, 6]));
    }

    #[test]
    fn imbalance_ignores_an_empty_fleet() {
        assert_eq!(sample_imbalance(&[0, 0, 0, 0]), None);
        assert_eq!(sample_imbalance(&[10, 10, 10, 10]), Some(1.0));
        assert_eq!(sample_imbalance(&[40, 0, 0, 0]), Some(4.0));
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
