//! Result files: markdown tables built from run records (medians over seeds,
//! paired ratios with bootstrap intervals), the set-up they ran in, and
//! small formatting helpers shared by every benchmark.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::cpu::CpuUse;
use crate::provenance::{machine, now_utc};
use crate::runner::RunRecord;
use crate::seeds::describe_seeds;
use crate::stats::{
    all_once, cluster_estimate, median, min_max, paired_cluster_ratio, percentile, tail_samples, Pooled,
    SeedRequests,
};

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

/// The opening of every results file: the title, then when, where and how it was measured.
pub fn report_header(title: &str, command_line: &str) -> String {
    format!(
        "# {title}\n\n- date: {}\n- machine: {}\n- command: `{command_line}`\n\n",
        now_utc(),
        machine()
    )
}

/// The records of one table: same workload, KV, offered rate, time scale,
/// simulator preset and mode; one entry per variant, in first-seen order.
pub struct Group<'a> {
    pub workload: String,
    pub kv: String,
    pub load: Option<f64>,
    pub rate: f64,
    pub time_scale: f64,
    pub preset: String,
    pub mode: String,
    pub variants: Vec<(String, Vec<&'a RunRecord>)>,
}

fn mode_of(r: &RunRecord) -> String {
    r.mode.clone().unwrap_or_else(|| {
        if r.freshness.starts_with("offline model") {
            "virtual".into()
        } else {
            "harness".into()
        }
    })
}

/// Groups `records` into tables, in first-seen order.
pub fn group(records: &[RunRecord]) -> Vec<Group<'_>> {
    let mut groups: Vec<Group> = Vec::new();
    for r in records {
        let mode = mode_of(r);
        let at = groups.iter().position(|g| {
            g.workload == r.workload
                && g.kv == r.kv
                && (g.rate - r.rate).abs() < 1e-6
                && g.time_scale == r.time_scale
                && g.preset == r.preset_name()
                && g.mode == mode
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
                    preset: r.preset_name().to_string(),
                    mode,
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

impl Group<'_> {
    pub fn all(&self) -> impl Iterator<Item = &RunRecord> {
        self.variants.iter().flat_map(|(_, r)| r.iter().copied())
    }

    /// Why this table must not stand as one comparison: runs from several
    /// commits or machines.
    pub fn mixed(&self) -> Option<String> {
        crate::provenance::mixed(self.all().map(|r| r.provenance.as_ref()))
    }

    fn runs_of(&self, variant: &str) -> Option<&[&RunRecord]> {
        self.variants
            .iter()
            .find(|(v, _)| v == variant)
            .map(|(_, r)| r.as_slice())
    }
}

/// The groups' mixing of commits or machines: an error unless `allow`, then
/// a line per mixed table to print loudly.
pub fn check_mixed(groups: &[Group], allow: bool) -> Result<Vec<String>, String> {
    let mixed: Vec<String> = groups
        .iter()
        .filter_map(|g| g.mixed().map(|why| format!("{}: {why}", group_title(g))))
        .collect();
    if mixed.is_empty() || allow {
        Ok(mixed)
    } else {
        Err(format!(
            "refusing to put runs of different commits or machines in one table (--allow-mixed flags them instead):\n  {}",
            mixed.join("\n  ")
        ))
    }
}

pub fn per_seed(runs: &[&RunRecord], f: impl Fn(&RunRecord) -> f64) -> Vec<(u64, f64)> {
    runs.iter().map(|r| (r.seed, f(r))).collect()
}

pub fn values(runs: &[&RunRecord], f: impl Fn(&RunRecord) -> f64) -> Vec<f64> {
    runs.iter().map(|r| f(r)).collect()
}

/// Every run's measured requests, for pooled figures.
pub fn seed_requests(runs: &[&RunRecord]) -> Vec<SeedRequests> {
    runs.iter().map(|r| r.requests()).collect()
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

/// A pooled TTFT percentile.
pub fn pooled_ttft(p: f64) -> impl Fn(&Pooled, &[u32]) -> f64 {
    move |pooled, w| pooled.percentile(w, p)
}

/// Pooled goodput.
pub fn pooled_goodput(pooled: &Pooled, w: &[u32]) -> f64 {
    pooled.goodput(w)
}

/// Overload protection's figures of a group, one line per variant, pooled
/// over its seeds: SLO-met requests per second (over the measured window),
/// goodput of each class, TTFT p99 of the admitted requests, refusals (and
/// how long they took), and how long held requests waited. Empty when no
/// run of the group has overload figures.
pub fn overload_table(g: &Group) -> String {
    let any = g
        .variants
        .iter()
        .any(|(_, runs)| runs.iter().any(|r| r.overload.is_some()));
    if !any {
        return String::new();
    }
    let mut md = String::from(
        "\nOverload protection (pooled over seeds; refusals are 429, smg's 408 queue time-out, dprank's 503; a refusal misses the SLO):\n\n\
         | variant | SLO-met req/s | goodput high | goodput low | TTFT p99 admitted (ms) | refused | by status | refusal p99 (wall ms) | held | held wait p99 / max (ms) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (variant, runs) in &g.variants {
        let good: f64 = runs.iter().map(|r| r.requests().good).sum();
        let window: f64 = runs.iter().map(|r| r.duration_s).sum();
        let figures: Vec<&crate::runner::OverloadFigures> =
            runs.iter().filter_map(|r| r.overload.as_ref()).collect();
        let sum = |f: &dyn Fn(&crate::runner::OverloadFigures) -> usize| {
            figures.iter().map(|o| f(o)).sum::<usize>()
        };
        let share = |good: usize, sent: usize| {
            if sent == 0 {
                "-".to_string()
            } else {
                format!("{:.1}%", 100.0 * good as f64 / sent as f64)
            }
        };
        let ttft: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.ttft_ms.iter().map(|t| f64::from(*t)))
            .collect();
        let sent: usize = runs.iter().map(|r| r.sent).sum();
        let refused = sum(&|o| o.rejected.values().sum());
        let mut statuses: std::collections::BTreeMap<u16, usize> = std::collections::BTreeMap::new();
        for o in &figures {
            for (status, n) in &o.rejected {
                *statuses.entry(*status).or_default() += n;
            }
        }
        let by_status = statuses
            .iter()
            .map(|(s, n)| format!("{s}: {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let refusals: Vec<f64> = figures
            .iter()
            .flat_map(|o| o.rejection_wall_ms.iter().map(|v| f64::from(*v)))
            .collect();
        let held: Vec<f64> = figures
            .iter()
            .flat_map(|o| o.held_ms.iter().map(|v| f64::from(*v)))
            .collect();
        let ms = |v: f64| {
            if v.is_nan() {
                "-".to_string()
            } else {
                format!("{v:.0}")
            }
        };
        let _ = writeln!(
            md,
            "| `{variant}` | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} / {} |",
            good / window.max(1e-9),
            share(sum(&|o| o.high_good), sum(&|o| o.high_sent)),
            share(sum(&|o| o.low_good), sum(&|o| o.low_sent)),
            ms(crate::stats::percentile(&ttft, 99.0)),
            share(refused, sent),
            if by_status.is_empty() {
                "-".to_string()
            } else {
                by_status
            },
            ms(crate::stats::percentile(&refusals, 99.0)),
            held.len(),
            ms(crate::stats::percentile(&held, 99.0)),
            ms(held.iter().copied().fold(f64::NAN, f64::max)),
        );
    }
    md.push('\n');
    md.push_str(&proxy_table(g));
    md
}

/// What Envoy's access log measured on the harness (runs with admission):
/// refusals from the request's first byte in to the answer's last byte
/// out, and requests sent on from their last byte in to their first byte
/// upstream, wall ms. Empty when no run has a log.
fn proxy_table(g: &Group) -> String {
    let mut rows = String::new();
    for (variant, runs) in &g.variants {
        let logs: Vec<&crate::access_log::ProxyTimes> = runs
            .iter()
            .filter_map(|r| r.overload.as_ref().and_then(|o| o.proxy.as_ref()))
            .collect();
        if logs.is_empty() {
            continue;
        }
        let pooled = |f: &dyn Fn(&crate::access_log::ProxyTimes) -> &Vec<f32>| -> Vec<f64> {
            logs.iter()
                .flat_map(|l| f(l).iter().map(|v| f64::from(*v)))
                .collect()
        };
        let refusals = pooled(&|l| &l.refusal_ms);
        let sent_on = pooled(&|l| &l.before_upstream_ms);
        let ms = |v: f64| {
            if v.is_nan() {
                "-".to_string()
            } else {
                format!("{v:.2}")
            }
        };
        let spread = |v: &[f64]| {
            format!(
                "{} / {} / {}",
                ms(crate::stats::percentile(v, 50.0)),
                ms(crate::stats::percentile(v, 99.0)),
                ms(v.iter().copied().fold(f64::NAN, f64::max))
            )
        };
        let _ = writeln!(
            rows,
            "| `{variant}` | {} | {} | {} | {} | {} |",
            refusals.len(),
            spread(&refusals),
            logs.iter().map(|l| l.refusals_without_retry_after).sum::<usize>(),
            sent_on.len(),
            spread(&sent_on),
        );
    }
    if rows.is_empty() {
        return rows;
    }
    format!(
        "At the proxy (Envoy's access log, wall ms, measured window; refusals from the request's first byte in to the answer's last byte out, requests sent on from their last byte in to their first byte upstream, which includes any hold in dprank's queue):\n\n\
         | variant | refusals | refusal p50 / p99 / max | refusals without `retry-after` | sent on | before upstream p50 / p99 / max |\n\
         |---|---|---|---|---|---|\n{rows}\n"
    )
}

/// The table of one group: pooled TTFT percentiles and goodput with their
/// cluster-bootstrap intervals (seeds resampled), the per-seed medians
/// beside them, and `reference ÷ variant` of the pooled figures, paired by
/// seed (the same resample for both).
pub fn group_table(g: &Group, reference: &str) -> String {
    let header = [
        "variant",
        "seeds",
        "requests",
        "TTFT p50 pooled [95%]",
        "TTFT p90 pooled [95%]",
        "TTFT p99 pooled [95%]",
        "per-seed median p90 / p99 (p99 min–max)",
        "goodput pooled [95%]",
        &format!("{reference} ÷ this: TTFT p90"),
        &format!("{reference} ÷ this: TTFT p99"),
        &format!("{reference} ÷ this: goodput"),
        "cache hit",
        "load polls/s/worker",
        "CPU-bound runs",
        "errors",
    ];
    let reference_requests = g.runs_of(reference).map(seed_requests);
    let mut rows = Vec::new();
    for (variant, runs) in &g.variants {
        let requests = seed_requests(runs);
        let pooled = Pooled::new(&requests);
        let estimate = |p: f64| cluster_estimate(&pooled, pooled_ttft(p)).display(0);
        let ratio = |figure: &dyn Fn(&Pooled, &[u32]) -> f64| -> String {
            match &reference_requests {
                Some(base) if variant != reference => {
                    paired_cluster_ratio(base, &requests, figure).map_or("–".into(), |e| e.display_ratio())
                }
                _ => "–".into(),
            }
        };
        let name = if variant == reference {
            format!("**{variant}**")
        } else {
            format!("`{variant}`")
        };
        let bound = runs
            .iter()
            .filter(|r| r.cpu.as_ref().is_some_and(|c| c.bound.is_some()))
            .count();
        let measured_cpu = runs.iter().filter(|r| r.cpu.is_some()).count();
        rows.push(vec![
            name,
            runs.len().to_string(),
            pooled.requests().to_string(),
            estimate(50.0),
            estimate(90.0),
            estimate(99.0),
            format!(
                "{} / {}",
                cell(median(&values(runs, |r| r.ttft_p90)), 0),
                fmt_spread(&values(runs, |r| r.ttft_p99), 0)
            ),
            cluster_estimate(&pooled, pooled_goodput).scaled(100.0).display(1) + " %",
            ratio(&pooled_ttft(90.0)),
            ratio(&pooled_ttft(99.0)),
            ratio(&pooled_goodput),
            cell(median(&values(runs, |r| opt(r.cache_hit))) * 100.0, 1) + " %",
            cell(median(&values(runs, |r| r.load_polls_per_worker_s)), 1),
            if measured_cpu == 0 {
                "–".into()
            } else if bound > 0 {
                format!("**{bound} of {measured_cpu}**")
            } else {
                format!("0 of {measured_cpu}")
            },
            runs.iter().map(|r| r.errors).sum::<usize>().to_string(),
        ]);
    }
    markdown_table(&header, &rows)
}

/// One line per table of a report of several: each variant's pooled TTFT
/// p90 (simulated ms) and goodput, the reference in bold; the intervals
/// are in the tables below. Empty for a report of one table.
pub fn overview_table(groups: &[Group], reference: &str) -> String {
    if groups.len() < 2 {
        return String::new();
    }
    let mut variants: Vec<&str> = Vec::new();
    for g in groups {
        for (v, _) in &g.variants {
            if !variants.contains(&v.as_str()) {
                variants.push(v);
            }
        }
    }
    let mut header = vec!["workload", "KV", "load"];
    header.extend(variants.iter().copied());
    let rows: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            let mut row = vec![
                g.workload.clone(),
                g.kv.clone(),
                g.load
                    .map_or(format!("{:.2} req/s", g.rate), |l| format!("{:.0}%", l * 100.0)),
            ];
            for v in &variants {
                let figure = g.runs_of(v).map(|runs| {
                    let pooled = Pooled::new(&seed_requests(runs));
                    let all = crate::stats::all_once(pooled.seeds());
                    format!(
                        "{} / {:.1}%",
                        cell(pooled_ttft(90.0)(&pooled, &all), 0),
                        pooled_goodput(&pooled, &all) * 100.0
                    )
                });
                row.push(match figure {
                    Some(f) if *v == reference => format!("**{f}**"),
                    Some(f) => f,
                    None => "–".into(),
                });
            }
            row
        })
        .collect();
    format!(
        "## At a glance\n\nTTFT p90 (simulated ms) / goodput, pooled over the seeds; intervals and the other figures in the tables below.\n\n{}\n",
        markdown_table(&header, &rows)
    )
}

/// Notes under a table: set-up facts every reader needs.
pub fn group_notes(g: &Group) -> String {
    let mut md = String::new();
    let all: Vec<&RunRecord> = g.all().collect();
    if let Some(why) = g.mixed() {
        let _ = writeln!(
            md,
            "\n- **WARNING: this table mixes {why}; its comparisons do not hold.**"
        );
    }
    let sent: Vec<f64> = all.iter().map(|r| r.sent as f64).collect();
    let per_seed = median(&sent);
    let seeds: Vec<u64> = {
        let mut s: Vec<u64> = all.iter().map(|r| r.seed).collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let first = all.first().copied();
    let warmup = first.map_or(0.0, |r| r.warmup_s);
    let _ = writeln!(
        md,
        "\n- Seeds: {}. {} measured requests per seed (median), sent over {} simulated s after {} s of warm-up arrivals that are not counted; a seed's TTFT p99 rests on its {} largest TTFTs, the pooled p99 on {}.",
        describe_seeds(&seeds),
        per_seed as usize,
        first.map_or(0.0, |r| r.duration_s),
        warmup,
        tail_samples(per_seed as usize, 99.0),
        tail_samples(per_seed as usize * seeds.len(), 99.0)
    );
    let lengthened: Vec<f64> = all.iter().filter_map(|r| r.lengthened_from_s).collect();
    if let (Some(from), Some(r)) = (lengthened.first(), first) {
        let _ = writeln!(
            md,
            "- The measured window was lengthened from {from} s to {} s so each seed holds at least 1,000 requests at this rate.",
            r.duration_s
        );
    }
    let _ = writeln!(
        md,
        "- Pooled: every seed's measured requests together (a failed request counts as an infinite TTFT); [95%] intervals from a cluster bootstrap ({} resamples of the seeds, the same resample for both sides of a ratio). With few seeds these intervals are optimistic.",
        crate::stats::CLUSTER_RESAMPLES
    );
    if let Some(r) = first {
        if let Some(source) = &r.source {
            let _ = writeln!(
                md,
                "- Requests: {source}; {}.",
                r.output_cap.as_deref().unwrap_or("max tokens as recorded")
            );
        }
        let _ = writeln!(
            md,
            "- goodput: share of sent requests with TTFT <= {} ms and mean time per output token <= {} ms (simulated); failed requests count as missing it.",
            r.slo.ttft_ms, r.slo.tpot_ms
        );
        if let Some((method, rps)) = &r.capacity {
            let _ = writeln!(
                md,
                "- Capacity the load is a share of: {rps:.2} req/s ({method})."
            );
        }
    }
    let _ = writeln!(
        md,
        "- What each variant routes on, and how fresh it is (time scale {}):",
        g.time_scale
    );
    for (variant, runs) in &g.variants {
        if let Some(r) = runs.first() {
            let model = if variant_is_model(variant, g) {
                " (a model of smg, not smg)"
            } else {
                ""
            };
            let _ = writeln!(md, "  - `{variant}`{model}: {}", r.freshness);
        }
    }
    let cpu: Vec<&CpuUse> = all.iter().filter_map(|r| r.cpu.as_ref()).collect();
    if !cpu.is_empty() {
        let m = |f: &dyn Fn(&CpuUse) -> f64| median(&cpu.iter().map(|c| f(c)).collect::<Vec<_>>());
        let bound: Vec<String> = all
            .iter()
            .filter_map(|r| {
                Some(format!(
                    "`{}` seed {}: {}",
                    r.variant,
                    r.seed,
                    r.cpu.as_ref()?.bound.as_ref()?
                ))
            })
            .collect();
        let _ = writeln!(
            md,
            "- CPU, cores used on average over a run (median of runs): load generator {:.2}, gateways {:.2}, simulator {:.2}; the machine {:.2} of {} cores (other users included). A run is CPU-bound when the machine's cores were at least {:.0}% busy or the gateways or load generator alone used that share of them.",
            m(&|c| c.load_generator),
            m(&|c| c.gateways),
            m(&|c| c.simulator),
            m(&|c| c.machine),
            cpu[0].cores,
            crate::cpu::BOUND_SHARE * 100.0
        );
        if !bound.is_empty() {
            let _ = writeln!(
                md,
                "- **CPU-BOUND runs ({} of {}): they measured the machine, not the router**: {}.",
                bound.len(),
                cpu.len(),
                bound.join("; ")
            );
        }
    } else {
        let busy: Vec<f64> = all.iter().filter_map(|r| r.cpu_busy).collect();
        if !busy.is_empty() {
            let _ = writeln!(
                md,
                "- CPU busy during runs: median {:.0} %, max {:.0} % of the machine's cores (per-process use not recorded).",
                median(&busy) * 100.0,
                percentile(&busy, 100.0) * 100.0,
            );
        }
    }
    let mut notes: Vec<&String> = all.iter().flat_map(|r| r.notes.iter()).collect();
    notes.sort();
    notes.dedup();
    for note in notes.iter().take(5) {
        let _ = writeln!(md, "- Plan: {note}");
    }
    let (commits, machines) = crate::provenance::distinct(all.iter().map(|r| r.provenance.as_ref()));
    let _ = writeln!(
        md,
        "- Commit {}; machine {}.",
        commits.join(", "),
        machines.join(" / ")
    );
    let errors: Vec<&String> = all.iter().flat_map(|r| r.error_examples.iter()).take(3).collect();
    for e in errors {
        let _ = writeln!(md, "- error seen: `{e}`");
    }
    md
}

/// Whether `variant` runs as our model of smg (virtual-time tables).
fn variant_is_model(variant: &str, g: &Group) -> bool {
    g.mode == "virtual" && variant.starts_with("smg")
}

/// The title line of a group.
pub fn group_title(g: &Group) -> String {
    let load = g
        .load
        .map_or(String::new(), |l| format!("{:.0}% of capacity, ", l * 100.0));
    let (source, when) = match g.mode.as_str() {
        "virtual" => ("virtual time (offline model)", String::new()),
        _ => ("harness", format!(", time scale {}", g.time_scale)),
    };
    let real = if g
        .all()
        .any(|r| r.source.as_deref().is_some_and(|s| s.starts_with("real")))
    {
        "real trace"
    } else {
        "synthetic"
    };
    let slo = g.all().next().map_or(String::new(), |r| {
        format!(", SLO TTFT <= {} ms, TPOT <= {} ms", r.slo.ttft_ms, r.slo.tpot_ms)
    });
    format!(
        "`{}` ({real}), KV {}, offered {}{:.2} req/s (simulated), preset `{}`{slo}, {source}{when}",
        g.workload, g.kv, load, g.rate, g.preset
    )
}

/// Per (workload, KV): variant -> (load, pooled `f` over seeds), for plots.
pub type SweepSeries = BTreeMap<(String, String), Vec<(String, Vec<(f64, f64)>)>>;

pub fn sweep_series(groups: &[Group], f: impl Fn(&Pooled, &[u32]) -> f64) -> SweepSeries {
    let mut out: SweepSeries = BTreeMap::new();
    for g in groups {
        let Some(load) = g.load else { continue };
        let entry = out.entry((g.workload.clone(), g.kv.clone())).or_default();
        for (variant, runs) in &g.variants {
            let pooled = Pooled::new(&seed_requests(runs));
            let y = f(&pooled, &all_once(pooled.seeds()));
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
            mode: None,
            preset: None,
            source: None,
            output_cap: None,
            capacity: None,
            lengthened_from_s: None,
            notes: vec![],
            warmup_requests: 100,
            sent: 100,
            ok: 100,
            errors: 0,
            abandoned: 0,
            beyond_horizon: 0,
            error_examples: vec![],
            mean_input_tokens: 300.0,
            mean_output_tokens: 200.0,
            per_gateway: vec![100],
            ttft_ms: (1..=100).map(|i| (f64::from(i) * p99 / 99.0) as f32).collect(),
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
            cpu: None,
            good: None,
            overload: None,
            wall_s: 10.0,
            dprank_counters: None,
            started: "t".into(),
            provenance: None,
        }
    }

    #[test]
    fn the_overview_has_a_line_per_table_and_a_column_per_variant() {
        let records = [
            record("dprank", 1, 500.0, 60.0),
            record("rr", 1, 800.0, 60.0),
            record("dprank", 1, 700.0, 80.0),
        ];
        let groups = group(&records);
        let md = overview_table(&groups, "dprank");
        assert!(md.contains("| workload | KV | load | dprank | rr |"), "{md}");
        let lines: Vec<&str> = md.lines().filter(|l| l.starts_with("| no-prefix")).collect();
        assert_eq!(lines.len(), 2, "{md}");
        assert!(lines[0].contains("| 600% | **"), "the reference in bold: {md}");
        assert!(
            lines[1].ends_with("| –|") || lines[1].ends_with("| – |"),
            "rr did not run there: {md}"
        );
        assert_eq!(
            overview_table(&groups[..1], "dprank"),
            "",
            "one table needs no overview"
        );
    }

    #[test]
    fn the_proxy_table_pools_the_access_logs_of_runs_with_one() {
        let mut with_log = record("dprank-reject", 1, 500.0, 60.0);
        with_log.overload = Some(crate::runner::OverloadFigures {
            proxy: Some(crate::access_log::ProxyTimes {
                refusal_ms: (1..=100).map(|i| i as f32 / 100.0).collect(),
                refusals_without_retry_after: 0,
                before_upstream_ms: vec![0.25; 10],
            }),
            ..Default::default()
        });
        let mut without = record("dprank", 1, 500.0, 60.0);
        without.overload = Some(crate::runner::OverloadFigures::default());
        let records = [with_log, without];
        let groups = group(&records);
        let table = proxy_table(&groups[0]);
        assert!(
            table.contains("| `dprank-reject` | 100 | 0.50 / 0.99 / 1.00 | 0 | 10 | 0.25 / 0.25 / 0.25 |"),
            "{table}"
        );
        assert!(!table.contains("`dprank` |"), "a run without a log has no row");
        assert_eq!(proxy_table(&group(&records[1..])[0]), "", "no log, no table");
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
            notes.contains("100 measured requests per seed")
                && notes.contains("2 largest")
                && notes.contains("pooled p99 on 5"),
            "{notes}"
        );
        let series = sweep_series(&groups, pooled_ttft(99.0));
        let rr = &series[&("no-prefix".to_string(), "small".to_string())]
            .iter()
            .find(|(v, _)| v == "rr")
            .unwrap()
            .1;
        let all: Vec<f64> = records
            .iter()
            .filter(|r| r.variant == "rr" && r.rate == 8.5)
            .flat_map(|r| r.ttft_ms.iter().map(|v| f64::from(*v)))
            .collect();
        assert_eq!(rr[0], (0.5, f64::from(50.0f32)));
        assert_eq!(rr[1], (0.85, percentile(&all, 99.0)));
    }

    #[test]
    fn tables_of_several_commits_are_refused_unless_flagged() {
        let mut a = record("dprank", 1, 100.0, 8.5);
        a.provenance = Some(crate::provenance::Provenance {
            commit: "aaa".into(),
            machine: "EPYC, 2 cores, Linux 6".into(),
            ..Default::default()
        });
        let mut b = record("rr", 1, 100.0, 8.5);
        b.provenance = Some(crate::provenance::Provenance {
            commit: "bbb".into(),
            ..a.provenance.clone().unwrap()
        });
        let records = vec![a, b];
        let groups = group(&records);
        assert!(check_mixed(&groups, false).unwrap_err().contains("aaa, bbb"));
        assert_eq!(check_mixed(&groups, true).unwrap().len(), 1);
        assert!(group_notes(&groups[0]).contains("WARNING"));
    }

    #[test]
    fn spread_formatting() {
        assert_eq!(fmt_spread(&[3.0, 1.0, 2.0], 1), "2.0 (1.0–3.0)");
        assert_eq!(fmt_spread(&[5.0], 0), "5");
        assert_eq!(fmt_spread(&[], 0), "n/a");
    }
}
