//! The load reports, shaped as SGLang's `/v1/loads` and `/get_load` answer
//! them, from published rank snapshots.

use std::time::SystemTime;

use serde_json::{json, Map, Value};

use crate::engine::RankSnapshot;

/// What a load report is built from.
#[derive(Debug, Clone, Copy)]
pub struct LoadView<'a> {
    pub snapshots: &'a [RankSnapshot],
    /// Per-rank offsets added to every token count (test control).
    pub base_tokens: &'a [u64],
    pub capacity: u64,
    pub max_running: u64,
    /// Report `num_total_tokens` (newer builds).
    pub with_total: bool,
    /// Empty ranks appended (a fault: a worker reporting the wrong size).
    pub extra_ranks: usize,
    /// The `dp_rank` reported for the first snapshot (the worker's start
    /// rank, plus the rank for one rank's report); the others follow.
    pub first_rank: usize,
    pub timestamp: SystemTime,
}

impl LoadView<'_> {
    fn rank(&self, index: usize) -> (RankSnapshot, u64) {
        (
            self.snapshots.get(index).copied().unwrap_or_default(),
            self.base_tokens.get(index).copied().unwrap_or(0),
        )
    }

    fn ranks(&self) -> usize {
        self.snapshots.len() + self.extra_ranks
    }
}

fn round4(value: f64) -> f64 {
    (value * 1e4).round() / 1e4
}

/// `GET /v1/loads`: per-rank loads and their sums.
pub fn v1_loads(view: &LoadView) -> Value {
    let capacity = view.capacity;
    let mut sums = [0u64; 7];
    let mut hit_rates = Vec::new();
    let mut throughput = 0.0;
    let rows: Vec<Value> = (0..view.ranks())
        .map(|index| {
            let (load, offset) = view.rank(index);
            let used = load.used_tokens + offset;
            let total = load.total_tokens + offset;
            let values = [
                load.running,
                load.waiting,
                load.running + load.waiting,
                used,
                total,
                capacity,
                load.waiting_uncached_tokens,
            ];
            for (sum, value) in sums.iter_mut().zip(values) {
                *sum += value;
            }
            hit_rates.push(load.cache_hit_rate);
            throughput += load.gen_throughput;
            let mut row = Map::new();
            row.insert("dp_rank".into(), json!(view.first_rank + index));
            row.insert("num_running_reqs".into(), json!(load.running));
            row.insert("num_waiting_reqs".into(), json!(load.waiting));
            row.insert("num_total_reqs".into(), json!(load.running + load.waiting));
            row.insert(
                "num_waiting_uncached_tokens".into(),
                json!(load.waiting_uncached_tokens),
            );
            row.insert("num_used_tokens".into(), json!(used));
            if view.with_total {
                row.insert("num_total_tokens".into(), json!(total));
            }
            row.insert("max_total_num_tokens".into(), json!(capacity));
            row.insert("max_running_requests".into(), json!(view.max_running));
            row.insert("token_usage".into(), json!(round4(used as f64 / capacity as f64)));
            row.insert(
                "gen_throughput".into(),
                json!((load.gen_throughput * 100.0).round() / 100.0),
            );
            row.insert("cache_hit_rate".into(), json!(round4(load.cache_hit_rate)));
            Value::Object(row)
        })
        .collect();
    let mut aggregate = Map::new();
    aggregate.insert("num_running_reqs".into(), json!(sums[0]));
    aggregate.insert("num_waiting_reqs".into(), json!(sums[1]));
    aggregate.insert("num_total_reqs".into(), json!(sums[2]));
    aggregate.insert("num_waiting_uncached_tokens".into(), json!(sums[6]));
    aggregate.insert("num_used_tokens".into(), json!(sums[3]));
    if view.with_total {
        aggregate.insert("num_total_tokens".into(), json!(sums[4]));
    }
    aggregate.insert("max_total_num_tokens".into(), json!(sums[5]));
    aggregate.insert(
        "token_usage".into(),
        json!(if sums[5] == 0 {
            0.0
        } else {
            round4(sums[3] as f64 / sums[5] as f64)
        }),
    );
    aggregate.insert(
        "gen_throughput".into(),
        json!((throughput * 100.0).round() / 100.0),
    );
    let mean_hit = if hit_rates.is_empty() {
        0.0
    } else {
        hit_rates.iter().sum::<f64>() / hit_rates.len() as f64
    };
    aggregate.insert("cache_hit_rate".into(), json!(round4(mean_hit)));
    json!({
        "timestamp": humantime::format_rfc3339_millis(view.timestamp).to_string(),
        "version": "sim",
        "dp_rank_count": rows.len(),
        "loads": rows,
        "aggregate": aggregate,
    })
}

/// `GET /get_load` (the older shape): one object per rank.
pub fn get_load(view: &LoadView) -> Value {
    Value::Array(
        (0..view.ranks())
            .map(|index| {
                let (load, offset) = view.rank(index);
                json!({
                    "dp_rank": view.first_rank + index,
                    "num_reqs": load.running + load.waiting,
                    "num_waiting_reqs": load.waiting,
                    "num_tokens": load.total_tokens + offset,
                })
            })
            .collect(),
    )
}
