//! `dprank-bench selection`: host-side cost of the filter's per-request
//! steps, called as the filter calls them (native code; inside Envoy they run
//! as wasm in V8, typically 1.2-2x slower).

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use dprank::body::JsonObject;
use dprank::codec;
use dprank::config::{Config, StateReads, Worker};
use dprank::health::Health;
use dprank::host::{Callout, CalloutError, CalloutResponse, HeaderMap, Host, HostError, SharedSetError};
use dprank::scheduler::{choose, choose_with_alternates, Constraint, Context, Pool};
use dprank::shared_data::{self, cache::StateCache, IfMissing};
use dprank::worker_state::{LoadTable, Ticket, WorkerState};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

mod prefix;

use crate::report::{markdown_table, report_header};
use crate::stats::median;
use crate::workload::bodies;

#[derive(Debug, Clone, Args)]
pub struct SelectionArgs {
    /// Timed batches per case; the median batch is reported.
    #[arg(long, default_value_t = 51)]
    pub batches: usize,
    #[arg(long, default_value = "bench-results/cost")]
    pub out: PathBuf,
}

impl SelectionArgs {
    pub fn defaults() -> SelectionArgs {
        SelectionArgs {
            batches: 51,
            out: PathBuf::from("bench-results/cost"),
        }
    }
}

/// The request rate of the `state_refresh_ms` column, per VM: the host's
/// clock moves 1 ms every this many requests.
const REQUESTS_PER_MS: u64 = 10;
/// `state_refresh_ms` in that column: every state is read every
/// `REFRESH_MS * REQUESTS_PER_MS` requests.
const REFRESH_MS: u64 = 100;

/// Ranks per worker in the synthetic fleets (one 8-GPU node each).
pub(crate) const RANKS_PER_WORKER: usize = 8;
const TOTAL_RANKS: [usize; 6] = [8, 32, 64, 128, 512, 4096];

/// ns per call: the median batch, and the fastest (the cost without
/// interference from other processes on a shared machine).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) median: f64,
    pub(crate) min: f64,
}

impl Timing {
    pub(crate) fn cell(&self) -> String {
        format!("{:.0} (min {:.0})", self.median, self.min)
    }
}

/// ns per call of `f`, over `batches` batches sized to ~2 ms each.
pub(crate) fn time_ns<F: FnMut() -> u64>(batches: usize, mut f: F) -> Timing {
    let mut per_batch = 1usize;
    loop {
        let start = Instant::now();
        for _ in 0..per_batch {
            black_box(f());
        }
        if start.elapsed().as_micros() >= 2000 || per_batch >= 1 << 24 {
            break;
        }
        per_batch *= 2;
    }
    let samples: Vec<f64> = (0..batches.max(1))
        .map(|_| {
            let start = Instant::now();
            for _ in 0..per_batch {
                black_box(f());
            }
            start.elapsed().as_nanos() as f64 / per_batch as f64
        })
        .collect();
    Timing {
        median: median(&samples),
        min: samples.iter().copied().fold(f64::INFINITY, f64::min),
    }
}

/// Shared data in process memory, the rest of the host inert: what the
/// filter's per-request path costs natively, each shared-data read still a
/// map lookup and a copy of the value as in Envoy (where it is also a host
/// call, which costs more than the copy).
#[derive(Default)]
struct MemoryHost {
    shared: RefCell<hashbrown::HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    /// Requests served so far, for a clock that moves with them (0: still).
    requests: Cell<u64>,
    /// Shared-data reads and writes made (each a host call in Envoy).
    shared_calls: Cell<u64>,
}

impl Host for MemoryHost {
    fn now_ms(&self) -> u64 {
        1_500 + self.requests.get() / REQUESTS_PER_MS
    }
    fn random_u64(&self) -> u64 {
        4
    }
    fn shared_get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.shared_calls.set(self.shared_calls.get() + 1);
        Ok(self.shared.borrow().get(key).cloned())
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedSetError> {
        self.shared_calls.set(self.shared_calls.get() + 1);
        let mut shared = self.shared.borrow_mut();
        let current = shared.get(key).map(|(_, c)| *c);
        if cas.is_some() && cas != current {
            return Err(SharedSetError::CasMismatch);
        }
        self.next_cas.set(self.next_cas.get().wrapping_add(1));
        match shared.get_mut(key) {
            Some(entry) => {
                entry.0.clear();
                entry.0.extend_from_slice(value);
                entry.1 = self.next_cas.get();
            }
            None => {
                shared.insert(key.to_string(), (value.to_vec(), self.next_cas.get()));
            }
        }
        Ok(())
    }
    fn count(&self, _metric: &str, _delta: u64) {}
    fn gauge(&self, _metric: &str, _value: u64) {}
    fn histogram(&self, _metric: &str, _value: u64) {}
    fn http_call(&self, _call: &Callout) -> Result<u32, HostError> {
        Err(HostError::BAD_ARGUMENT)
    }
    fn callout_response(&self, _headers: usize, _body_size: usize) -> Result<CalloutResponse, CalloutError> {
        Err(CalloutError::NoResponse)
    }
    fn request_headers(&self) -> Result<HeaderMap, HostError> {
        Ok(HeaderMap::default())
    }
    fn set_request_header(&self, _name: &str, _value: &str) -> Result<(), HostError> {
        Ok(())
    }
    fn remove_request_header(&self, _name: &str) -> Result<(), HostError> {
        Ok(())
    }
    fn request_body(&self, _size: usize) -> Result<Vec<u8>, HostError> {
        Err(HostError::NOT_FOUND)
    }
    fn replace_request_body(&self, _old_size: usize, _body: &[u8]) -> Result<(), HostError> {
        Err(HostError::BAD_ARGUMENT)
    }
    fn send_response(&self, _status: u32, _headers: &[(&str, &str)], _body: &[u8]) -> Result<(), HostError> {
        Ok(())
    }
    fn resume_response(&self) -> Result<(), HostError> {
        Ok(())
    }
    fn response_status(&self) -> Result<Option<u32>, HostError> {
        Ok(None)
    }
    fn response_header(&self, _name: &str) -> Result<Option<Vec<u8>>, HostError> {
        Ok(None)
    }
    fn response_body(&self, _size: usize) -> Result<Vec<u8>, HostError> {
        Ok(Vec::new())
    }
    fn set_effective_context(&self, _context_id: u32) -> Result<(), HostError> {
        Err(HostError::BAD_ARGUMENT)
    }
    fn resume_request(&self) -> Result<(), HostError> {
        Err(HostError::BAD_ARGUMENT)
    }
    fn property(&self, _path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        Ok(None)
    }
}

/// What the filter does per request around the choice, states read through
/// `host`: refresh this VM's cache (the health record, and every worker's
/// state or those the change log names, decoding only what changed),
/// choose, find the retry alternates, write the estimate; and give back the
/// estimate of the request before (its end), logging both writes when the
/// configuration follows the change log. Returns the chosen cost.
fn filter_request(
    config: &Rc<Config>,
    host: &MemoryHost,
    cache: &mut StateCache,
    previous: &mut Option<Ticket>,
    tie_breaker: u64,
) -> u64 {
    if let Some(ticket) = previous.take() {
        shared_data::update_worker(config, host, ticket.worker, IfMissing::Skip, |s| {
            s.release(&ticket);
            Some(())
        });
    }
    cache.refresh(config, host);
    let pool = Pool {
        workers: config.routed(),
        states: cache.states(),
        loads: cache.loads(),
        offset: 0,
    };
    let ctx = Context {
        now_ms: 1_500,
        stale_after_ms: config.stale_after_ms,
        constraint: Constraint::default(),
        tie_breaker,
        health: cache.health(),
        admit_probing: false,
        pick: config.pick,
        gateways: config.gateways,
        room: None,
        prefix: None,
    };
    let alternates = config.retry_alternates as usize;
    let Some((choice, found)) = choose_with_alternates(&pool, &ctx, alternates) else {
        return 0;
    };
    black_box(found);
    *previous = cache.write(config, host, choice.worker, |s| {
        s.add(choice.worker, choice.rank, 100)
    });
    choice.cost
}

/// A fleet of `ranks` ranks: the config, and each worker's state after a poll
/// plus a few requests sent since (so the pending estimates are walked too).
fn fleet(ranks: usize) -> Result<(Config, Vec<Option<WorkerState>>), String> {
    let workers = ranks.div_ceil(RANKS_PER_WORKER);
    let list: Vec<String> = (0..workers)
        .map(|i| {
            format!(
                r#"{{"address":"127.0.{}.{}:30000","dp_size":{}}}"#,
                i / 250,
                i % 250 + 1,
                RANKS_PER_WORKER
            )
        })
        .collect();
    let config = Config::from_json(format!(r#"{{"workers":[{}]}}"#, list.join(",")).as_bytes())
        .map_err(|e| format!("selection fleet config: {e}"))?;
    let states = (0..workers)
        .map(|w| {
            let mut s = WorkerState::default();
            let seq = s.begin_poll();
            let tokens: Vec<Option<u64>> = (0..RANKS_PER_WORKER)
                .map(|r| Some(((w * 7919 + r * 104_729) % 50_000) as u64))
                .collect();
            s.apply_snapshot(seq, 1_000, &tokens);
            s.begin_poll();
            for r in 0..3u32 {
                s.add(w, r, 300);
            }
            Some(s)
        })
        .collect();
    Ok((config, states))
}

pub fn selection(args: &SelectionArgs, command_line: &str) -> Result<(), String> {
    let mut rows = Vec::new();
    let mut at_4096 = f64::NAN;
    let mut at_4096_min = f64::NAN;
    let mut with_read_4096 = f64::NAN;
    let mut lazy_4096 = f64::NAN;
    let mut idle_4096 = f64::NAN;
    let mut every_4096 = f64::NAN;
    let mut default_4096 = "";
    for ranks in TOTAL_RANKS {
        let (config, states) = fleet(ranks)?;
        let workers = config.routed();
        // A healthy fleet: no worker or rank out of rotation.
        let health = Health::default();
        let ctx = |tie_breaker| Context {
            now_ms: 1_500,
            stale_after_ms: config.stale_after_ms,
            constraint: Constraint::default(),
            tie_breaker,
            health: &health,
            admit_probing: false,
            pick: config.pick,
            gateways: config.gateways,
            room: None,
            prefix: None,
        };
        fn pool<'a>(
            workers: &'a [Worker],
            states: &'a [Option<WorkerState>],
            loads: &'a LoadTable,
        ) -> Pool<'a> {
            Pool {
                workers,
                states,
                loads,
                offset: 0,
            }
        }
        let loads = LoadTable::of(&states);
        let mut tie = 0u64;
        let select = time_ns(args.batches, || {
            tie = tie.wrapping_add(1);
            choose(&pool(workers, &states, &loads), &ctx(tie)).map_or(0, |c| c.cost)
        });
        // The same choice with its retry alternates (the default 2), as the
        // filter asks for them: collected in the same pass.
        let with_alternates = time_ns(args.batches, || {
            tie = tie.wrapping_add(1);
            let pool = pool(workers, &states, &loads);
            let found = choose_with_alternates(&pool, &ctx(tie), config.retry_alternates as usize);
            found.map_or(0, |(c, alternates)| c.cost + alternates.len() as u64)
        });
        // The same on a fleet whose ranks all carry the same load (an idle
        // fleet): every rank ties the least, so no worker can be passed over
        // (`scheduler/pruning/`) and every tie is counted: the worst case.
        let even: Vec<Option<WorkerState>> = states
            .iter()
            .map(|_| {
                let mut s = WorkerState::default();
                let seq = s.begin_poll();
                s.apply_snapshot(seq, 1_000, &[Some(0); RANKS_PER_WORKER]);
                Some(s)
            })
            .collect();
        let even_loads = LoadTable::of(&even);
        let even_alternates = time_ns(args.batches, || {
            tie = tie.wrapping_add(1);
            let pool = pool(workers, &even, &even_loads);
            let found = choose_with_alternates(&pool, &ctx(tie), config.retry_alternates as usize);
            found.map_or(0, |(c, alternates)| c.cost + alternates.len() as u64)
        });
        // Reference: the same choice in one pass over the states through
        // their public API, without materialising the candidates (ties to
        // the first); how far the selection step itself could come down.
        let one_pass = time_ns(args.batches, || {
            let mut best: Option<u64> = None;
            for (index, (worker, state)) in workers.iter().zip(&states).enumerate() {
                let Some(state) = state
                    .as_ref()
                    .filter(|s| s.is_fresh(1_500, config.stale_after_ms))
                else {
                    continue;
                };
                let ranks = worker
                    .dp_size
                    .map_or(state.ranks(), |dp| state.ranks().min(dp as usize));
                for &load in loads.worker(index).iter().take(ranks) {
                    if load != dprank::cost::REMOVED && best.is_none_or(|b| load < b) {
                        best = Some(load);
                    }
                }
            }
            best.unwrap_or(0)
        });
        // What the filter did per request around the choice before its
        // cache: decode every worker's state, choose, re-encode the chosen one.
        let encoded: Vec<Vec<u8>> = states.iter().flatten().map(codec::encode).collect();
        let uncached = time_ns(args.batches, || {
            tie = tie.wrapping_add(1);
            let decoded: Vec<Option<WorkerState>> = encoded.iter().map(|b| codec::decode(b)).collect();
            let loads = LoadTable::of(&decoded);
            let Some(choice) = choose(&pool(workers, &decoded, &loads), &ctx(tie)) else {
                return 0;
            };
            let mut state = decoded
                .into_iter()
                .nth(choice.worker)
                .flatten()
                .unwrap_or_default();
            state.add(choice.worker, choice.rank, 100);
            codec::encode(&state).len() as u64
        });
        // What it does now, through a host: the VM's cache, the choice, the
        // estimate's write, and the release of the request before. Each
        // request changes one or two states, which the next decodes again
        // (the steady state under load). Once with every state read per
        // request, once with the change log; `state_reads: auto` is one of
        // the two by the fleet's size.
        let keys = shared_data::Keys::of(&config);
        let host_of = |states: &[Option<WorkerState>]| {
            let host = MemoryHost::default();
            for (w, state) in config.routed().iter().zip(states.iter().flatten()) {
                let _ = host.shared_set(&keys.worker(&w.address), &codec::encode(state), None);
            }
            host
        };
        let host = host_of(&states);
        let per_request = |host: &MemoryHost, config: &Config, state_reads: StateReads, refresh_ms: u64| {
            let mut config = config.clone();
            config.state_reads = state_reads;
            config.state_refresh_ms = refresh_ms;
            let config = Rc::new(config);
            let mut cache = StateCache::default();
            let mut previous = None;
            let mut tie = 0u64;
            let calls_before = host.shared_calls.get();
            let mut requests = 0u64;
            let timing = time_ns(args.batches, || {
                tie = tie.wrapping_add(1);
                requests += 1;
                if refresh_ms > 0 {
                    host.requests.set(host.requests.get() + 1);
                }
                filter_request(&config, host, &mut cache, &mut previous, tie)
            });
            let calls = (host.shared_calls.get() - calls_before) as f64 / requests as f64;
            (timing, calls)
        };
        let (every, every_calls) = per_request(&host, &config, StateReads::EveryWorker, 0);
        let (logged, logged_calls) = per_request(&host, &config, StateReads::ChangeLog, 0);
        // The same with `state_refresh_ms`: each request reads the states
        // this VM wrote, and every state once per `REFRESH_MS`.
        let (lazy, _) = per_request(&host, &config, StateReads::Auto, REFRESH_MS);
        // The default (`state_reads: auto`) on the idle fleet: the worst
        // case of the choice beside the headline's spread loads.
        let (idle, _) = per_request(&host_of(&even), &config, StateReads::Auto, 0);
        let default_logs = Config {
            state_reads: StateReads::Auto,
            ..config.clone()
        }
        .reads_change_log();
        if ranks == 4096 {
            at_4096 = select.median;
            at_4096_min = select.min;
            with_read_4096 = if default_logs { logged.median } else { every.median };
            every_4096 = every.median;
            default_4096 = if default_logs {
                "the change log"
            } else {
                "every state"
            };
            lazy_4096 = lazy.median;
            idle_4096 = idle.median;
        }
        rows.push(vec![
            ranks.to_string(),
            ranks.div_ceil(RANKS_PER_WORKER).to_string(),
            select.cell(),
            format!("{:.2}", select.median / ranks as f64),
            with_alternates.cell(),
            even_alternates.cell(),
            one_pass.cell(),
            uncached.cell(),
            if default_logs {
                "change_log"
            } else {
                "every_worker"
            }
            .to_string(),
            every.cell(),
            format!("{every_calls:.1}"),
            logged.cell(),
            format!("{logged_calls:.1}"),
            lazy.cell(),
            idle.cell(),
        ]);
    }
    let table = markdown_table(
        &[
            "ranks",
            "workers (8 ranks each)",
            "scheduler::choose, ns",
            "ns per rank",
            "scheduler::choose_with_alternates (2 alternates), ns",
            "the same, every rank's load equal (idle fleet: all tie), ns",
            "reference: one pass, no candidate list, ns",
            "before the cache: decode every state + choose + add + encode, ns",
            "`state_reads: auto` (the default) uses",
            "per request in the filter, `state_reads: every_worker`: read every state and the health record through the host (cache: decode the changed one) + choose + alternates + write the estimate + release the previous one, ns",
            "its shared-data host calls per request",
            "the same with `state_reads: change_log`: read the change log and the health record, then only the states written since (here this VM's own), writes logged, ns",
            "its shared-data host calls per request",
            &format!("the same with `state_reads: every_worker` and `state_refresh_ms: {REFRESH_MS}` at {REQUESTS_PER_MS} requests per ms per VM (every state read once per {} requests, else only those this VM wrote), ns", REFRESH_MS * REQUESTS_PER_MS),
            "per request in the filter under the default `state_reads: auto`, every rank's load equal (idle fleet: all tie), ns",
        ],
        &rows,
    );

    let mut body_rows = Vec::new();
    for (size, label) in [(1024usize, "1 KB"), (100 * 1024, "100 KB")] {
        let body = bodies::generate_of_size(size).to_vec();
        let ns = time_ns(args.batches, || match JsonObject::parse(&body) {
            Ok(object) => object.with_fields(&[("routed_dp_rank", "3")]).len() as u64,
            Err(_) => 0,
        });
        // Reference floors: serde_json validating the same bytes while
        // keeping nothing, and one pass looking for the bytes a JSON scanner
        // must stop at (quotes and backslashes).
        let validate = time_ns(args.batches, || {
            serde_json::from_slice::<serde::de::IgnoredAny>(&body).map_or(0, |_| 1)
        });
        let scan = time_ns(args.batches, || {
            body.iter().filter(|b| **b == b'"' || **b == b'\\').count() as u64
        });
        body_rows.push(vec![
            label.to_string(),
            body.len().to_string(),
            ns.cell(),
            format!("{:.2}", ns.median / body.len() as f64),
            validate.cell(),
            scan.cell(),
        ]);
    }
    let body_table = markdown_table(
        &[
            "body",
            "bytes",
            "JsonObject::parse + with_fields, ns",
            "ns per byte",
            "reference: serde_json validate only (IgnoredAny), ns",
            "reference: byte scan for quotes/backslashes, ns",
        ],
        &body_rows,
    );
    let (prefix_table, prefix_cost) = prefix::rows(args.batches)?;
    println!("\n{table}\n{body_table}\n{prefix_table}");
    let verdict = format!(
        "Selection at 4096 ranks: **{:.1} us** per call, median (target < 10 us); fastest batch {:.1} us. With the state and health reads, the alternates, the estimate's write and the previous release, under the default `state_reads: auto` ({default_4096} at this size): **{:.1} us**, and on an idle fleet (every rank's load equal, all tie): **{:.1} us**; reading every state: **{:.1} us**; reading every state with `state_refresh_ms: {REFRESH_MS}`: **{:.1} us**.",
        at_4096 / 1000.0,
        at_4096_min / 1000.0,
        with_read_4096 / 1000.0,
        idle_4096 / 1000.0,
        every_4096 / 1000.0,
        lazy_4096 / 1000.0
    );
    let verdict = format!(
        "{verdict}\nPrefix affinity, 16 KB prompt, one worker of 8 ranks: **{:.1} us** to hash and score, median (target <= 10 us); fastest batch {:.1} us.",
        prefix_cost.median / 1000.0,
        prefix_cost.min / 1000.0
    );
    println!("{verdict}");

    let mut md = report_header("dprank selection cost (host micro-benchmark)", command_line);
    let _ = writeln!(md, "ns per call over {} timed batches of ~2 ms each: the median batch, and in brackets the fastest batch (the machine is shared with other work; the fastest batch is the cost without interference), native release build of the `dprank` crate (inside Envoy the same code runs as wasm in V8). Fleets of workers with 8 ranks each; every worker's state holds a polled snapshot and three pending estimates, as between two polls. Columns: the selection step (`scheduler::choose`: filters, the load scorer and the least-cost picker, over the loads each VM derives once per state change); the same with the retry alternates the filter lists after the choice (`scheduler::choose_with_alternates`, the default 2, collected in the same pass), and the same on a fleet whose ranks all carry the same load (idle), where every rank ties and no worker can be passed over early (`scheduler/pruning/`: on spread loads most are, as soon as they can neither be picked nor enter any rank's alternates); a hand-written one-pass reference over the same loads, ties to the first (a floor for the step as the data is laid out); what the filter did per request before its cache (decode every worker's shared-data bytes, choose, `add` + `encode` the chosen state), without host calls; and what it does now with the state read included, per request: `StateCache::refresh` (the health record and the workers' states, read through a host that keeps shared data in a hash map: one lookup and one copy of the value per key, as a shared-data read copies it in Envoy; only the one or two states that changed are decoded), then the choice and its retry alternates (`scheduler::choose_with_alternates`, the default 2, collected in the choice's pass), the estimate's write (`StateCache::write`, one compare-and-swap) and the release of the previous request's estimate (a read-modify-write). That request is measured under each `state_reads` mode, and a column says which one the default `auto` takes at that fleet size: `every_worker` reads every worker's state; `change_log` reads the change log (`<p>.changes`) and then only the states written since this VM's last request (in this single-VM loop, the one or two it wrote itself; under several threads, theirs too), and appends an entry to the log after each state write (a read and a compare-and-swap of the log). Beside each, its shared-data host calls per request: inside Envoy each is also a host call, which costs about 1-2 us more than the copy and is not in these ns figures. The next column is `every_worker` with the opt-in `state_refresh_ms` ({REFRESH_MS} ms), the host's clock moving 1 ms every {REQUESTS_PER_MS} requests: each request reads the health record and the states this VM wrote since its last read, and every state once per {} requests; the other threads' estimates are then seen up to {REFRESH_MS} ms late (docs/configuration.md, `state_refresh_ms`). The last is the default's request again on the idle fleet, where every rank ties. Bodies are `/generate` requests of the given size; `with_fields` splices `routed_dp_rank` in.\n", args.batches, REFRESH_MS * REQUESTS_PER_MS);
    md.push_str(&table);
    md.push('\n');
    md.push_str(&body_table);
    md.push('\n');
    md.push_str(&prefix_table);
    let _ = writeln!(md, "\n{verdict}");
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let path = args.out.join("selection.md");
    std::fs::write(&path, md).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}
