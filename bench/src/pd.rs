//! `dprank-bench pd`: one trace through a prefill/decode (PD) disaggregated
//! fleet, routed by Envoy + dprank in PD mode, by the old rule (prefill rank
//! = `bootstrap_room % dp_size`, decode rank by the decode worker's own
//! balancer) and by smg's minimum-tokens scheduler at two poll intervals.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;

use crate::client::{get_text, pooled_client, PooledClient};
use crate::compare::{self, DEFAULT_MODEL};
use crate::cpu::CpuTimes;
use crate::envoy::{render_pd, EnvoyPorts, PdWorker};
use crate::fleet::{
    dprank_counters, launch_envoy, read_template, smg_front, smg_launch_args, DprankCounters, Front,
    SimFleet, Tools,
};
use crate::loadgen::{run_trace, sample_imbalance, LoadOptions, LoadReport};
use crate::procs::free_port;
use crate::stats::{fmt_spread, markdown_table, median, report_header};
use crate::trace::TraceRequest;
use crate::TraceArgs;

#[derive(Debug, Clone, Args)]
pub struct PdArgs {
    /// Simulated prefill workers.
    #[arg(long, default_value_t = 2)]
    pub prefill_workers: usize,
    /// Simulated decode workers.
    #[arg(long, default_value_t = 2)]
    pub decode_workers: usize,
    /// Ranks per worker (prefill and decode alike).
    #[arg(long, default_value_t = 4)]
    pub dp_size: usize,
    /// Simulated time runs this many times faster than wall time.
    #[arg(long, default_value_t = 4.0)]
    pub time_scale: f64,
    /// dprank's poll interval in simulated ms (the wall interval is this / time scale).
    #[arg(long, default_value_t = 1000)]
    pub poll_interval_sim_ms: u64,
    /// Repetitions of every variant; figures are the median with min–max.
    #[arg(long, default_value_t = 2)]
    pub runs: usize,
    /// Model flags for every simulated worker (see dprank-sim --help).
    #[arg(long, default_value = DEFAULT_MODEL, allow_hyphen_values = true)]
    pub sim_args: String,
    /// Only these variants (comma-separated names); default all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Where pd.md goes.
    #[arg(long, default_value = "bench-results")]
    pub out: PathBuf,
    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    EnvoyDprank,
    OldRule,
    SmgMinimumTokens,
    SmgMinimumTokensFast,
}

impl Variant {
    const ALL: [Variant; 4] = [
        Variant::EnvoyDprank,
        Variant::OldRule,
        Variant::SmgMinimumTokens,
        Variant::SmgMinimumTokensFast,
    ];

    fn name(self) -> &'static str {
        match self {
            Variant::EnvoyDprank => "envoy-dprank-pd",
            Variant::OldRule => "old-rule",
            Variant::SmgMinimumTokens => "smg-min-tokens",
            Variant::SmgMinimumTokensFast => "smg-min-tokens-1s",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Variant::EnvoyDprank => "Envoy + dprank in PD mode: envoy/pd.yaml rendered with the fleet's ports and workers; dprank picks the prefill (worker, rank) and the decode (worker, rank) from polled loads and injects both ranks",
            Variant::OldRule => "the old rule in its production form: `smg launch --pd-disaggregation --policy round_robin` without `--dp-minimum-tokens-scheduler`, so no rank is injected; the prefill server picks `bootstrap_room % dp_size` (`dprank-sim --dispatch room_modulo`), the decode server its own round robin",
            Variant::SmgMinimumTokens => "`smg launch --pd-disaggregation --policy round_robin --dp-minimum-tokens-scheduler` at the default `--load-monitor-interval` (10 s wall, i.e. 40 s simulated at time scale 4)",
            Variant::SmgMinimumTokensFast => "the same with `--load-monitor-interval 1` (smg's minimum: 1 s wall, 4 s simulated)",
        }
    }

    fn smg(self) -> Option<SmgPd> {
        match self {
            Variant::EnvoyDprank => None,
            Variant::OldRule => Some(SmgPd {
                minimum_tokens: false,
                interval_s: None,
            }),
            Variant::SmgMinimumTokens => Some(SmgPd {
                minimum_tokens: true,
                interval_s: None,
            }),
            Variant::SmgMinimumTokensFast => Some(SmgPd {
                minimum_tokens: true,
                interval_s: Some(1),
            }),
        }
    }
}

/// smg flags of one PD variant.
#[derive(Debug, Clone, Copy)]
struct SmgPd {
    minimum_tokens: bool,
    /// `--load-monitor-interval`; None keeps smg's default.
    interval_s: Option<u32>,
}

struct RunResult {
    variant: Variant,
    report: LoadReport,
    /// Prefill requests served per rank during the trace: max / mean.
    prefill_spread: Option<f64>,
    /// Rank token imbalance over the decode ranks.
    decode_imbalance: Option<f64>,
    busy: Option<f64>,
    counters: Option<DprankCounters>,
}

fn sim_args(count: usize, args: &PdArgs, role: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..count {
        out.extend(["--listen".to_string(), "127.0.0.1:0".to_string()]);
        if role.first() == Some(&"prefill") {
            // Port 0: the simulator reports the bound port in its ready line.
            out.extend(["--bootstrap-port".to_string(), "0".to_string()]);
        }
    }
    out.extend([
        "--dp-size".into(),
        args.dp_size.to_string(),
        "--time-scale".into(),
        args.time_scale.to_string(),
        "--role".into(),
    ]);
    out.extend(role.iter().map(|s| s.to_string()));
    out.extend(args.sim_args.split_whitespace().map(str::to_string));
    out
}

fn poll_wall_ms(args: &PdArgs) -> u64 {
    compare::poll_wall_ms(args.poll_interval_sim_ms, args.time_scale)
}

async fn start_envoy_pd(
    tools: &Tools,
    client: &PooledClient,
    prefill: &SimFleet,
    decode: &SimFleet,
    poll_interval_ms: u64,
    name: &str,
) -> Result<Front, String> {
    let template = read_template(tools, "envoy/pd.yaml")?;
    let ports = EnvoyPorts {
        listener: free_port()?,
        admin: free_port()?,
    };
    let prefill_workers: Vec<PdWorker> = prefill
        .workers
        .iter()
        .zip(&prefill.bootstrap)
        .map(|(addr, bootstrap_port)| PdWorker {
            addr: *addr,
            bootstrap_port: *bootstrap_port,
        })
        .collect();
    let yaml = render_pd(
        &template,
        &ports,
        &prefill_workers,
        &decode.workers,
        poll_interval_ms,
        &tools.wasm,
    )?;
    launch_envoy(tools, client, &yaml, &ports, &[prefill, decode], name).await
}

async fn start_smg_pd(
    tools: &Tools,
    client: &PooledClient,
    prefill: &SimFleet,
    decode: &SimFleet,
    mode: SmgPd,
    name: &str,
) -> Result<Option<Front>, String> {
    let Some(smg) = &tools.smg else {
        return Ok(None);
    };
    let (port, mut args) = smg_launch_args()?;
    args.push("--pd-disaggregation".into());
    for (addr, bootstrap) in prefill.workers.iter().zip(&prefill.bootstrap) {
        args.extend(["--prefill".into(), format!("http://{addr}")]);
        args.push(bootstrap.map_or("none".to_string(), |p| p.to_string()));
    }
    for addr in &decode.workers {
        args.extend(["--decode".into(), format!("http://{addr}")]);
    }
    // Never --dp-aware: with it smg does not poll the loads in PD mode.
    if mode.minimum_tokens {
        args.push("--dp-minimum-tokens-scheduler".into());
    }
    if let Some(interval) = mode.interval_s {
        args.extend(["--load-monitor-interval".into(), interval.to_string()]);
    }
    smg_front(tools, client, smg, &args, port, name).await.map(Some)
}

/// Requests each rank of `fleet` has accepted so far (`/_sim/counters`).
async fn served_per_rank(client: &PooledClient, fleet: &SimFleet) -> Vec<u64> {
    let mut out = Vec::new();
    for w in &fleet.workers {
        let served: Vec<u64> = get_text(client, &format!("http://{w}/_sim/counters"))
            .await
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| {
                v.get("served_per_rank")
                    .and_then(|a| a.as_array())
                    .map(|a| a.iter().map(|n| n.as_u64().unwrap_or(0)).collect())
            })
            .unwrap_or_default();
        out.extend(served);
    }
    out
}

/// Max / mean of the per-rank differences `after - before`.
fn served_spread(before: &[u64], after: &[u64]) -> Option<f64> {
    if before.len() != after.len() || after.is_empty() {
        return None;
    }
    let counts: Vec<f64> = after
        .iter()
        .zip(before)
        .map(|(a, b)| a.saturating_sub(*b) as f64)
        .collect();
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let max = counts.iter().copied().fold(0.0, f64::max);
    (mean > 0.0).then(|| max / mean)
}

/// Time average, while arrivals last, of max/mean tokens over the ranks
/// `range` of each load sample.
fn group_imbalance(report: &LoadReport, range: std::ops::Range<usize>) -> Option<f64> {
    let ratios: Vec<f64> = report
        .samples
        .iter()
        .filter(|s| s.t_s <= report.arrival_window_s)
        .filter_map(|s| s.tokens.get(range.clone()).and_then(sample_imbalance))
        .collect();
    (!ratios.is_empty()).then(|| ratios.iter().sum::<f64>() / ratios.len() as f64)
}

async fn run_variant(
    tools: &Tools,
    args: &PdArgs,
    variant: Variant,
    trace: &[TraceRequest],
    run: usize,
) -> Result<Option<RunResult>, String> {
    let client = pooled_client();
    let name = |what: &str| format!("pd-{}-{run}{what}", variant.name());
    let prefill = SimFleet::spawn(
        tools,
        &sim_args(
            args.prefill_workers,
            args,
            &["prefill", "--dispatch", "room_modulo"],
        ),
        args.prefill_workers,
        &name("-prefill"),
    )?;
    let decode = SimFleet::spawn(
        tools,
        &sim_args(args.decode_workers, args, &["decode"]),
        args.decode_workers,
        &name("-decode"),
    )?;
    let front = match variant.smg() {
        None => start_envoy_pd(tools, &client, &prefill, &decode, poll_wall_ms(args), &name("")).await?,
        Some(mode) => match start_smg_pd(tools, &client, &prefill, &decode, mode, &name("")).await? {
            Some(front) => front,
            None => return Ok(None),
        },
    };
    let mut workers: Vec<SocketAddr> = prefill.workers.clone();
    workers.extend(decode.workers.iter().copied());
    let options = LoadOptions {
        targets: vec![front.url.clone()],
        path: "/generate".into(),
        workers,
        time_scale: args.time_scale,
        sample_every: Duration::from_millis(100),
        request_timeout: Duration::from_secs(120),
        progress: true,
        label: format!("{} run {}", variant.name(), run + 1),
    };
    let served_before = served_per_rank(&client, &prefill).await;
    let before = CpuTimes::now();
    let report = run_trace(trace, &options).await?;
    let served_after = served_per_rank(&client, &prefill).await;
    let busy = CpuTimes::now().busy_since(&before);
    let counters = match front.admin {
        Some(admin) => dprank_counters(&client, admin).await,
        None => None,
    };
    drop(front);
    drop(prefill);
    drop(decode);
    let prefill_ranks = args.prefill_workers * args.dp_size;
    let all_ranks = prefill_ranks + args.decode_workers * args.dp_size;
    Ok(Some(RunResult {
        variant,
        prefill_spread: served_spread(&served_before, &served_after),
        decode_imbalance: group_imbalance(&report, prefill_ranks..all_ranks),
        report,
        busy,
        counters,
    }))
}

pub async fn pd(tools: &Tools, args: &PdArgs, command_line: &str) -> Result<(), String> {
    let started = Instant::now();
    let trace = args.trace.spec().generate()?;
    let variants = compare::select_variants(&Variant::ALL, &args.only, Variant::name)?;
    println!(
        "pd: {} requests over {:.0} simulated s ({:.1} req/s); {} prefill x {} and {} decode x {} ranks, time scale {}; {} run(s) of {} variant(s)",
        trace.len(), args.trace.duration, args.trace.rate, args.prefill_workers, args.dp_size, args.decode_workers, args.dp_size, args.time_scale, args.runs, variants.len()
    );
    let cpu_start = CpuTimes::now();
    let mut results: Vec<RunResult> = Vec::new();
    let mut skipped: Vec<Variant> = Vec::new();
    for run in 0..args.runs {
        for &variant in &variants {
            if skipped.contains(&variant) {
                continue;
            }
            match run_variant(tools, args, variant, &trace, run).await? {
                Some(result) => {
                    println!(
                        "  {} | prefill requests per rank max/mean {} | decode imbalance {}",
                        result.report.summary(),
                        result.prefill_spread.map_or("n/a".into(), |v| format!("{v:.3}")),
                        result
                            .decode_imbalance
                            .map_or("n/a".into(), |v| format!("{v:.3}")),
                    );
                    compare::print_run_details(result.counters.as_ref(), &result.report);
                    results.push(result);
                }
                None => {
                    compare::print_skipped(variant.name());
                    skipped.push(variant);
                }
            }
        }
    }
    let busy_total = CpuTimes::now().busy_since(&cpu_start);
    let elapsed = started.elapsed();

    let per_variant = |v: Variant| -> Vec<&RunResult> { results.iter().filter(|r| r.variant == v).collect() };
    let metric = |v: Variant, f: &dyn Fn(&RunResult) -> f64| -> Vec<f64> {
        per_variant(v).iter().map(|r| f(r)).collect()
    };
    let mut header = vec!["variant"];
    header.extend(compare::LATENCY_HEADER);
    header.extend([
        "prefill reqs/rank max/mean",
        "decode rank imbalance",
        "errors",
        "CPU busy",
    ]);
    let mut rows = Vec::new();
    for &v in &variants {
        let runs = per_variant(v);
        if runs.is_empty() {
            continue;
        }
        let reports: Vec<&LoadReport> = runs.iter().map(|r| &r.report).collect();
        let busy: Vec<Option<f64>> = runs.iter().map(|r| r.busy).collect();
        let mut row = vec![v.name().to_string()];
        row.extend(compare::latency_cells(&reports));
        row.push(fmt_spread(
            &metric(v, &|r| r.prefill_spread.unwrap_or(f64::NAN)),
            3,
        ));
        row.push(fmt_spread(
            &metric(v, &|r| r.decode_imbalance.unwrap_or(f64::NAN)),
            3,
        ));
        row.extend(compare::errors_and_busy_cells(&reports, &busy));
        rows.push(row);
    }
    let table = markdown_table(&header, &rows);
    println!("\n{table}");

    let ttft99 = |v: Variant| median(&metric(v, &|r| r.report.ttft_p(99.0)));
    let dprank99 = ttft99(Variant::EnvoyDprank);
    let mut ratios = String::new();
    for other in [
        Variant::OldRule,
        Variant::SmgMinimumTokens,
        Variant::SmgMinimumTokensFast,
    ] {
        let o = ttft99(other);
        if o.is_finite() && dprank99.is_finite() {
            let _ = writeln!(
                ratios,
                "- dprank TTFT p99 / {} TTFT p99 = {dprank99:.0} / {o:.0} = **{:.2}**",
                other.name(),
                dprank99 / o
            );
        } else {
            let _ = writeln!(ratios, "- dprank TTFT p99 / {}: not measured", other.name());
        }
    }
    println!("{ratios}");
    let busy_line = format!(
        "CPU: {} cores, {:.0} % busy on average over the whole command ({:.0} s wall); per-run figures in the table. The CPU figures include any other work on the machine; all variants ran in turn under the same conditions.",
        crate::cpu::cores(),
        busy_total.unwrap_or(f64::NAN) * 100.0,
        elapsed.as_secs_f64()
    );
    println!("{busy_line}");

    let counters_md = compare::counters_markdown(results.iter().map(|r| (&r.report, r.counters.as_ref())));
    let md = pd_markdown(
        args,
        command_line,
        &trace,
        &variants,
        &skipped,
        &table,
        &ratios,
        &busy_line,
        &counters_md,
    );
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let md_path = args.out.join("pd.md");
    std::fs::write(&md_path, md).map_err(|e| format!("cannot write {}: {e}", md_path.display()))?;
    println!("wrote {}", md_path.display());
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn pd_markdown(
    args: &PdArgs,
    command_line: &str,
    trace: &[TraceRequest],
    variants: &[Variant],
    skipped: &[Variant],
    table: &str,
    ratios: &str,
    busy_line: &str,
    counters: &str,
) -> String {
    let t = &args.trace;
    let mut md = report_header(
        "dprank pd: prefill/decode disaggregation, dprank vs the old rule vs smg",
        command_line,
    );
    let _ = writeln!(md, "## Result\n\nEach cell: median over {} run(s), (min–max) across runs. Latencies in **simulated** ms (wall x {}), throughput in requests per simulated second. Prefill reqs/rank max/mean: requests each of the {} prefill ranks accepted during the trace (`/_sim/counters` `served_per_rank`, after minus before), max over mean (a prefill rank holds tokens only while a prompt waits or is prefilled, so a token imbalance over prefill ranks is mostly one busy rank among idle ones and says little). Decode rank imbalance: time average, while arrivals last, of max/mean `/v1/loads` tokens over the {} decode ranks (samples every 100 ms wall; samples with mean < 1 token skipped). Errors: non-2xx, transport errors and streams without `[DONE]`.\n", args.runs, args.time_scale, args.prefill_workers * args.dp_size, args.decode_workers * args.dp_size);
    md.push_str(table);
    let _ = writeln!(md, "\n### TTFT p99 ratios (medians)\n\n{ratios}\n{busy_line}\n");
    let skipped: Vec<&str> = skipped.iter().map(|v| v.name()).collect();
    compare::skipped_and_counters_markdown(&mut md, &skipped, counters);
    let _ = writeln!(md, "## Variants\n");
    for v in variants {
        let _ = writeln!(md, "- `{}`: {}", v.name(), v.describe());
    }
    let (mean_in, mean_out) = compare::mean_tokens(trace);
    let _ = writeln!(
        md,
        "\n## Set-up\n\n- Fleet: {} prefill workers (`dprank-sim --role prefill --dispatch room_modulo`, one bootstrap listener each) and {} decode workers (`--role decode`, default round-robin dispatch), {} ranks each, `--time-scale {}`, model flags `{}`; fresh processes for every run of every variant. Every variant starts the prefill sims with `--dispatch room_modulo`: a request that reaches a prefill server without a rank gets `bootstrap_room % dp_size`, as SGLang does; dprank and smg's minimum-tokens scheduler inject ranks, so it only matters for the old rule (and for dprank's no-data fallback).\n- Trace (the same for every variant and run): seed {}, Poisson arrivals at {} req per simulated s for {} simulated s ({} requests), prompt lognormal(median {}, sigma {}) max {} (mean {:.0}), output lognormal(median {}, sigma {}) max {} (mean {:.0}); `POST /generate`, streamed, as `dprank-bench compare`.\n- dprank: envoy/pd.yaml with only the ports, the worker lists (prefill with their bootstrap ports), the `sglang_decode` endpoints, the wasm path and `poll_interval_ms` = {} ms wall ({} ms simulated / time scale) changed.\n- smg: `smg launch --host 127.0.0.1 --port P --prometheus-host 127.0.0.1 --prometheus-port M --policy round_robin --pd-disaggregation --prefill URL BOOTSTRAP_PORT ... --decode URL ...`, plus the variant's flags; never `--dp-aware` (with it smg does not poll the loads in PD mode, sim/README.md). Its `--load-monitor-interval` is in whole wall seconds, so the default 10 s is 40 simulated s here and the 1 s minimum is 4 simulated s.",
        args.prefill_workers, args.decode_workers, args.dp_size, args.time_scale, args.sim_args, t.seed, t.rate, t.duration, trace.len(), t.input_median, t.input_sigma, t.input_max, mean_in, t.output_median, t.output_sigma, t.output_max, mean_out, poll_wall_ms(args), args.poll_interval_sim_ms
    );
    md
}
