//! Prefill/decode worlds: `envoy/pd.yaml` rendered for a test (ports 0, the
//! started prefill and decode simulators as `prefill_workers` /
//! `decode_workers` and as the endpoints of `sglang_decode`, the scenario's
//! overrides merged in), and the tracing of one PD request through both legs.

use super::faulty::{fronted_sim_intercepting, Fronted, Intercept};
use super::process::{
    cluster_mut, edit_dprank_filter, free_port, lb_endpoints, merge, read_yaml, set_port,
    workers_with_overrides, yaml_of, EnvoyProcess, Launch,
};
use super::sim::Recorded;
use super::{repo_root, wait_until, Client, Reply, Scenario, Sim, TestDir};
use serde_json::{json, Value};
use std::time::Duration;

pub const PD_CONFIG: &str = "envoy/pd.yaml";

/// Renders `envoy/pd.yaml`: prefill workers `(name, sim, bootstrap_port)`,
/// decode workers, the scenario's overrides (`prefill_workers` /
/// `decode_workers` arrays merge into the generated entries, in order).
pub fn render_pd(prefill: &[(&Sim, u16)], decode: &[&Sim], overrides: &Value) -> String {
    let mut doc = read_yaml(&repo_root().join(PD_CONFIG));
    set_port(&mut doc, &["admin", "address", "socket_address"], 0);
    let listener = &mut doc["static_resources"]["listeners"][0];
    set_port(listener, &["address", "socket_address"], 0);
    let mut overrides = overrides.clone();
    let prefill_entries: Vec<Value> = prefill
        .iter()
        .map(|(sim, port)| json!({"address": sim.addr.to_string(), "name": sim.name, "bootstrap_port": port}))
        .collect();
    let decode_entries: Vec<Value> = decode
        .iter()
        .map(|sim| json!({"address": sim.addr.to_string(), "name": sim.name}))
        .collect();
    let prefill_workers = workers_with_overrides(prefill_entries, &mut overrides, "prefill_workers");
    let decode_workers = workers_with_overrides(decode_entries, &mut overrides, "decode_workers");
    edit_dprank_filter(&mut doc, PD_CONFIG, &mut |filter| {
        filter["prefill_workers"] = prefill_workers.clone();
        filter["decode_workers"] = decode_workers.clone();
        merge(filter, &overrides);
    });
    let addrs: Vec<_> = decode.iter().map(|s| s.addr).collect();
    cluster_mut(&mut doc, "sglang_decode")["load_assignment"]["endpoints"] = lb_endpoints(&addrs);
    yaml_of(&doc)
}

/// Two prefill and two decode workers behind Envoy in PD mode. Fields drop in
/// order: Envoy, the workers, the directory (kept on failure).
pub struct PdWorld {
    pub envoy: EnvoyProcess,
    pub prefill: Vec<Sim>,
    /// The bootstrap port of each prefill worker, in order.
    pub bootstrap_ports: Vec<u16>,
    pub decode: Vec<Sim>,
    pub client: Client,
    pub scenario: Scenario,
    /// Prefill workers killed by the test (their recordings are gone).
    killed: Vec<String>,
    _dir: TestDir,
}

/// One PD request as both workers saw it.
#[derive(Debug)]
pub struct PdTrace {
    /// (decode worker, rank it served on).
    pub decode: (String, u64),
    /// (prefill worker, rank it served on).
    pub prefill: (String, u64),
    pub decode_request: Recorded,
    pub prefill_request: Recorded,
}

impl PdWorld {
    /// Starts `prefill_a`, `prefill_b` (dp `prefill_dp`, `--role prefill`,
    /// each with a bootstrap listener) and `decode_a`, `decode_b` (dp
    /// `decode_dp`, `--role decode`), all with `sim_args`; sets their
    /// `base_tokens` (prefill then decode, in order); starts Envoy on the
    /// rendered `envoy/pd.yaml` and waits for a good poll of every worker.
    pub fn start(
        scenario: &str,
        prefill_dp: u32,
        decode_dp: u32,
        sim_args: &[&str],
        base_tokens: &[&[u64]],
    ) -> PdWorld {
        PdWorld::start_fronted(scenario, prefill_dp, decode_dp, sim_args, base_tokens, None).0
    }

    /// [`PdWorld::start`] with `prefill_b` behind a front that answers what
    /// `front` names itself (its prefill legs, say); returns the front.
    pub fn start_fronted(
        scenario: &str,
        prefill_dp: u32,
        decode_dp: u32,
        sim_args: &[&str],
        base_tokens: &[&[u64]],
        front: Option<Intercept>,
    ) -> (PdWorld, Option<Fronted>) {
        let scenario = Scenario::load(scenario);
        let dir = TestDir::new(&scenario.name);
        let mut prefill = Vec::new();
        let mut bootstrap_ports = Vec::new();
        let mut fronted = None;
        for name in ["prefill_a", "prefill_b"] {
            let port = free_port();
            let port_text = port.to_string();
            let mut args = vec!["--role", "prefill", "--bootstrap-port", &port_text];
            args.extend_from_slice(sim_args);
            match front.filter(|_| name == "prefill_b") {
                Some(intercept) => {
                    let (handle, f) = fronted_sim_intercepting(&dir, name, prefill_dp, &args, intercept);
                    prefill.push(handle);
                    fronted = Some(f);
                }
                None => prefill.push(Sim::start(&dir, name, prefill_dp, &args)),
            }
            bootstrap_ports.push(port);
        }
        let decode: Vec<Sim> = ["decode_a", "decode_b"]
            .into_iter()
            .map(|name| {
                let mut args = vec!["--role", "decode"];
                args.extend_from_slice(sim_args);
                Sim::start(&dir, name, decode_dp, &args)
            })
            .collect();
        for (sim, base) in prefill.iter().chain(&decode).zip(base_tokens) {
            sim.set_base_tokens(base);
        }
        let prefill_pairs: Vec<(&Sim, u16)> = prefill.iter().zip(bootstrap_ports.iter().copied()).collect();
        let decode_refs: Vec<&Sim> = decode.iter().collect();
        let config = dir.file("envoy.yaml");
        std::fs::write(
            &config,
            render_pd(&prefill_pairs, &decode_refs, &scenario.filter_overrides),
        )
        .expect("write the PD config");
        let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
        let world = PdWorld {
            envoy,
            prefill,
            bootstrap_ports,
            decode,
            client: Client::new(),
            scenario,
            killed: Vec::new(),
            _dir: dir,
        };
        for sim in world.prefill.iter().chain(&world.decode) {
            world
                .envoy
                .wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(30));
        }
        (world, fronted)
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.scenario.override_u64("poll_interval_ms").unwrap_or(1000))
    }

    pub fn post(&self, path: &str, body: &str) -> Reply {
        self.client.post(
            &self.envoy.url(path),
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
    }

    pub fn decode_sim(&self, addr: &str) -> &Sim {
        self.decode
            .iter()
            .find(|s| s.addr.to_string() == addr)
            .unwrap_or_else(|| panic!("{addr} is no decode worker"))
    }

    pub fn prefill_sim(&self, name: &str) -> &Sim {
        self.prefill
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no prefill worker {name}"))
    }

    /// The bootstrap port configured for a prefill worker.
    pub fn bootstrap_port(&self, name: &str) -> u16 {
        let i = self
            .prefill
            .iter()
            .position(|s| s.name == name)
            .unwrap_or_else(|| panic!("no prefill worker {name}"));
        self.bootstrap_ports[i]
    }

    /// Kills a prefill worker's process (a prefill worker going down).
    pub fn kill_prefill(&mut self, name: &str) {
        let sim = self
            .prefill
            .iter_mut()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no prefill worker {name}"));
        sim.kill();
        self.killed.push(name.to_string());
    }

    /// Both legs of a request the decode worker at `decode_addr` (its
    /// `x-sim-worker`) served last, on `decode_rank`: the prefill request is
    /// found among the live prefill workers by its rooms.
    pub fn trace(&self, decode_addr: &str, decode_rank: i64) -> PdTrace {
        let decode_sim = self.decode_sim(decode_addr);
        let decode_request = decode_sim.last_request();
        let room = decode_request.body_json()["bootstrap_room"].clone();
        assert!(
            !room.is_null(),
            "decode body without bootstrap_room: {decode_request:?}"
        );
        // The prefill leg was answered before the decode response was let through.
        let (prefill_name, prefill_request) = wait_until(
            &format!("the prefill request of room {room}"),
            Duration::from_secs(5),
            || {
                self.prefill
                    .iter()
                    .filter(|sim| !self.killed.contains(&sim.name))
                    .find_map(|sim| {
                        let hit = sim
                            .requests()
                            .into_iter()
                            .rev()
                            .find(|r| r.body_json()["bootstrap_room"] == room)?;
                        Some((sim.name.clone(), hit))
                    })
            },
        );
        let prefill_rank = prefill_request
            .rank
            .unwrap_or_else(|| panic!("prefill request served on no rank: {prefill_request:?}"));
        PdTrace {
            decode: (
                decode_sim.name.clone(),
                u64::try_from(decode_rank).expect("decode served on a rank"),
            ),
            prefill: (prefill_name, prefill_rank),
            decode_request,
            prefill_request,
        }
    }

    /// POSTs `body` with extra `headers` (must succeed) and traces both legs.
    pub fn exchange_with(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> (Reply, PdTrace) {
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        let reply = self.client.post(&self.envoy.url(path), &all, body.as_bytes());
        assert_eq!(reply.status, 200, "{path} {body}: {reply:?}");
        let worker = reply
            .header("x-sim-worker")
            .unwrap_or_else(|| panic!("reply without x-sim-worker: {reply:?}"))
            .to_string();
        let trace = self.trace(&worker, reply.rank());
        (reply, trace)
    }

    /// POSTs `body` (must succeed) and traces both legs.
    pub fn exchange(&self, path: &str, body: &str) -> PdTrace {
        self.exchange_with(path, body, &[]).1
    }
}

/// The fields a rewriting proxy inserted: `received` must be `client` with
/// `"k":v,...` (and one separating comma) right after the opening brace and
/// every other byte as the client sent it. Panics otherwise.
pub fn inserted_fields(client: &[u8], received: &[u8]) -> serde_json::Map<String, Value> {
    let show = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let open = client
        .iter()
        .position(|b| *b == b'{')
        .expect("client body is an object")
        + 1;
    let tail = &client[open..];
    assert!(
        received.len() > client.len() && received.starts_with(&client[..open]) && received.ends_with(tail),
        "received body is not the client's with fields after the brace:\nclient:   {:?}\nreceived: {:?}",
        show(client),
        show(received)
    );
    let mut middle = &received[open..received.len() - tail.len()];
    if tail.iter().any(|b| !b.is_ascii_whitespace() && *b != b'}') {
        middle = middle
            .strip_suffix(b",")
            .unwrap_or_else(|| panic!("no comma before the client's fields: {:?}", show(received)));
    }
    let mut object = b"{".to_vec();
    object.extend_from_slice(middle);
    object.push(b'}');
    match serde_json::from_slice(&object) {
        Ok(Value::Object(map)) => map,
        _ => panic!("inserted text {:?} is not a list of JSON members", show(middle)),
    }
}
