//! `dprank-bench overhead`: what a router adds in front of a worker that
//! answers at once (`dprank-sim --instant`), each variant against the floor
//! it cannot go below, measured in the same run: dprank's header mode
//! against a no-op wasm filter that passes the body through, its body mode
//! against a no-op filter that buffers the body and reads it once (both
//! `bench/noop-filter`, same SDK, same Envoy settings), the no-op filters
//! against plain Envoy, and smg at its default policy beside them.
//! Closed-loop clients on dedicated keep-alive connections; cells
//! interleaved within each run, the variants' order rotated from run to run.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;

use crate::client::{pooled_client, Connection};
use crate::cpu::{pin_threads, process_cpu_seconds, CpuTimes};
use crate::envoy::{Balancer, DprankSettings, NoopMode};
use crate::fleet::{smg_front, smg_launch_args, start_envoy, Front, SimFleet, SimOptions, Tools};
use crate::report::{fmt_spread, markdown_table, report_header};
use crate::stats::{bootstrap_median_interval, median, paired_ratio, percentile, BOOTSTRAP_RESAMPLES};
use crate::workload::bodies;

#[derive(Debug, Clone, Args)]
pub struct OverheadArgs {
    /// Measured seconds per (variant, cell) and run.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Interleaved runs; intervals are over runs.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Tokens per streamed response (the streamed cell).
    #[arg(long, default_value_t = 64)]
    pub stream_tokens: u32,
    /// Leave every process unpinned (by default the router runs on the last
    /// core, the load generator and the worker on the others).
    #[arg(long)]
    pub no_pin: bool,
    #[arg(long, default_value = "bench-results/cost")]
    pub out: PathBuf,
}

impl OverheadArgs {
    pub fn defaults() -> OverheadArgs {
        OverheadArgs {
            seconds: 2.0,
            runs: 3,
            stream_tokens: 64,
            no_pin: false,
            out: PathBuf::from("bench-results/cost"),
        }
    }
}

const PLAIN: &str = "envoy";
const NOOP_PASS: &str = "envoy + no-op filter (pass)";
const NOOP_BUFFER: &str = "envoy + no-op filter (buffer)";
const NOOP_ROUTE_HEADER: &str = "envoy + no-op router (header)";
const NOOP_ROUTE_BODY: &str = "envoy + no-op router (body)";
const DPRANK_HEADER: &str = "envoy + dprank, header mode";
const DPRANK_BODY: &str = "envoy + dprank, body mode";
const DPRANK_HEADER_UNTIMED: &str = "envoy + dprank, header mode, delivery_timing off";
const DPRANK_HEADER_ADMISSION: &str = "envoy + dprank, header mode, admission";
const DPRANK_HEADER_SLO: &str = "envoy + dprank, header mode, admission by SLO";
const SMG: &str = "smg (default policy, --dp-aware)";
const DIRECT: &str = "direct";

/// What each variant is compared with, first the floor it cannot go below
/// (the targets are against it); dprank also against the no-op
/// router of its mode, which pays Envoy's routing mechanics without a choice.
fn compared_with(name: &str) -> &'static [&'static str] {
    match name {
        DPRANK_HEADER => &[NOOP_PASS, NOOP_ROUTE_HEADER, DPRANK_HEADER_UNTIMED],
        DPRANK_HEADER_UNTIMED => &[NOOP_PASS],
        DPRANK_HEADER_ADMISSION => &[NOOP_PASS, DPRANK_HEADER],
        DPRANK_HEADER_SLO => &[NOOP_PASS, DPRANK_HEADER_ADMISSION],
        DPRANK_BODY => &[NOOP_BUFFER, NOOP_ROUTE_BODY],
        NOOP_ROUTE_HEADER => &[NOOP_PASS],
        NOOP_ROUTE_BODY => &[NOOP_BUFFER],
        NOOP_PASS | NOOP_BUFFER | SMG => &[PLAIN],
        PLAIN => &[DIRECT],
        _ => &[],
    }
}

/// The workload of one cell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Shape {
    /// Non-streamed `/generate` of about `bytes` bytes, one output token.
    Plain { connections: usize, bytes: usize },
    /// Streamed `/generate` (1 KB prompt, `tokens` chunks), one connection.
    Streamed { tokens: u32 },
}

impl Shape {
    pub(crate) fn label(&self) -> String {
        match self {
            Shape::Plain { connections, bytes } => format!("{connections} conn, {} KB", bytes / 1024),
            Shape::Streamed { tokens } => format!("1 conn, streamed {tokens} chunks"),
        }
    }

    fn connections(&self) -> usize {
        match self {
            Shape::Plain { connections, .. } => *connections,
            Shape::Streamed { .. } => 1,
        }
    }
}

fn shapes(stream_tokens: u32) -> Vec<Shape> {
    let mut out = Vec::new();
    for connections in [1, 16] {
        for bytes in [1024, 16 * 1024, 100 * 1024] {
            out.push(Shape::Plain { connections, bytes });
        }
    }
    out.push(Shape::Streamed {
        tokens: stream_tokens,
    });
    out
}

pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) addr: SocketAddr,
    /// The router's process (None: the worker itself).
    pub(crate) pid: Option<u32>,
}

/// One variant's figures in one cell of one run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    pub(crate) p50_us: f64,
    p99_us: f64,
    rps: f64,
    /// Router CPU per request (streamed: per chunk), from its process's own CPU time.
    pub(crate) cpu_us: f64,
    /// Streamed: median time from the first to the last chunk, per chunk.
    per_chunk_us: f64,
    pub(crate) errors: usize,
}

pub(crate) async fn measure(target: &Target, shape: Shape, seconds: f64) -> Result<Cell, String> {
    let addr = target.addr;
    let body = match shape {
        Shape::Plain { bytes, .. } => bodies::generate_of_size(bytes),
        Shape::Streamed { tokens } => {
            let text = String::from_utf8_lossy(&bodies::generate_of_size(1024)).into_owned();
            let prompt = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v["text"].as_str().map(str::to_string))
                .unwrap_or_default();
            bodies::generate(&prompt, tokens, true)
        }
    };
    let warmup = Duration::from_millis(300);
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + Duration::from_secs_f64(seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..shape.connections() {
        let body = body.clone();
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            let mut per_chunk = Vec::new();
            let mut errors = 0usize;
            let mut connection = Connection::open(addr).await?;
            while Instant::now() < end {
                let sent = Instant::now();
                let outcome = match shape {
                    Shape::Plain { .. } => connection
                        .post("/generate", body.clone())
                        .await
                        .map(|l| (l, None)),
                    Shape::Streamed { tokens } => connection
                        .post_streamed("/generate", body.clone())
                        .await
                        .map(|(first, last)| (last, Some((last - first) / tokens.saturating_sub(1).max(1)))),
                };
                match outcome {
                    Ok((latency, chunk)) if sent >= measure_from => {
                        latencies.push(latency.as_secs_f64() * 1e6);
                        per_chunk.extend(chunk.map(|c| c.as_secs_f64() * 1e6));
                    }
                    Ok(_) => {}
                    Err(_) => {
                        errors += 1;
                        connection = Connection::open(addr).await?;
                    }
                }
            }
            Ok::<_, String>((latencies, per_chunk, errors))
        });
    }
    // The router's CPU over the measured window only.
    tokio::time::sleep_until((measure_from).into()).await;
    let cpu_before = target.pid.and_then(process_cpu_seconds);
    let mut all = Vec::new();
    let mut chunks = Vec::new();
    let mut errors = 0;
    while let Some(done) = tasks.join_next().await {
        let (latencies, per_chunk, e) = done.map_err(|e| format!("client task: {e}"))??;
        all.extend(latencies);
        chunks.extend(per_chunk);
        errors += e;
    }
    let cpu_after = target.pid.and_then(process_cpu_seconds);
    let units = match shape {
        Shape::Plain { .. } => all.len() as f64,
        Shape::Streamed { tokens } => all.len() as f64 * f64::from(tokens),
    };
    let cpu_us = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) if units > 0.0 => (a - b) * 1e6 / units,
        _ => f64::NAN,
    };
    Ok(Cell {
        p50_us: percentile(&all, 50.0),
        p99_us: percentile(&all, 99.0),
        rps: all.len() as f64 / seconds,
        cpu_us,
        per_chunk_us: if chunks.is_empty() {
            f64::NAN
        } else {
            median(&chunks)
        },
        errors,
    })
}

/// `median [lo, hi]` of per-run values (95% bootstrap interval over runs).
pub(crate) fn with_interval(values: &[f64], decimals: usize) -> String {
    let values: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if values.is_empty() {
        return "-".into();
    }
    let m = median(&values);
    if values.len() < 2 {
        return format!("{m:+.decimals$}");
    }
    let (lo, hi) = bootstrap_median_interval(&values, 0.95, BOOTSTRAP_RESAMPLES, 0x0e7e);
    format!("{m:+.decimals$} [{lo:+.decimals$}, {hi:+.decimals$}]")
}

/// The instant worker both overhead benchmarks put behind every router:
/// one `dprank-sim --instant` with 4 ranks.
pub(crate) fn instant_worker(tools: &Tools, label: &str) -> Result<SimFleet, String> {
    let sim = SimOptions {
        workers: 1,
        dp_size: 4,
        time_scale: 1.0,
        dispatch: "round_robin",
        instant: true,
        extra: Vec::new(),
    };
    SimFleet::start(tools, &sim, label)
}

/// dprank in header mode (default rank headers), polling every second.
pub(crate) fn header_mode() -> DprankSettings {
    DprankSettings {
        poll_interval_ms: 1000,
        set: serde_json::json!({"rank_transport": "header"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        ..DprankSettings::default()
    }
}

/// Header mode without timing each streamed answer (`delivery_timing`):
/// what the timing costs, paired within a run.
fn untimed_header_mode() -> DprankSettings {
    let mut settings = header_mode();
    settings
        .set
        .insert("delivery_timing".into(), serde_json::Value::Bool(false));
    settings
}

/// Header mode with admission (`reject`), its wait limit out of reach, or
/// with `slo` targets out of reach (nothing refused, nothing learned to
/// refuse by): what judging each request costs, and what SLO admission's
/// observations add to it, paired within a run.
fn admission_header_mode(block: serde_json::Value) -> DprankSettings {
    let mut settings = header_mode();
    settings.set.insert("admission".into(), block);
    settings
}

/// Routers on the last core; this process (the load generator) and the
/// worker on the others. False if some process could not be pinned.
pub(crate) fn pin_routers(fleet: &SimFleet, fronts: &[(&str, Front)], cores: usize) -> bool {
    let router_cpu = [cores - 1];
    let rest: Vec<usize> = (0..cores - 1).collect();
    let mut all = pin_threads(0, &rest) && pin_threads(fleet.pid(), &rest);
    for (_, front) in fronts {
        all &= pin_threads(front.pid(), &router_cpu);
    }
    all
}

pub async fn overhead(tools: &Tools, args: &OverheadArgs, command_line: &str) -> Result<(), String> {
    let client = pooled_client();
    let cores = crate::cpu::cores();
    let fleet = instant_worker(tools, "overhead-sim")?;
    let worker = *fleet.workers.first().ok_or("no worker")?;
    let mut fronts: Vec<(&'static str, Front)> = Vec::new();
    for (name, balancer) in [
        (PLAIN, Balancer::RoundRobin),
        (NOOP_PASS, Balancer::Noop(NoopMode::Pass)),
        (NOOP_BUFFER, Balancer::Noop(NoopMode::Buffer)),
        (NOOP_ROUTE_HEADER, Balancer::Noop(NoopMode::RouteHeader)),
        (NOOP_ROUTE_BODY, Balancer::Noop(NoopMode::RouteBody)),
        (DPRANK_HEADER, Balancer::Dprank(header_mode())),
        (DPRANK_BODY, Balancer::Dprank(DprankSettings::polling_every(1000))),
        (DPRANK_HEADER_UNTIMED, Balancer::Dprank(untimed_header_mode())),
        (
            DPRANK_HEADER_ADMISSION,
            Balancer::Dprank(admission_header_mode(
                serde_json::json!({"when_saturated": "reject", "max_wait_ms": 600_000}),
            )),
        ),
        (
            DPRANK_HEADER_SLO,
            Balancer::Dprank(admission_header_mode(serde_json::json!({
                "when_saturated": "reject",
                "slo": {"ttft_ms": 600_000, "tpot_ms": 60_000}
            }))),
        ),
    ] {
        let label = format!("overhead-{}", name.replace([' ', ',', '+', '(', ')', '-'], "_"));
        fronts.push((
            name,
            start_envoy(tools, &client, &fleet, &balancer, &label, None).await?,
        ));
    }
    match &tools.smg {
        Some(smg) => {
            // smg's own default policy (cache_aware); --dp-aware so that it
            // names a rank, the job the others do.
            let (port, mut args) = smg_launch_args()?;
            args.extend(["--dp-aware".into(), "--worker-urls".into()]);
            args.push(format!("http://{worker}"));
            let front = smg_front(tools, &client, smg, &args, port, "overhead-smg").await?;
            fronts.push((SMG, front));
        }
        None => println!(
            "overhead: smg skipped, not installed (DPRANK_WITH_SMG=1 ./scripts/setup.sh installs it)"
        ),
    }
    let pinned = !args.no_pin && cores >= 2;
    if pinned && !pin_routers(&fleet, &fronts, cores) {
        println!("overhead: could not pin every process; the figures may carry cross-talk");
    }
    let mut targets = vec![Target {
        name: DIRECT,
        addr: worker,
        pid: None,
    }];
    targets.extend(fronts.iter().map(|(name, f)| Target {
        name,
        addr: f.addr,
        pid: Some(f.pid()),
    }));
    let shapes = shapes(args.stream_tokens);

    // results[(target, shape)] = cells, one per run
    let mut results: Vec<Vec<Vec<Cell>>> = vec![vec![Vec::new(); shapes.len()]; targets.len()];
    let cpu_start = CpuTimes::now();
    for run in 0..args.runs {
        for (si, shape) in shapes.iter().enumerate() {
            for k in 0..targets.len() {
                // The order rotates from run to run, so none always goes first.
                let ti = (k + run) % targets.len();
                let target = &targets[ti];
                let cell = measure(target, *shape, args.seconds).await?;
                println!(
                    "  run {} {:>32} {:>26}: p50 {:>7.0} us p99 {:>7.0} us {:>8.0} req/s cpu {:>6.1} us{}{}",
                    run + 1,
                    target.name,
                    shape.label(),
                    cell.p50_us,
                    cell.p99_us,
                    cell.rps,
                    cell.cpu_us,
                    if cell.per_chunk_us.is_finite() {
                        format!(" {:.1} us/chunk", cell.per_chunk_us)
                    } else {
                        String::new()
                    },
                    if cell.errors > 0 {
                        format!(" ({} errors)", cell.errors)
                    } else {
                        String::new()
                    }
                );
                results[ti][si].push(cell);
            }
        }
    }
    let busy = CpuTimes::now().busy_since(&cpu_start);
    drop(fronts);
    drop(fleet);

    let index = |name: &str| targets.iter().position(|t| t.name == name);
    let per_run = |ti: usize, si: usize, f: fn(&Cell) -> f64| -> Vec<(u64, f64)> {
        results[ti][si]
            .iter()
            .enumerate()
            .map(|(run, c)| (run as u64, f(c)))
            .collect()
    };
    // Per-run differences to the floor, paired by run.
    let added = |ti: usize, base: usize, si: usize, f: fn(&Cell) -> f64| -> Vec<f64> {
        results[ti][si]
            .iter()
            .zip(&results[base][si])
            .map(|(a, b)| f(a) - f(b))
            .collect()
    };
    let header = [
        "variant",
        "cell",
        "p50 us",
        "p99 us",
        "req/s",
        "router CPU us per request (streamed: per chunk)",
        "streamed: us per chunk",
        "compared with",
        "added p50 us [95% interval]",
        "req/s vs it [95% interval]",
        "added router CPU us",
        "added us per chunk",
        "errors",
    ];
    let mut rows = Vec::new();
    for (si, shape) in shapes.iter().enumerate() {
        for (ti, target) in targets.iter().enumerate() {
            let bases: Vec<Option<usize>> = match compared_with(target.name) {
                [] => vec![None],
                names => names.iter().map(|n| index(n)).collect(),
            };
            let c = &results[ti][si];
            let col = |f: fn(&Cell) -> f64, d: usize| fmt_spread(&c.iter().map(f).collect::<Vec<_>>(), d);
            let streamed = matches!(shape, Shape::Streamed { .. });
            // One row per comparison: the variant's own figures repeat.
            for base in bases {
                let (against, added_p50, rps_ratio, added_cpu, added_chunk) = match base {
                    None => (
                        "-".to_string(),
                        "-".to_string(),
                        "-".to_string(),
                        "-".to_string(),
                        "-".to_string(),
                    ),
                    Some(b) => (
                        targets[b].name.to_string(),
                        with_interval(&added(ti, b, si, |c| c.p50_us), 0),
                        paired_ratio(&per_run(ti, si, |c| c.rps), &per_run(b, si, |c| c.rps))
                            .map_or("-".into(), |r| r.display()),
                        if targets[b].pid.is_some() {
                            with_interval(&added(ti, b, si, |c| c.cpu_us), 1)
                        } else {
                            "-".into()
                        },
                        if streamed {
                            with_interval(&added(ti, b, si, |c| c.per_chunk_us), 1)
                        } else {
                            "-".into()
                        },
                    ),
                };
                rows.push(vec![
                    target.name.to_string(),
                    shape.label(),
                    col(|c| c.p50_us, 0),
                    col(|c| c.p99_us, 0),
                    col(|c| c.rps, 0),
                    if target.pid.is_some() {
                        col(|c| c.cpu_us, 1)
                    } else {
                        "-".into()
                    },
                    if streamed {
                        col(|c| c.per_chunk_us, 1)
                    } else {
                        "-".into()
                    },
                    against,
                    added_p50,
                    rps_ratio,
                    added_cpu,
                    added_chunk,
                    c.iter().map(|c| c.errors).sum::<usize>().to_string(),
                ]);
            }
        }
    }
    let table = markdown_table(&header, &rows);
    println!("\n{table}");

    // The targets, each against its floor in the same run.
    let mut findings = String::new();
    let cell_of = |connections: usize, bytes: usize| {
        shapes
            .iter()
            .position(|s| *s == Shape::Plain { connections, bytes })
    };
    // `goal_us`: the target against the floor; None: for information.
    let check = |findings: &mut String, name: &str, floor: &str, bytes: usize, goal_us: Option<f64>| {
        let (Some(ti), Some(base), Some(si), Some(si16)) =
            (index(name), index(floor), cell_of(1, bytes), cell_of(16, bytes))
        else {
            return;
        };
        let p50 = added(ti, base, si, |c| c.p50_us);
        let cpu = added(ti, base, si16, |c| c.cpu_us);
        let ratio = paired_ratio(&per_run(ti, si16, |c| c.rps), &per_run(base, si16, |c| c.rps));
        let (p50_goal, rps_goal) = match goal_us {
            Some(us) => (format!(" (target <= {us:.0})"), " (target >= 0.95)"),
            None => (String::new(), ""),
        };
        let _ = writeln!(
            findings,
            "- {name}, {} KB: added p50 over {floor} **{}** us at 1 connection{p50_goal}; req/s at 16 connections **{}** of it{rps_goal}; router CPU per request at 16 connections {} us more",
            bytes / 1024,
            with_interval(&p50, 0),
            ratio.map_or("-".into(), |r| r.display()),
            with_interval(&cpu, 1),
        );
    };
    check(&mut findings, DPRANK_HEADER, NOOP_PASS, 1024, Some(10.0));
    check(&mut findings, DPRANK_BODY, NOOP_BUFFER, 1024, Some(10.0));
    check(&mut findings, DPRANK_BODY, NOOP_BUFFER, 100 * 1024, Some(30.0));
    let _ = writeln!(
        findings,
        "\nThe same, against the no-op router of each mode (Envoy's routing mechanics paid, no choice made): what dprank's own work costs.\n"
    );
    check(&mut findings, NOOP_ROUTE_HEADER, NOOP_PASS, 1024, None);
    check(&mut findings, DPRANK_HEADER, NOOP_ROUTE_HEADER, 1024, None);
    check(&mut findings, NOOP_ROUTE_BODY, NOOP_BUFFER, 1024, None);
    check(&mut findings, DPRANK_BODY, NOOP_ROUTE_BODY, 1024, None);
    check(&mut findings, DPRANK_BODY, NOOP_ROUTE_BODY, 100 * 1024, None);
    println!("{findings}");
    let busy_line = format!(
        "CPU: {cores} cores, {:.0} % busy on average while measuring; {}.",
        busy.unwrap_or(f64::NAN) * 100.0,
        if pinned {
            format!(
                "routers pinned to core {}, load generator and worker to the others",
                cores - 1
            )
        } else {
            "nothing pinned".into()
        }
    );
    println!("{busy_line}");

    let mut md = report_header("dprank overhead: each variant against its floor", command_line);
    let _ = writeln!(md, "One `dprank-sim --instant` worker (4 ranks, answers at once) behind, in turn: nothing (direct); plain Envoy (envoy/dprank.yaml without the wasm filter); the same Envoy with the no-op wasm filter of `bench/noop-filter` in dprank's place, once passing the body through and once buffering it until end of stream and reading it once (the floors of dprank's header and body modes: same SDK, same Envoy settings); the same filter as a no-op router, which makes no choice but writes what dprank writes to route a request to the worker's rank 0 (header mode: the route header and the two rank headers; body mode: the body with the rank field spliced in, replaced, then the route header and `content-length`), so that dprank's own work shows apart from Envoy's cost of routing by header; Envoy + dprank in header mode (`rank_transport: header`, default rank headers) and in body mode (the shipped config), poll interval 1 s, and header mode again with `delivery_timing: false` (what timing each streamed answer costs, paired), with admission (`reject`, its wait limit out of reach) and with admission by SLO (targets out of reach: nothing refused; what its observations add, paired); and smg at its default policy with `--dp-aware`. Each cell is {} s of closed-loop `POST /generate` on N dedicated keep-alive connections with TCP_NODELAY after 0.3 s of warm-up (non-streamed: one output token; streamed: {} chunks after a 1 KB prompt, reporting the time from the first to the last chunk per chunk). Cells are interleaved within each of {} runs, the variants' order rotated from run to run; figures are the median over runs (min-max), and differences and ratios to each variant's floor are paired by run with a 95% bootstrap interval over runs. Router CPU is the router process's own CPU time (all threads) over the measured window per request (streamed: per chunk). The worker writes a streamed response's chunks back to back, so a router may read several at once: the per-chunk figures are its CPU per chunk and the stream's time on the wire per chunk, not a decode-paced inter-token gap.\n", args.seconds, args.stream_tokens, args.runs);
    md.push_str(&table);
    let _ = writeln!(
        md,
        "\n## Targets (issue 13; each against its floor in the same run)\n\n{findings}\n{busy_line}"
    );
    let path = args.out.join("overhead.md");
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
