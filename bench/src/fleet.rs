//! Starting what a benchmark variant needs: the simulated workers and the
//! front (Envoy with or without dprank, smg), each a [`Managed`] child.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::client::{get_text, PooledClient};
use crate::envoy::{render, render_pd, Balancer, DprankSettings, EnvoyPorts, PdWorker};
use crate::procs::{free_port, Managed};

/// Where the tools live (all relative to the repository root).
#[derive(Debug, Clone)]
pub struct Tools {
    pub root: PathBuf,
    pub sim: PathBuf,
    pub envoy: PathBuf,
    pub smg: Option<PathBuf>,
    pub wasm: PathBuf,
    /// The overhead benchmark's no-op filter (`make noop-wasm`), if built.
    pub noop_wasm: PathBuf,
    pub logs: PathBuf,
}

impl Tools {
    pub fn find(root: &Path) -> Result<Tools, String> {
        let root = root
            .canonicalize()
            .map_err(|e| format!("repository root {}: {e}", root.display()))?;
        let sim = std::env::var_os("DPRANK_SIM_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target/release/dprank-sim"));
        let envoy = std::env::var_os("ENVOY_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join(".venv/bin/envoy"));
        let smg = Some(root.join(".venv/bin/smg")).filter(|p| p.exists());
        let wasm = root.join("target/wasm32-wasip1/release/dprank.wasm");
        let noop_wasm = root.join("target/wasm32-wasip1/release/noop_filter.wasm");
        for (what, path, how) in [
            ("dprank-sim", &sim, "cargo build --release -p dprank-sim"),
            ("envoy", &envoy, "./scripts/setup.sh"),
            ("dprank.wasm", &wasm, "make wasm"),
        ] {
            if !path.exists() {
                return Err(format!("{what} not found at {} (run `{how}`)", path.display()));
            }
        }
        let logs = root.join("target/bench-logs");
        std::fs::create_dir_all(&logs).map_err(|e| format!("cannot create {}: {e}", logs.display()))?;
        Ok(Tools {
            root,
            sim,
            envoy,
            smg,
            wasm,
            noop_wasm,
            logs,
        })
    }
}

/// Simulator options for one fleet.
#[derive(Debug, Clone)]
pub struct SimOptions {
    pub workers: usize,
    pub dp_size: usize,
    pub time_scale: f64,
    /// `--dispatch` value.
    pub dispatch: &'static str,
    pub instant: bool,
    /// Further model flags, passed as given.
    pub extra: Vec<String>,
}

/// One simulator process serving every worker of the fleet.
pub struct SimFleet {
    _process: Managed,
    pub workers: Vec<SocketAddr>,
    /// Each worker's bootstrap listener port (prefill role), in order.
    pub bootstrap: Vec<Option<u16>>,
}

impl SimFleet {
    /// The simulator process's id.
    pub fn pid(&self) -> u32 {
        self._process.pid()
    }

    pub fn start(tools: &Tools, options: &SimOptions, name: &str) -> Result<SimFleet, String> {
        let mut args = Vec::new();
        for _ in 0..options.workers {
            // Port 0: other programs on a shared machine hold fixed ports.
            args.extend(["--listen".to_string(), "127.0.0.1:0".to_string()]);
        }
        args.extend([
            "--dp-size".into(),
            options.dp_size.to_string(),
            "--time-scale".into(),
            options.time_scale.to_string(),
            "--dispatch".into(),
            options.dispatch.into(),
        ]);
        if options.instant {
            args.push("--instant".into());
        }
        args.extend(options.extra.iter().cloned());
        SimFleet::spawn(tools, &args, options.workers, name)
    }

    /// Starts `dprank-sim` with exactly `args` (which list `workers`
    /// `--listen`s) and reads the workers' (and bootstrap listeners')
    /// addresses from its ready lines.
    pub fn spawn(tools: &Tools, args: &[String], workers: usize, name: &str) -> Result<SimFleet, String> {
        let mut process = Managed::spawn(name, &tools.sim, args, &tools.logs)?;
        let lines = process.wait_for_lines("ready ", workers, Duration::from_secs(10))?;
        let workers = lines
            .iter()
            .map(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|a| a.parse().ok())
                    .ok_or_else(|| format!("unexpected simulator line `{l}`"))
            })
            .collect::<Result<Vec<SocketAddr>, String>>()?;
        let bootstrap = lines
            .iter()
            .map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("bootstrap="))
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                    .map(|a| a.port())
            })
            .collect();
        Ok(SimFleet {
            _process: process,
            workers,
            bootstrap,
        })
    }

    /// Load requests the workers have answered so far (polls by any router).
    pub async fn load_polls(&self, client: &PooledClient) -> Vec<u64> {
        let mut out = Vec::new();
        for w in &self.workers {
            let polls = get_text(client, &format!("http://{w}/_sim/counters"))
                .await
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| {
                    v.get("load_requests")
                        .and_then(|m| m.as_object())
                        .map(|m| m.values().filter_map(|n| n.as_u64()).sum())
                })
                .unwrap_or(0);
            out.push(polls);
        }
        out
    }
}

impl SimFleet {
    /// Tells the simulator where each answer ends (`POST /_sim/answers`,
    /// one book per process): the channel no router reads.
    pub async fn tell_answers(&self, client: &PooledClient, answers: &[(&str, u32)]) -> Result<(), String> {
        let Some(worker) = self.workers.first() else {
            return Ok(());
        };
        let lengths: serde_json::Map<String, serde_json::Value> = answers
            .iter()
            .map(|(tag, n)| (tag.to_string(), serde_json::Value::from(*n)))
            .collect();
        let body = serde_json::json!({"clear": true, "lengths": lengths}).to_string();
        let reply = crate::client::post_json(client, &format!("http://{worker}/_sim/answers"), body).await?;
        let told: serde_json::Value =
            serde_json::from_str(&reply).map_err(|e| format!("/_sim/answers: {e}"))?;
        let unique: std::collections::HashSet<&str> = answers.iter().map(|(tag, _)| *tag).collect();
        if told["tags"].as_u64() != Some(unique.len() as u64) {
            return Err(format!(
                "the simulator took {told} of {} answer lengths",
                unique.len()
            ));
        }
        Ok(())
    }

    /// Requests each rank has accepted so far (`/_sim/counters`), every rank
    /// of every worker in order.
    pub async fn served_per_rank(&self, client: &PooledClient) -> Vec<u64> {
        let mut out = Vec::new();
        for w in &self.workers {
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
}

/// Polls `uri` until it answers 2xx.
pub async fn wait_http_ok(
    client: &PooledClient,
    uri: &str,
    process: &mut Managed,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        if get_text(client, uri).await.is_ok() {
            return Ok(());
        }
        if !process.is_running() {
            return Err(format!(
                "{} exited during start-up:\n{}",
                process.name,
                process.log_tail()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} not ready at {uri} after {timeout:?}:\n{}",
                process.name,
                process.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A running router in front of the fleet.
pub struct Front {
    _process: Managed,
    pub url: String,
    pub addr: SocketAddr,
    /// Envoy's admin port (None for smg).
    pub admin: Option<u16>,
    /// Envoy's JSON access log, when the run asked for one (`access_log`).
    pub access_log: Option<PathBuf>,
}

impl Front {
    /// The router process's id.
    pub fn pid(&self) -> u32 {
        self._process.pid()
    }
}

/// dprank's own counters from one Envoy's admin `/stats`.
#[derive(Debug, Clone, Copy, Default)]
pub struct DprankCounters {
    pub routed: u64,
    pub passthrough: u64,
    pub polls_ok: u64,
    pub polls_failed: u64,
    pub polls_skipped: u64,
    pub shared_data_conflicts: u64,
    pub accounting_skipped: u64,
}

impl DprankCounters {
    pub fn add(&mut self, other: &DprankCounters) {
        self.routed += other.routed;
        self.passthrough += other.passthrough;
        self.polls_ok += other.polls_ok;
        self.polls_failed += other.polls_failed;
        self.polls_skipped += other.polls_skipped;
        self.shared_data_conflicts += other.shared_data_conflicts;
        self.accounting_skipped += other.accounting_skipped;
    }

    pub fn summary(&self) -> String {
        format!(
            "routed {}, passed through {}, polls ok {} / failed {} / skipped {}, shared-data conflicts {}, accounting skipped {}",
            self.routed, self.passthrough, self.polls_ok, self.polls_failed, self.polls_skipped, self.shared_data_conflicts, self.accounting_skipped
        )
    }
}

/// Reads the filter's counters (`<prefix>dprank.<name>: <n>` lines).
pub async fn dprank_counters(client: &PooledClient, admin: u16) -> Option<DprankCounters> {
    let text = get_text(client, &format!("http://127.0.0.1:{admin}/stats?filter=dprank"))
        .await
        .ok()?;
    let mut c = DprankCounters::default();
    for line in text.lines() {
        let Some((name, value)) = line.rsplit_once(": ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<u64>() else {
            continue;
        };
        let Some((_, metric)) = name.split_once("dprank.") else {
            continue;
        };
        let slot = match metric.split('.').next() {
            Some("routed") => &mut c.routed,
            Some("passthrough") => &mut c.passthrough,
            Some("poll_ok") => &mut c.polls_ok,
            Some("poll_failed") => &mut c.polls_failed,
            Some("poll_skipped") => &mut c.polls_skipped,
            Some("shared_data_conflicts") => &mut c.shared_data_conflicts,
            Some("accounting_skipped") => &mut c.accounting_skipped,
            _ => continue,
        };
        *slot += value;
    }
    Some(c)
}

pub async fn start_envoy(
    tools: &Tools,
    client: &PooledClient,
    fleet: &SimFleet,
    balancer: &Balancer,
    name: &str,
    access_log: Option<&Path>,
) -> Result<Front, String> {
    let template = read_template(tools, "envoy/dprank.yaml")?;
    let ports = EnvoyPorts {
        listener: free_port()?,
        admin: free_port()?,
    };
    let wasm = match balancer {
        Balancer::Noop(_) if !tools.noop_wasm.exists() => {
            return Err(format!(
                "{} not found (run `make noop-wasm`)",
                tools.noop_wasm.display()
            ))
        }
        Balancer::Noop(_) => &tools.noop_wasm,
        _ => &tools.wasm,
    };
    let mut yaml = render(&template, &ports, &fleet.workers, balancer, wasm)?;
    if let Some(path) = access_log {
        // A log left by an earlier run of the same name must not be read as this one's.
        let _ = std::fs::remove_file(path);
        yaml = crate::access_log::with_access_log(&yaml, path)?;
    }
    let polled: &[&SimFleet] = match balancer {
        Balancer::Dprank { .. } => &[fleet],
        Balancer::RoundRobin | Balancer::LeastRequest | Balancer::Noop(_) => &[],
    };
    let mut front = launch_envoy(tools, client, &yaml, &ports, polled, name).await?;
    front.access_log = access_log.map(Path::to_path_buf);
    Ok(front)
}

/// Envoy + dprank in PD mode: envoy/pd.yaml with the fleets' ports and
/// worker lists.
pub async fn start_envoy_pd(
    tools: &Tools,
    client: &PooledClient,
    prefill: &SimFleet,
    decode: &SimFleet,
    settings: &DprankSettings,
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
        settings,
        &tools.wasm,
    )?;
    launch_envoy(tools, client, &yaml, &ports, &[prefill, decode], name).await
}

/// A file of the repository (an Envoy template), as text.
pub fn read_template(tools: &Tools, relative: &str) -> Result<String, String> {
    let path = tools.root.join(relative);
    std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Runs Envoy on a rendered configuration; when `polled` names fleets
/// (dprank runs), returns only once dprank has polled every worker of them.
pub async fn launch_envoy(
    tools: &Tools,
    client: &PooledClient,
    yaml: &str,
    ports: &EnvoyPorts,
    polled: &[&SimFleet],
    name: &str,
) -> Result<Front, String> {
    let config = tools.logs.join(format!("{name}.yaml"));
    std::fs::write(&config, yaml).map_err(|e| format!("cannot write {}: {e}", config.display()))?;
    let mut polls_before = Vec::new();
    for fleet in polled {
        polls_before.extend(fleet.load_polls(client).await);
    }
    let args: Vec<String> = vec![
        "-c".into(),
        config.display().to_string(),
        // Two Envoys may run at once; hot restart would make them share memory.
        "--disable-hot-restart".into(),
        "-l".into(),
        "warning".into(),
    ];
    let mut process = Managed::spawn(name, &tools.envoy, &args, &tools.logs)?;
    let admin = format!("http://127.0.0.1:{}/ready", ports.admin);
    wait_http_ok(client, &admin, &mut process, Duration::from_secs(20)).await?;
    if !polled.is_empty() {
        // Routing starts only once every worker has been polled.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut polls = Vec::new();
            for fleet in polled {
                polls.extend(fleet.load_polls(client).await);
            }
            if polls.iter().zip(&polls_before).all(|(now, before)| now > before) {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{name}: dprank never polled the workers:\n{}",
                    process.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // One more interval so the snapshot is in shared data on every thread.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let addr = SocketAddr::from(([127, 0, 0, 1], ports.listener));
    Ok(Front {
        _process: process,
        url: format!("http://{addr}"),
        addr,
        admin: Some(ports.admin),
        access_log: None,
    })
}

/// `smg launch` on 127.0.0.1 at a free port (returned), metrics on another,
/// warnings only; the variant's own flags (policy, mode, workers) follow.
pub fn smg_launch_args() -> Result<(u16, Vec<String>), String> {
    let port = free_port()?;
    let metrics = free_port()?;
    let args = vec![
        "launch".into(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
        "--prometheus-host".into(),
        "127.0.0.1".into(),
        "--prometheus-port".into(),
        metrics.to_string(),
        "--log-level".into(),
        "warn".into(),
    ];
    Ok((port, args))
}

/// Runs smg with `args` (which bind it to 127.0.0.1:`port`) and returns once
/// it routes a tiny `/generate`.
pub async fn smg_front(
    tools: &Tools,
    client: &PooledClient,
    smg: &Path,
    args: &[String],
    port: u16,
    name: &str,
) -> Result<Front, String> {
    let mut process = Managed::spawn(name, smg, args, &tools.logs)?;
    let base = format!("http://127.0.0.1:{port}");
    wait_http_ok(
        client,
        &format!("{base}/health"),
        &mut process,
        Duration::from_secs(60),
    )
    .await?;
    // Ready once it routes: a tiny request must succeed.
    let deadline = Instant::now() + Duration::from_secs(60);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    loop {
        let probe = crate::client::Connection::open(addr).await;
        let ok = match probe {
            Ok(mut c) => c
                .post(
                    "/generate",
                    crate::workload::bodies::generate("the cat sat far ", 1, false),
                )
                .await
                .is_ok(),
            Err(_) => false,
        };
        if ok {
            break;
        }
        if !process.is_running() || Instant::now() > deadline {
            return Err(format!("{name} does not route requests:\n{}", process.log_tail()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Front {
        _process: process,
        url: base,
        addr,
        admin: None,
        access_log: None,
    })
}
