//! `dprank-bench compare`: the same trace through every way of spreading
//! requests over the fleet's ranks, on a fresh simulated fleet each time.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;

use crate::client::pooled_client;
use crate::cpu::CpuTimes;
use crate::envoy::Balancer;
use crate::fleet::{
    dprank_counters, start_envoy, start_smg, DprankCounters, Front, SimFleet, SimOptions, SmgMode, Tools,
};
use crate::loadgen::{run_trace, LoadOptions, LoadReport};
use crate::plot;
use crate::stats::{fmt_spread, markdown_table, median, report_header};
use crate::trace::TraceRequest;
use crate::TraceArgs;

#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Simulated workers in the fleet.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Ranks per worker.
    #[arg(long, default_value_t = 4)]
    pub dp_size: usize,
    /// Simulated time runs this many times faster than wall time.
    #[arg(long, default_value_t = 4.0)]
    pub time_scale: f64,
    /// dprank's poll interval in simulated ms (the wall interval is this / time scale).
    #[arg(long, default_value_t = 1000)]
    pub poll_interval_sim_ms: u64,
    /// Repetitions of every variant; figures are the median with min–max.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Model flags for every simulated worker (see dprank-sim --help).
    #[arg(long, default_value = DEFAULT_MODEL, allow_hyphen_values = true)]
    pub sim_args: String,
    /// Only these variants (comma-separated names); default all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Where the markdown and PNGs go.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
    #[command(flatten)]
    pub trace: TraceArgs,
}

/// A smaller GPU than the simulator's default: KV for 10k tokens and 32
/// sequences per rank, so a rank fills (and queues) at a request rate whose
/// token stream two cores can carry through a proxy; see compare.md.
pub const DEFAULT_MODEL: &str = "--kv-capacity 10000 --max-running 32";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    EnvoyRoundRobin,
    EnvoyDprank,
    SmgDpAware,
    SmgMinimumTokens,
    Ideal,
    TwoEnvoysDprank,
    EnvoyDprankFastPoll,
}

impl Variant {
    pub const ALL: [Variant; 7] = [
        Variant::EnvoyRoundRobin,
        Variant::EnvoyDprank,
        Variant::SmgDpAware,
        Variant::SmgMinimumTokens,
        Variant::Ideal,
        Variant::TwoEnvoysDprank,
        Variant::EnvoyDprankFastPoll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Variant::EnvoyRoundRobin => "envoy-rr",
            Variant::EnvoyDprank => "envoy-dprank",
            Variant::SmgDpAware => "smg-dp-aware",
            Variant::SmgMinimumTokens => "smg-min-tokens",
            Variant::Ideal => "ideal",
            Variant::TwoEnvoysDprank => "2x-envoy-dprank",
            Variant::EnvoyDprankFastPoll => "envoy-dprank-fast-poll",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Variant::EnvoyRoundRobin => "(a) Envoy without dprank: round robin over workers, each worker round robin over its ranks",
            Variant::EnvoyDprank => "(b) Envoy + dprank, default settings, poll interval 1 s simulated",
            Variant::SmgDpAware => "(c) smg launch --dp-aware --policy round_robin (ranks injected round robin)",
            Variant::SmgMinimumTokens => "(c') the same + --dp-minimum-tokens-scheduler --load-monitor-interval 1",
            Variant::Ideal => "(d) ideal approximation: workers pick their least-loaded rank themselves (--dispatch minimum_tokens, exact, instantaneous), Envoy least_request over workers",
            Variant::TwoEnvoysDprank => "(e) two Envoy + dprank sharing the fleet, the load generator alternating between them",
            Variant::EnvoyDprankFastPoll => "(f) extra: Envoy + dprank polling at the filter's minimum interval (100 ms wall), to show how much of the gap to the ideal is the age of the polled loads",
        }
    }
}

/// One run of one variant.
struct RunResult {
    variant: Variant,
    report: LoadReport,
    busy: Option<f64>,
    /// Summed over the variant's Envoys, when dprank runs.
    counters: Option<DprankCounters>,
}

async fn run_variant(
    tools: &Tools,
    args: &CompareArgs,
    variant: Variant,
    trace: &[TraceRequest],
    run: usize,
) -> Result<Option<RunResult>, String> {
    let client = pooled_client();
    let sim = SimOptions {
        workers: args.workers,
        dp_size: args.dp_size,
        time_scale: args.time_scale,
        minimum_tokens: variant == Variant::Ideal,
        instant: false,
        extra: args.sim_args.split_whitespace().map(str::to_string).collect(),
    };
    let fleet = SimFleet::start(tools, &sim, &format!("compare-sim-{}-{run}", variant.name()))?;
    let dprank = Balancer::Dprank {
        poll_interval_ms: poll_wall_ms(args.poll_interval_sim_ms, args.time_scale),
    };
    let name = |suffix: &str| format!("compare-{}-{run}{suffix}", variant.name());
    let fronts: Vec<Front> = match variant {
        Variant::EnvoyRoundRobin => {
            vec![start_envoy(tools, &client, &fleet, Balancer::RoundRobin, &name("")).await?]
        }
        Variant::EnvoyDprank => vec![start_envoy(tools, &client, &fleet, dprank, &name("")).await?],
        Variant::EnvoyDprankFastPoll => {
            let fastest = Balancer::Dprank {
                poll_interval_ms: dprank::config::MIN_POLL_INTERVAL_MS,
            };
            vec![start_envoy(tools, &client, &fleet, fastest, &name("")).await?]
        }
        Variant::Ideal => vec![start_envoy(tools, &client, &fleet, Balancer::LeastRequest, &name("")).await?],
        Variant::TwoEnvoysDprank => vec![
            start_envoy(tools, &client, &fleet, dprank, &name("-1")).await?,
            start_envoy(tools, &client, &fleet, dprank, &name("-2")).await?,
        ],
        Variant::SmgDpAware | Variant::SmgMinimumTokens => {
            let mode = if variant == Variant::SmgDpAware {
                SmgMode::DpAware
            } else {
                SmgMode::DpMinimumTokens
            };
            match start_smg(tools, &client, &fleet, mode, &name("")).await? {
                Some(front) => vec![front],
                None => return Ok(None),
            }
        }
    };
    let options = LoadOptions {
        targets: fronts.iter().map(|f| f.url.clone()).collect(),
        path: "/generate".into(),
        workers: fleet.workers.clone(),
        time_scale: args.time_scale,
        sample_every: Duration::from_millis(100),
        request_timeout: Duration::from_secs(120),
        progress: true,
        label: format!("{} run {}", variant.name(), run + 1),
    };
    let before = CpuTimes::now();
    let report = run_trace(trace, &options).await?;
    let busy = CpuTimes::now().busy_since(&before);
    let mut counters = None;
    if matches!(
        variant,
        Variant::EnvoyDprank | Variant::TwoEnvoysDprank | Variant::EnvoyDprankFastPoll
    ) {
        let mut sum = DprankCounters::default();
        for admin in fronts.iter().filter_map(|f| f.admin) {
            if let Some(c) = dprank_counters(&client, admin).await {
                sum.add(&c);
            }
        }
        counters = Some(sum);
    }
    drop(fronts);
    drop(fleet);
    Ok(Some(RunResult {
        variant,
        report,
        busy,
        counters,
    }))
}

pub async fn compare(tools: &Tools, args: &CompareArgs, command_line: &str) -> Result<(), String> {
    let started = Instant::now();
    let trace = args.trace.spec().generate()?;
    let variants = select_variants(&Variant::ALL, &args.only, Variant::name)?;
    let (mean_in, mean_out) = mean_tokens(&trace);
    println!(
        "compare: {} requests over {:.0} simulated s ({:.1} req/s), mean prompt {:.0} / output {:.0} tokens; fleet {} x {} ranks, time scale {}; {} run(s) of {} variant(s)",
        trace.len(), args.trace.duration, args.trace.rate, mean_in, mean_out, args.workers, args.dp_size, args.time_scale, args.runs, variants.len()
    );
    let cpu_start = CpuTimes::now();
    let mut results: Vec<RunResult> = Vec::new();
    let mut skipped: Vec<Variant> = Vec::new();
    // Variants interleave within a run so slow drift of the machine hits all alike.
    for run in 0..args.runs {
        for &variant in &variants {
            if skipped.contains(&variant) {
                continue;
            }
            match run_variant(tools, args, variant, &trace, run).await? {
                Some(result) => {
                    println!("  {}", result.report.summary());
                    print_run_details(result.counters.as_ref(), &result.report);
                    results.push(result);
                }
                None => {
                    print_skipped(variant.name());
                    skipped.push(variant);
                }
            }
        }
    }
    let busy_total = CpuTimes::now().busy_since(&cpu_start);
    let elapsed = started.elapsed();

    let per_variant = |v: Variant| -> Vec<&RunResult> { results.iter().filter(|r| r.variant == v).collect() };
    let metric = |v: Variant, f: &dyn Fn(&LoadReport) -> f64| -> Vec<f64> {
        per_variant(v).iter().map(|r| f(&r.report)).collect()
    };
    let mut header = vec!["variant"];
    header.extend(LATENCY_HEADER);
    header.extend(["rank token imbalance", "errors", "CPU busy"]);
    let mut rows = Vec::new();
    for &v in &variants {
        let runs = per_variant(v);
        if runs.is_empty() {
            continue;
        }
        let reports: Vec<&LoadReport> = runs.iter().map(|r| &r.report).collect();
        let busy: Vec<Option<f64>> = runs.iter().map(|r| r.busy).collect();
        let mut row = vec![v.name().to_string()];
        row.extend(latency_cells(&reports));
        row.push(fmt_spread(&metric(v, &|r| r.imbalance.unwrap_or(f64::NAN)), 3));
        row.extend(errors_and_busy_cells(&reports, &busy));
        rows.push(row);
    }
    let table = markdown_table(&header, &rows);
    println!("\n{table}");

    // Targets as measured ratios (medians).
    let ttft99 = |v: Variant| median(&metric(v, &|r| r.ttft_p(99.0)));
    let mut targets = String::new();
    let dprank99 = ttft99(Variant::EnvoyDprank);
    let ratio_line = |other: Variant, goal: &str| -> String {
        let o = ttft99(other);
        if o.is_finite() && dprank99.is_finite() {
            format!(
                "- dprank TTFT p99 / {} TTFT p99 = {:.0} / {:.0} = **{:.2}** (target {goal})\n",
                other.name(),
                dprank99,
                o,
                dprank99 / o
            )
        } else {
            format!("- dprank TTFT p99 / {}: not measured\n", other.name())
        }
    };
    targets.push_str(&ratio_line(Variant::EnvoyRoundRobin, "<= 0.7"));
    targets.push_str(&ratio_line(Variant::SmgDpAware, "<= 0.9"));
    targets.push_str(&ratio_line(Variant::SmgMinimumTokens, "<= 0.9"));
    targets.push_str(&ratio_line(Variant::Ideal, "<= 1.2"));
    let imbalance = median(&metric(Variant::EnvoyDprank, &|r| {
        r.imbalance.unwrap_or(f64::NAN)
    }));
    let _ = writeln!(
        targets,
        "- dprank rank token imbalance = **{imbalance:.3}** (target <= 1.15)"
    );
    let ideal_imbalance = median(&metric(Variant::Ideal, &|r| r.imbalance.unwrap_or(f64::NAN)));
    if ideal_imbalance.is_finite() {
        let _ = writeln!(
            targets,
            "- for reference, the ideal's rank token imbalance = {ideal_imbalance:.3} (the floor of this metric on this trace: discrete, heavy-tailed requests on 8 ranks)"
        );
    }
    let fast = ttft99(Variant::EnvoyDprankFastPoll);
    let ideal99 = ttft99(Variant::Ideal);
    if fast.is_finite() && ideal99.is_finite() {
        let _ = writeln!(
            targets,
            "- dprank polling every {} ms wall ({:.1} s simulated): TTFT p99 / ideal = {fast:.0} / {ideal99:.0} = {:.2}",
            dprank::config::MIN_POLL_INTERVAL_MS,
            dprank::config::MIN_POLL_INTERVAL_MS as f64 * args.time_scale / 1000.0,
            fast / ideal99
        );
    }
    let two = ttft99(Variant::TwoEnvoysDprank);
    if two.is_finite() && dprank99.is_finite() {
        let _ = writeln!(
            targets,
            "- two Envoys + dprank TTFT p99 / one Envoy + dprank = {:.0} / {:.0} = {:.2}",
            two,
            dprank99,
            two / dprank99
        );
    }
    println!("{targets}");
    let busy_line = format!(
        "CPU: {} cores, {:.0} % busy on average over the whole command ({:.0} s wall); per-run figures in the table.",
        crate::cpu::cores(),
        busy_total.unwrap_or(f64::NAN) * 100.0,
        elapsed.as_secs_f64()
    );
    println!("{busy_line}");

    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let mut plots = Vec::new();
    let first = |v: Variant| per_variant(v).first().map(|r| &r.report);
    if let (Some(a), Some(b)) = (first(Variant::EnvoyRoundRobin), first(Variant::EnvoyDprank)) {
        let path = args.out.join("compare-rank-tokens.png");
        plot::rank_tokens(
            &path,
            &[(a, "Envoy round robin (a)"), (b, "Envoy + dprank (b)")],
            args.dp_size,
        )?;
        plots.push((
            "Per-rank tokens over time, run 1 of (a) and (b)",
            "compare-rank-tokens.png",
        ));
    }
    let cdf_series: Vec<(String, Vec<f64>)> = variants
        .iter()
        .filter(|v| !per_variant(**v).is_empty())
        .map(|v| {
            (
                v.name().to_string(),
                per_variant(*v)
                    .iter()
                    .flat_map(|r| r.report.ttft_ms.iter().copied())
                    .collect(),
            )
        })
        .collect();
    let path = args.out.join("compare-ttft-cdf.png");
    plot::cdf(
        &path,
        "TTFT CDF (all runs pooled)",
        "TTFT, simulated ms (log scale)",
        &cdf_series,
    )?;
    plots.push((
        "TTFT distribution, every request of every run",
        "compare-ttft-cdf.png",
    ));

    let counters_md = counters_markdown(results.iter().map(|r| (&r.report, r.counters.as_ref())));
    let md = compare_markdown(
        args,
        command_line,
        &trace,
        &variants,
        &skipped,
        &table,
        &targets,
        &busy_line,
        &counters_md,
        &plots,
        poll_wall_ms(args.poll_interval_sim_ms, args.time_scale),
    );
    let md_path = args.out.join("compare.md");
    std::fs::write(&md_path, md).map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;
    println!("wrote {} and {} plot(s)", md_path.display(), plots.len());
    Ok(())
}

/// dprank's poll interval in wall ms for one given in simulated ms; the
/// filter's minimum poll interval is 100 ms (wall).
pub(crate) fn poll_wall_ms(poll_interval_sim_ms: u64, time_scale: f64) -> u64 {
    ((poll_interval_sim_ms as f64 / time_scale).round() as u64).max(dprank::config::MIN_POLL_INTERVAL_MS)
}

/// The variants `--only` names, in `all`'s order (all of them without `--only`).
pub(crate) fn select_variants<V: Copy>(
    all: &[V],
    only: &[String],
    name: fn(V) -> &'static str,
) -> Result<Vec<V>, String> {
    let variants: Vec<V> = if only.is_empty() {
        all.to_vec()
    } else {
        all.iter()
            .copied()
            .filter(|v| only.iter().any(|o| o == name(*v)))
            .collect()
    };
    if variants.is_empty() {
        return Err(format!(
            "--only matches no variant; names: {}",
            all.iter().map(|v| name(*v)).collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(variants)
}

/// What a run prints after its summary line: dprank's counters and errors.
pub(crate) fn print_run_details(counters: Option<&DprankCounters>, report: &LoadReport) {
    if let Some(c) = counters {
        println!("    dprank: {}", c.summary());
    }
    for e in &report.error_examples {
        println!("    error: {e}");
    }
}

pub(crate) fn print_skipped(name: &str) {
    println!("  {name}: skipped, smg is not installed (DPRANK_WITH_SMG=1 ./scripts/setup.sh installs it)");
}

/// Table columns after the variant's name: latencies and throughput.
pub(crate) const LATENCY_HEADER: [&str; 6] = [
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "E2E p99 ms",
    "req/s",
];

/// The cells under [`LATENCY_HEADER`] for the runs of one variant.
pub(crate) fn latency_cells(reports: &[&LoadReport]) -> Vec<String> {
    let metric = |f: &dyn Fn(&LoadReport) -> f64| -> Vec<f64> { reports.iter().map(|r| f(r)).collect() };
    vec![
        fmt_spread(&metric(&|r| r.ttft_p(50.0)), 0),
        fmt_spread(&metric(&|r| r.ttft_p(99.0)), 0),
        fmt_spread(&metric(&|r| r.itl_p(50.0)), 1),
        fmt_spread(&metric(&|r| r.itl_p(99.0)), 1),
        fmt_spread(&metric(&|r| r.e2e_p(99.0)), 0),
        fmt_spread(&metric(&|r| r.throughput_rps), 2),
    ]
}

/// The last two cells of a variant's row: errors and CPU busy.
pub(crate) fn errors_and_busy_cells(reports: &[&LoadReport], busy: &[Option<f64>]) -> [String; 2] {
    let errors: Vec<f64> = reports.iter().map(|r| r.errors as f64).collect();
    let busy: Vec<f64> = busy.iter().filter_map(|b| b.map(|b| b * 100.0)).collect();
    [fmt_spread(&errors, 0), fmt_spread(&busy, 0) + " %"]
}

/// One markdown line per run with dprank's counters.
pub(crate) fn counters_markdown<'a>(
    runs: impl Iterator<Item = (&'a LoadReport, Option<&'a DprankCounters>)>,
) -> String {
    let mut md = String::new();
    for (report, counters) in runs {
        if let Some(c) = counters {
            let _ = writeln!(md, "- `{}`: {}", report.label, c.summary());
        }
    }
    md
}

/// The markdown paragraphs on skipped variants and dprank's counters.
pub(crate) fn skipped_and_counters_markdown(md: &mut String, skipped: &[&str], counters: &str) {
    if !skipped.is_empty() {
        let _ = writeln!(md, "Skipped (smg not installed): {}\n", skipped.join(", "));
    }
    if !counters.is_empty() {
        let _ = writeln!(
            md,
            "### dprank's counters per run (Envoy admin /stats)\n\n{counters}"
        );
    }
}

/// Mean prompt and output tokens of a trace.
pub(crate) fn mean_tokens(trace: &[TraceRequest]) -> (f64, f64) {
    let n = trace.len().max(1) as f64;
    let mean_in = trace.iter().map(|r| f64::from(r.input_tokens)).sum::<f64>() / n;
    let mean_out = trace.iter().map(|r| f64::from(r.output_tokens)).sum::<f64>() / n;
    (mean_in, mean_out)
}

#[allow(clippy::too_many_arguments)]
fn compare_markdown(
    args: &CompareArgs,
    command_line: &str,
    trace: &[TraceRequest],
    variants: &[Variant],
    skipped: &[Variant],
    table: &str,
    targets: &str,
    busy_line: &str,
    counters: &str,
    plots: &[(&str, &str)],
    poll_ms: u64,
) -> String {
    let t = &args.trace;
    let mut md = report_header(
        "dprank compare: Envoy round robin vs dprank vs smg vs ideal",
        command_line,
    );
    let _ = writeln!(md, "## Result\n\nEach cell: median over {} run(s), (min–max) across runs. Latencies are in **simulated** milliseconds (wall time x {}), throughput in requests per simulated second; the rank token imbalance is the time average, while arrivals last, of max/mean tokens over all {} ranks (samples of `/v1/loads` `num_total_tokens` every 100 ms wall; samples with mean < 1 token skipped). Errors: non-2xx, transport errors and streams without `[DONE]`.\n", args.runs, args.time_scale, args.workers * args.dp_size);
    md.push_str(table);
    let _ = writeln!(
        md,
        "\n### Targets (measured ratios of medians)\n\n{targets}\n{busy_line}\n"
    );
    let skipped: Vec<&str> = skipped.iter().map(|v| v.name()).collect();
    skipped_and_counters_markdown(&mut md, &skipped, counters);
    for (title, file) in plots {
        let _ = writeln!(md, "### {title}\n\n![{title}]({file})\n");
    }
    let _ = writeln!(md, "## Variants\n");
    for v in variants {
        let _ = writeln!(md, "- `{}`: {}", v.name(), v.describe());
    }
    let (mean_in, mean_out) = mean_tokens(trace);
    let mut inputs: Vec<f64> = trace.iter().map(|r| f64::from(r.input_tokens)).collect();
    inputs.sort_by(|a, b| a.total_cmp(b));
    let _ = writeln!(
        md,
        "\n## Set-up\n\n- Fleet: {} simulated workers (`dprank-sim`) x {} ranks, `--time-scale {}` and model flags `{}`; a fresh fleet for every run of every variant.\n- Trace (the same for every variant and run): seed {}, Poisson arrivals at {} req per simulated s for {} simulated s ({} requests); prompt tokens lognormal(median {}, sigma {}) clamped to [4, {}] (trace mean {:.0}, p99 {:.0}); output tokens lognormal(median {}, sigma {}) clamped to [1, {}] (trace mean {:.0}). Requests: `POST /generate`, `\"stream\": true`, prompt text at 4 bytes per token, `sampling_params.max_new_tokens` = output tokens, `ignore_eos`.\n- Why these lengths: ShareGPT as reported in the vLLM paper (Kwon et al., SOSP 2023: mean input 161, mean output 338 tokens) and later serving papers, with a long right tail of prompts; the raw data set cannot be fetched here, so these are lognormals of the same order of mean with a heavy tail, not a fit.\n- Why this model: with the simulator's default rank (200k KV tokens, 64 sequences) the fleet only queues at several thousand streamed tokens per wall second per rank, which two cores shared by the load generator, the proxy and the simulator cannot carry. A rank with 10k KV tokens and 32 sequences fills at a load the machine can drive, and a full rank queues, so token imbalance shows up in TTFT as on a real fleet.\n- Time scale and the poll interval: the simulator runs {}x faster than wall time, so dprank's 1 s poll interval (simulated) becomes {} ms of wall time (`poll_interval_ms` in the rendered config), keeping the poll as fresh relative to the traffic as on a real fleet. smg's `--load-monitor-interval` takes whole seconds (minimum 1), i.e. {} simulated seconds here; in regular mode smg does not use the loads at all (docs/protocol.md), so this does not change its routing.\n- Envoy: envoy/dprank.yaml rendered with the fleet's ports; (a) and (d) drop the wasm filter, (d) also swaps the fallback policy to least_request. Envoy runs with its default worker threads (one per core).\n- Ideal (d): each worker's own dispatcher sees its ranks' exact token counts at the instant of arrival; the choice between the two workers is least_request, so it is a near-ideal approximation of a global exact balancer, not a true one.\n- CPU: the load generator, the simulator and the proxies share the machine's cores; see the CPU column.",
        args.workers, args.dp_size, args.time_scale, args.sim_args, t.seed, t.rate, t.duration, trace.len(), t.input_median, t.input_sigma, t.input_max, mean_in, crate::loadgen::percentile(&inputs, 99.0), t.output_median, t.output_sigma, t.output_max, mean_out, args.time_scale, poll_ms, args.time_scale
    );
    md
}
