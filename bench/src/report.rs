//! Result files: markdown tables built from run records (medians over seeds,
//! paired ratios with bootstrap intervals), the set-up they ran in, and
//! small formatting helpers shared by every benchmark.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::runner::RunRecord;
use crate::stats::{median, min_max, paired_ratio, percentile, tail_samples, PairedRatio};

/// "median (min–max)" with `decimals`; the range is omitted for a single value.
pub fn fmt_spread(values: &[f64], decimals: usize) -> String {
    let m = median(values);
    match min_max(values) {
        None => "n/a".into(),
        Some((lo, hi)) if values.len() == 1 || lo == hi => format!("{m:.decimals$}"),
        Some((lo, hi)) => format!("{m:.decimals$} ({lo:.decimals$}–{hi:.decimals$})"),
    }
}

/// Markdown table from a header and rows.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("| {} |\n", header.join(" | "));
    out.push_str(&format!(
        "|{}\n",
        header.iter().map(|_| "---|").collect::<String>()
    ));
    for row in rows {
        out.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    out
}

/// Machine description for result files: CPU model, cores, kernel.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU".to_string(), |m| m.trim().to_string());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{model}, {} cores, Linux {}",
        crate::cpu::machine_cores(),
        kernel.trim()
    )
}

/// UTC date and time now, `YYYY-MM-DD HH:MM UTC`.
pub fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = secs / 86_400;
    let (h, m) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{d:02} {h:02}:{m:02} UTC")
}

/// The opening of every results file: the title, then when, where and how it was measured.
pub fn report_header(title: &str, command_line: &str) -> String {
    format!(
        "# {title}\n\n- date: {}\n- machine: {}\n- command: `{command_line}`\n\n",
        now_utc(),
        machine()
    )
}

/// The records of one table: same suite, workload, KV, offered rate and
/// time scale; one entry per variant, in first-seen order.
pub struct Group<'a> {
    pub workload: String,
    pub kv: String,
    pub load: Option<f64>,
    pub rate: f64,
    pub time_scale: f64,
    pub variants: Vec<(String, Vec<&'a RunRecord>)>,
}

/// Groups `records` into tables, in first-seen order.
pub fn group(records: &[RunRecord]) -> Vec<Group<'_>> {
    let mut groups: Vec<Group> = Vec::new();
    for r in records {
        let at = groups.iter().position(|g| {
            g.workload == r.workload
                && g.kv == r.kv
                && (g.rate - r.rate).abs() < 1e-6
                && g.time_scale == r.time_scale
        });
        let g = match at {
            Some(i) => &mut groups[i],
            None => {
                groups.push(Group {
                    workload: r.workload.clone(),
                    kv: r.kv.clone(),
                    load: r.load,
                    rate: r.rate,
                    time_scale: r.time_scale,
                    variants: Vec::new(),
                });
                let last = groups.len() - 1;
                &mut groups[last]
            }
        };
        match g.variants.iter_mut().find(|(v, _)| *v == r.variant) {
            Some((_, runs)) => runs.push(r),
            None => g.variants.push((r.variant.clone(), vec![r])),
        }
    }
    groups
}

pub fn per_seed(runs: &[&RunRecord], f: impl Fn(&RunRecord) -> f64) -> Vec<(u64, f64)> {
    runs.iter().map(|r| (r.seed, f(r))).collect()
}

pub fn values(runs: &[&RunRecord], f: impl Fn(&RunRecord) -> f64) -> Vec<f64> {
    runs.iter().map(|r| f(r)).collect()
}

fn opt(v: Option<f64>) -> f64 {
    v.unwrap_or(f64::NAN)
}

fn cell(v: f64, decimals: usize) -> String {
    if v.is_nan() {
        "–".into()
    } else {
        format!("{v:.decimals$}")
    }
}

fn ratio_cell(r: Option<PairedRatio>) -> String {
    r.map_or("–".into(), |r| r.display())
}

/// The table of one group: medians over seeds, and `reference ÷ variant`
/// paired ratios with 95% bootstrap intervals.
pub fn group_table(g: &Group, reference: &str) -> String {
    let header = [
        "variant",
        "seeds",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99 (min–max)",
        "goodput",
        "cache hit",
        "rank imbalance",
        "load polls/s/worker",
        "errors",
        &format!("{reference} ÷ this: TTFT p99"),
        &format!("{reference} ÷ this: TTFT p90"),
        &format!("{reference} ÷ this: goodput"),
    ];
    let reference_runs = g
        .variants
        .iter()
        .find(|(v, _)| v == reference)
        .map(|(_, r)| r.as_slice());
    let mut rows = Vec::new();
    for (variant, runs) in &g.variants {
        let ratio = |f: &dyn Fn(&RunRecord) -> f64| -> String {
            match reference_runs {
                Some(reference_runs) if variant != reference => {
                    ratio_cell(paired_ratio(&per_seed(reference_runs, f), &per_seed(runs, f)))
                }
                _ => "–".into(),
            }
        };
        let name = if variant == reference {
            format!("**{variant}**")
        } else {
            format!("`{variant}`")
        };
        rows.push(vec![
            name,
            runs.len().to_string(),
            cell(median(&values(runs, |r| r.ttft_p50)), 0),
            cell(median(&values(runs, |r| r.ttft_p90)), 0),
            fmt_spread(&values(runs, |r| r.ttft_p99), 0),
            cell(median(&values(runs, |r| r.goodput)) * 100.0, 1) + " %",
            cell(median(&values(runs, |r| opt(r.cache_hit))) * 100.0, 1) + " %",
            cell(median(&values(runs, |r| opt(r.imbalance))), 3),
            cell(median(&values(runs, |r| r.load_polls_per_worker_s)), 1),
            runs.iter().map(|r| r.errors).sum::<usize>().to_string(),
            ratio(&|r| r.ttft_p99),
            ratio(&|r| r.ttft_p90),
            ratio(&|r| r.goodput),
        ]);
    }
    markdown_table(&header, &rows)
}

/// Notes under a table: set-up facts every reader needs.
pub fn group_notes(g: &Group) -> String {
    let mut md = String::new();
    let all: Vec<&RunRecord> = g.variants.iter().flat_map(|(_, r)| r.iter().copied()).collect();
    let sent: Vec<f64> = all.iter().map(|r| r.sent as f64).collect();
    let per_seed = median(&sent);
    let seeds = g.variants.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    let first = all.first().copied();
    let slo = first.map(|r| r.slo);
    let warmup = first.map_or(0.0, |r| r.warmup_s);
    let _ = writeln!(
        md,
        "\n- {} measured requests per seed (median), sent over {} simulated s after {} s of warm-up arrivals that are not counted; a seed's TTFT p99 rests on its {} largest TTFTs, and pooled over {} seeds on {}.",
        per_seed as usize,
        first.map_or(0.0, |r| r.duration_s),
        warmup,
        tail_samples(per_seed as usize, 99.0),
        seeds,
        tail_samples(per_seed as usize * seeds, 99.0)
    );
    if let Some(slo) = slo {
        let _ = writeln!(
            md,
            "- goodput: share of sent requests with TTFT <= {} ms and mean time per output token <= {} ms (simulated); failed requests count as missing it.",
            slo.ttft_ms, slo.tpot_ms
        );
    }
    let _ = writeln!(
        md,
        "- What each variant routes on, and how fresh it is (time scale {}):",
        g.time_scale
    );
    for (variant, runs) in &g.variants {
        if let Some(r) = runs.first() {
            let _ = writeln!(md, "  - `{variant}`: {}", r.freshness);
        }
    }
    let busy: Vec<f64> = all.iter().filter_map(|r| r.cpu_busy).collect();
    if !busy.is_empty() {
        let _ = writeln!(
            md,
            "- CPU busy during runs: median {:.0} %, max {:.0} % of {} cores (load generator, simulator and gateways share them).",
            median(&busy) * 100.0,
            percentile(&busy, 100.0) * 100.0,
            crate::cpu::machine_cores()
        );
    }
    let errors: Vec<&String> = all.iter().flat_map(|r| r.error_examples.iter()).take(3).collect();
    for e in errors {
        let _ = writeln!(md, "- error seen: `{e}`");
    }
    md
}

/// The title line of a group.
pub fn group_title(g: &Group) -> String {
    let load = g
        .load
        .map_or(String::new(), |l| format!("{:.0}% of capacity, ", l * 100.0));
    format!(
        "`{}`, KV {}, offered {}{:.2} req/s (simulated), time scale {}",
        g.workload, g.kv, load, g.rate, g.time_scale
    )
}

/// Per (workload, KV): variant -> (load, median of `f` over seeds), for plots.
pub type SweepSeries = BTreeMap<(String, String), Vec<(String, Vec<(f64, f64)>)>>;

pub fn sweep_series(groups: &[Group], f: impl Fn(&RunRecord) -> f64) -> SweepSeries {
    let mut out: SweepSeries = BTreeMap::new();
    for g in groups {
        let Some(load) = g.load else { continue };
        let entry = out.entry((g.workload.clone(), g.kv.clone())).or_default();
        for (variant, runs) in &g.variants {
            let y = median(&values(runs, &f));
            match entry.iter_mut().find(|(v, _)| v == variant) {
                Some((_, points)) => points.push((load, y)),
                None => entry.push((variant.clone(), vec![(load, y)])),
            }
        }
    }
    for series in out.values_mut() {
        for (_, points) in series.iter_mut() {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::stats::Slo;

    pub(crate) fn record(variant: &str, seed: u64, p99: f64, rate: f64) -> RunRecord {
        RunRecord {
            key: format!("{variant}{seed}"),
            suite: "s".into(),
            workload: "no-prefix".into(),
            kv: "small".into(),
            load: Some(rate / 10.0),
            rate,
            warmup_s: 10.0,
            duration_s: 30.0,
            time_scale: 5.0,
            variant: variant.into(),
            seed,
            fleet: "2 workers x 4 ranks".into(),
            freshness: "f".into(),
            warmup_requests: 100,
            sent: 300,
            ok: 300,
            errors: 0,
            abandoned: 0,
            beyond_horizon: 0,
            error_examples: vec![],
            mean_input_tokens: 300.0,
            mean_output_tokens: 200.0,
            per_gateway: vec![300],
            ttft_ms: vec![],
            ttft_p50: 30.0,
            ttft_p90: p99 / 2.0,
            ttft_p99: p99,
            tpot_p50: 25.0,
            tpot_p99: 40.0,
            itl_p50: 25.0,
            itl_p99: 45.0,
            e2e_p50: 1.0,
            e2e_p99: 2.0,
            slo: Slo {
                ttft_ms: 1000.0,
                tpot_ms: 60.0,
            },
            goodput: 0.9,
            throughput_rps: 8.0,
            output_tokens_per_s: 1.0,
            cache_hit: None,
            imbalance: Some(1.3),
            prefill_spread: None,
            served_per_rank: vec![],
            load_polls_per_worker_s: 1.0,
            cpu_busy: Some(0.4),
            wall_s: 10.0,
            dprank_counters: None,
            started: "t".into(),
        }
    }

    #[test]
    fn groups_and_ratios_pair_by_seed() {
        let mut records = Vec::new();
        for seed in 1..=4 {
            records.push(record("dprank", seed, 100.0 * seed as f64, 8.5));
            records.push(record("rr", seed, 200.0 * seed as f64, 8.5));
        }
        records.push(record("rr", 1, 50.0, 5.0));
        let groups = group(&records);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0].variants.len(), 2);
        let table = group_table(&groups[0], "dprank");
        assert!(table.contains("| **dprank** | 4 |"), "{table}");
        assert!(table.contains("0.50 [0.50, 0.50]"), "{table}");
        assert!(group_title(&groups[0]).contains("85% of capacity"));
        let notes = group_notes(&groups[0]);
        assert!(
            notes.contains("300 measured requests per seed")
                && notes.contains("4 largest")
                && notes.contains("4 seeds on 13"),
            "{notes}"
        );
        let series = sweep_series(&groups, |r| r.ttft_p99);
        let rr = &series[&("no-prefix".to_string(), "small".to_string())]
            .iter()
            .find(|(v, _)| v == "rr")
            .unwrap()
            .1;
        assert_eq!(rr, &vec![(0.5, 50.0), (0.85, 500.0)]);
    }

    #[test]
    fn spread_formatting() {
        assert_eq!(fmt_spread(&[3.0, 1.0, 2.0], 1), "2.0 (1.0–3.0)");
        assert_eq!(fmt_spread(&[5.0], 0), "5");
        assert_eq!(fmt_spread(&[], 0), "n/a");
    }
}
