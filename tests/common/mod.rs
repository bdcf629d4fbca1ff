//! Harness for the end-to-end tests: simulated workers (`dprank-sim`), a real
//! Envoy running the shipped config with the dprank wasm, and small HTTP
//! helpers. Every process started here is killed and reaped by a Drop guard,
//! also when a test panics; the logs of a failed test are printed then.

pub mod envoy;
pub mod faulty;
pub mod http;
pub mod lifecycle;
pub mod pd;
pub mod process;
pub mod raw;
pub mod sim;
pub mod traffic;
pub mod wire;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub use envoy::{Envoy, EnvoyOptions};
pub use http::{Client, Reply};
pub use sim::Sim;

/// The repository root (the `dprank` package's manifest directory).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { repo_root().join(p) })
        .unwrap_or_else(|| repo_root().join("target"))
}

/// A required artefact: from `env_var` if set, else the first existing default.
fn artefact(what: &str, env_var: &str, defaults: &[PathBuf]) -> PathBuf {
    if let Some(path) = std::env::var_os(env_var) {
        let path = PathBuf::from(path);
        assert!(
            path.exists(),
            "{env_var}={} does not exist; run `make test` (it builds and installs everything)",
            path.display()
        );
        return path;
    }
    defaults.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| {
        panic!(
            "{what} not found (looked for {env_var}, then {}); run `make test`, which builds and installs it",
            defaults
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}

/// `ENVOY_BIN`, else `.venv/bin/envoy` in the repo, else `envoy` on PATH.
pub fn envoy_bin() -> PathBuf {
    let mut defaults = vec![repo_root().join(".venv/bin/envoy")];
    if let Some(path) = std::env::var_os("PATH") {
        defaults.extend(std::env::split_paths(&path).map(|dir| dir.join("envoy")));
    }
    artefact("Envoy", "ENVOY_BIN", &defaults)
}

/// `DPRANK_SIM_BIN`, else `target/release/dprank-sim`.
pub fn sim_bin() -> PathBuf {
    artefact(
        "the simulator dprank-sim",
        "DPRANK_SIM_BIN",
        &[target_dir().join("release/dprank-sim")],
    )
}

/// `DPRANK_WASM`, else `target/wasm32-wasip1/release/dprank.wasm`, made absolute.
pub fn wasm_path() -> PathBuf {
    let path = artefact(
        "the filter dprank.wasm",
        "DPRANK_WASM",
        &[target_dir().join("wasm32-wasip1/release/dprank.wasm")],
    );
    std::fs::canonicalize(&path).unwrap_or(path)
}

/// A scenario folder `tests/e2e/<name>/`: `filter.json` holds overrides of the
/// shipped filter config, `README.md` says what the scenario checks.
pub struct Scenario {
    pub name: String,
    pub filter_overrides: serde_json::Value,
}

impl Scenario {
    pub fn load(name: &str) -> Scenario {
        let dir = repo_root().join("tests/e2e").join(name);
        assert!(
            dir.join("README.md").is_file(),
            "scenario {name}: {} is missing",
            dir.join("README.md").display()
        );
        let path = dir.join("filter.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("scenario {name}: cannot read {}: {e}", path.display()));
        let filter_overrides: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("scenario {name}: {} is not JSON: {e}", path.display()));
        assert!(
            filter_overrides.is_object(),
            "scenario {name}: filter.json must hold a JSON object"
        );
        Scenario {
            name: name.to_string(),
            filter_overrides,
        }
    }

    /// An override as a number (for test timing), if the scenario sets it.
    pub fn override_u64(&self, key: &str) -> Option<u64> {
        self.filter_overrides.get(key).and_then(|v| v.as_u64())
    }
}

/// A scratch directory for one test's configs and logs. Removed when the test
/// passes, kept (and named on stderr) when it fails.
pub struct TestDir {
    pub path: PathBuf,
}

static DIRS: AtomicU32 = AtomicU32::new(0);

impl TestDir {
    pub fn new(label: &str) -> TestDir {
        let path = std::env::temp_dir().join(format!(
            "dprank-e2e-{}-{}-{label}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        TestDir { path }
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("e2e: logs and configs kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The last `lines` lines of a log file (for failure reports).
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut file) = std::fs::File::open(path) else {
        return format!("({} cannot be read)", path.display());
    };
    // Logs can be large; the tail is in the last few hundred KB.
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(256 * 1024)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Polls `check` until it returns Some, or panics after `timeout` naming `what`.
pub fn wait_until<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Names the harness gives the workers, in order (the shipped config's style).
pub fn worker_name(index: usize) -> String {
    let letter = (b'a' + (index % 26) as u8) as char;
    if index < 26 {
        format!("worker_{letter}")
    } else {
        format!("worker_{letter}{}", index / 26)
    }
}

/// Starts `count` simulated workers, one process each (so one can be killed),
/// every one with `--dp-size 4` and `extra_args`.
pub fn start_sims(dir: &TestDir, count: usize, extra_args: &[&str]) -> Vec<Sim> {
    (0..count)
        .map(|i| Sim::start(dir, &worker_name(i), 4, extra_args))
        .collect()
}

/// One test's world: its scratch dir, its workers and its Envoy. Fields drop
/// in order: Envoy first (it dumps its log on failure), then the workers,
/// then the directory (kept on failure).
pub struct World {
    pub envoy: Envoy,
    pub sims: Vec<Sim>,
    pub client: Client,
    pub scenario: Scenario,
    /// Held for its Drop: removed after a pass, kept after a failure.
    _dir: TestDir,
}

impl World {
    /// Starts `workers` simulators with `sim_args`, applies `controls` (one
    /// `/_sim/control` update per worker, in order; may be shorter), then
    /// Envoy with the scenario's filter overrides, and (unless told not to)
    /// waits until every worker has been polled once.
    pub fn start(
        scenario: &str,
        workers: usize,
        sim_args: &[&str],
        controls: &[serde_json::Value],
        options: EnvoyOptions,
    ) -> World {
        let scenario = Scenario::load(scenario);
        let dir = TestDir::new(&scenario.name);
        let sims = start_sims(&dir, workers, sim_args);
        for (sim, control) in sims.iter().zip(controls) {
            sim.control(control.clone());
        }
        let envoy = Envoy::start(&dir, &scenario, &sims, &options);
        let world = World {
            envoy,
            sims,
            client: Client::new(),
            scenario,
            _dir: dir,
        };
        if options.wait_for_polls {
            world.wait_for_first_polls();
        }
        world
    }

    /// Two `--instant` workers whose every load poll fails (HTTP 500) from
    /// the start, and Envoy: not waited on for successful polls, but until
    /// each worker's first failed poll is counted.
    pub fn start_with_failing_polls(scenario: &str) -> World {
        let failing = serde_json::json!({"load_fault": "http_500"});
        let world = World::start(
            scenario,
            2,
            &["--instant"],
            &[failing.clone(), failing],
            EnvoyOptions {
                wait_for_polls: false,
                ..EnvoyOptions::default()
            },
        );
        for sim in &world.sims {
            world
                .envoy
                .wait_for_stat(&format!("poll_failed.{}", sim.name), 1, Duration::from_secs(30));
        }
        world
    }

    /// The simplest control: per-rank token offsets for each worker.
    pub fn base_tokens(per_worker: &[&[u64]]) -> Vec<serde_json::Value> {
        per_worker
            .iter()
            .map(|base| serde_json::json!({ "base_tokens": base }))
            .collect()
    }

    pub fn wait_for_first_polls(&self) {
        for sim in &self.sims {
            let stat = format!("poll_ok.{}", sim.name);
            wait_until(
                &format!("the first successful poll of {}", sim.name),
                Duration::from_secs(30),
                || (self.envoy.stat(&stat) >= 1).then_some(()),
            );
        }
    }

    /// The worker whose listen address a reply's `x-sim-worker` names.
    pub fn sim_of(&self, reply: &Reply) -> &Sim {
        let addr = reply
            .header("x-sim-worker")
            .unwrap_or_else(|| panic!("reply without x-sim-worker: {reply:?}"));
        self.sims
            .iter()
            .find(|s| s.addr.to_string() == addr)
            .unwrap_or_else(|| panic!("x-sim-worker {addr} is none of the started workers"))
    }

    /// (worker name, rank) that served a reply.
    pub fn served_by(&self, reply: &Reply) -> (String, i64) {
        (self.sim_of(reply).name.clone(), reply.rank())
    }

    pub fn sim(&self, name: &str) -> &Sim {
        self.sims
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no worker named {name}"))
    }

    /// POST a JSON text to Envoy's listener.
    pub fn post(&self, path: &str, body: &str) -> Reply {
        self.client.post(
            &self.envoy.url(path),
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
    }
}
