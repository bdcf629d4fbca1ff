"""The Python half of scripts/soak.sh: free ports, the rendered Envoy
config, the samples taken every 10 s, the run's metadata and the final
report (bench-results/soak/soak.md). soak.sh calls it as
`python3 scripts/soak.py <command> ...`.
"""

import json
import os
import re
import socket
import statistics
import sys
import time
import urllib.request

NAMES = ["worker_a", "worker_b", "worker_c"]


def free_ports(n=5):
    """n consecutive loopback ports below the ephemeral range, all bindable."""
    start = 24000 + (os.getpid() % 700) * 10
    for base in list(range(start, 31000, 10)) + list(range(24000, start, 10)):
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return list(range(base, base + n))
        except OSError:
            pass
        finally:
            for s in socks:
                s.close()
    sys.exit("soak: no free loopback ports found in 24000-31000")


def render(src, dst, admin, listener, wasm, access_log, workers):
    text = open(src).read()

    def sub(pattern, repl, count=1, flags=re.M):
        nonlocal text
        new, n = re.subn(pattern, repl, text, flags=flags)
        if n != count:
            sys.exit(f"soak: cannot render {src}: pattern {pattern!r} matched {n} times, expected {count}")
        text = new

    sub(r"port_value: 9901\b", f"port_value: {admin}")
    sub(r"port_value: 10000\b", f"port_value: {listener}")
    sub(r"filename: target/wasm32-wasip1/release/dprank\.wasm", f"filename: {wasm}")

    # Filter `workers`: the shipped two-entry list -> our three.
    def workers_block(m):
        ind = m.group(2)
        lines = [f'{ind}{{"address": "127.0.0.1:{p}", "name": "{NAMES[i]}"}}' for i, p in enumerate(workers)]
        return m.group(1) + ",\n".join(lines) + "\n" + m.group(3)

    sub(r'("workers": \[\n)((?:[ ]+))\{"address".*?\n(?:[ ]+\{"address".*?\n)*([ ]+\],)', workers_block)

    # Cluster endpoints.
    def endpoints(m):
        ind = m.group(1)
        return "".join(
            f"{ind}- endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"
            for p in workers
        )

    sub(
        r"^([ ]+)- endpoint: \{ address: \{ socket_address: \{ address: 127\.0\.0\.1, port_value: 30001 \} \} \}\n\1- endpoint: .*30002.*\n",
        endpoints,
    )

    # A JSON access log on the connection manager (instrumentation only).
    def access(m):
        ind = m.group(1)
        fields = {
            "start": "%START_TIME(%s.%3f)%",
            "dur_ms": "%DURATION%",
            "code": "%RESPONSE_CODE%",
            "flags": "%RESPONSE_FLAGS%",
            "details": "%RESPONSE_CODE_DETAILS%",
            "method": "%REQ(:METHOD)%",
            "path": "%REQ(:PATH)%",
            "upstream": "%UPSTREAM_HOST%",
            "route": "%REQ(X-DPRANK-ENDPOINT)%",
            "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
            "soak_id": "%REQ(X-SOAK-ID)%",
            "upstream_failure": "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
            "bytes_out": "%BYTES_SENT%",
        }
        out = [
            m.group(0),
            f"{ind}access_log:",
            f"{ind}- name: envoy.access_loggers.file",
            f"{ind}  typed_config:",
            f'{ind}    "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog',
            f"{ind}    path: {access_log}",
            f"{ind}    log_format:",
            f"{ind}      json_format:",
        ]
        out += [f"{ind}        {k}: {json.dumps(v)}" for k, v in fields.items()]
        return "\n".join(out)

    sub(r"^([ ]+)stat_prefix: sglang_ingress$", access)
    open(dst, "w").write(text)


def http_get(url, timeout=3):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def proc_rss_kb(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                kids = open(f"/proc/{p}/task/{tid}/children").read().split()
                for k in kids:
                    out.append(int(k))
                    todo.append(int(k))
        except OSError:
            pass
    return out


def proc_cpu_ticks(pid):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def machine_ticks():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]
    return sum(f[:8]), idle


def load_runs(path):
    """Finished `dprank-bench load` runs in load.log."""
    runs, cur = [], None
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return runs
    for line in lines:
        if line.startswith("=== run "):
            p = line.split()
            cur = {
                "run": int(p[2]),
                "seed": int(p[4]),
                "start": float(p[6]),
                "wall_s": float(p[8]),
                "sent": None,
                "ok": None,
                "errors": None,
                "summary": "",
                "examples": [],
                "rc": None,
            }
        elif line.startswith("=== end ") and cur is not None:
            p = line.split()
            cur["end"] = float(p[3])
            cur["rc"] = int(p[5])
            runs.append(cur)
            cur = None
        elif cur is not None:
            m = re.match(r"load: (\d+) sent, (\d+) ok, (\d+) errors", line)
            if m:
                cur["sent"], cur["ok"], cur["errors"] = map(int, m.groups())
                cur["summary"] = line.strip()
            elif line.strip().startswith("error:"):
                cur["examples"].append(line.strip()[len("error:") :].strip())
            elif line.startswith("dprank-bench:"):
                cur["examples"].append(line.strip())
    return runs


def curl_records(path):
    recs = []
    try:
        for line in open(path, errors="replace"):
            p = line.rstrip("\n").split("\t")
            if len(p) >= 9:
                recs.append(
                    {
                        "start": float(p[0]),
                        "end": float(p[1]),
                        "id": p[2],
                        "kind": p[3],
                        "code": p[4],
                        "rc": int(p[5]),
                        "worker": p[6],
                        "ok": p[7] == "1",
                        "note": p[8],
                    }
                )
    except OSError:
        pass
    return recs


def sample(work, admin, envoy_pid, t0, worker_ports):
    now = time.time()
    pids = [int(envoy_pid)] + descendants(int(envoy_pid))
    rss = [proc_rss_kb(p) for p in pids]
    s = {
        "t": round(now - float(t0), 1),
        "epoch": now,
        "envoy_pids": pids,
        "rss_kb": sum(r for r in rss if r) if any(rss) else None,
        "envoy_cpu_ticks": sum(c for c in (proc_cpu_ticks(p) for p in pids) if c),
        "loadavg": float(open("/proc/loadavg").read().split()[0]),
    }
    s["machine_ticks"], s["machine_idle_ticks"] = machine_ticks()
    stats = {}
    try:
        for line in http_get(f"http://127.0.0.1:{admin}/stats").splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                stats[name] = int(value)
        s["stats_ok"] = True
    except Exception as e:
        s["stats_ok"] = False
        s["stats_error"] = str(e)
    P = "wasmcustom.dprank."
    s["shared_data_bytes"] = stats.get(P + "shared_data_bytes")
    s["routed"] = {k[len(P) + 7 :]: v for k, v in stats.items() if k.startswith(P + "routed.")}
    s["routed_total"] = sum(s["routed"].values())
    for group in (
        "passthrough",
        "poll_failed",
        "poll_ok",
        "poll_skipped",
        "rejected",
        "dp_size_mismatch",
        "failures",
        "ejections",
        "rank_ejections",
        "report_refused",
    ):
        s[group] = {k[len(P) + len(group) + 1 :]: v for k, v in stats.items() if k.startswith(f"{P}{group}.")}
    for single in (
        "accounting_skipped",
        "shared_data_conflicts",
        "pin_ignored",
        "retry.to_alternate",
        "retry.to_fallback",
        "retry.no_alternate",
    ):
        s[single] = stats.get(P + single, 0 if s["stats_ok"] else None)
    s["tokens"] = {k[len(P) + 7 :]: v for k, v in stats.items() if k.startswith(P + "tokens.")}
    for name in (
        "http.sglang_ingress.downstream_rq_5xx",
        "http.sglang_ingress.downstream_rq_4xx",
        "http.sglang_ingress.downstream_rq_2xx",
        "http.sglang_ingress.downstream_rq_total",
        "cluster.sglang.upstream_rq_5xx",
        "cluster.sglang.upstream_cx_connect_fail",
        "cluster.sglang.upstream_rq_retry",
        "cluster.sglang.upstream_rq_retry_success",
        "cluster.sglang.upstream_rq_retry_limit_exceeded",
        "cluster.sglang.upstream_cx_destroy_remote_with_active_rq",
        "cluster.sglang.upstream_rq_pending_failure_eject",
        "cluster.sglang.upstream_rq_total",
        "cluster.dprank_poll.upstream_rq_total",
        "cluster.dprank_poll.upstream_cx_connect_fail",
        "server.memory_allocated",
        "server.memory_heap_size",
        "server.memory_physical_size",
        "wasm.envoy.wasm.runtime.v8.active",
        "wasm.envoy.wasm.runtime.v8.created",
    ):
        # Counters Envoy creates on first use (e.g. upstream_rq_5xx) count as 0 until then.
        s[name] = stats.get(name, 0 if s["stats_ok"] and not name.startswith(("server.", "wasm.")) else None)
    fleet = {}
    for i, port in enumerate(worker_ports):
        try:
            loads = json.loads(http_get(f"http://127.0.0.1:{port}/v1/loads", timeout=1))
            fleet[NAMES[i]] = {
                "ranks": loads.get("dp_rank_count"),
                "running": sum(l.get("num_running_reqs", 0) for l in loads.get("loads", [])),
                "waiting": sum(l.get("num_waiting_reqs", 0) for l in loads.get("loads", [])),
                "usage": loads.get("aggregate", {}).get("token_usage"),
            }
        except Exception:
            fleet[NAMES[i]] = None
    s["fleet"] = fleet
    runs = load_runs(os.path.join(work, "load.log"))
    s["load_sent"] = sum(r["sent"] or 0 for r in runs)
    s["load_errors"] = sum(r["errors"] if r["errors"] is not None else 0 for r in runs)
    s["load_failed_runs"] = sum(1 for r in runs if r["errors"] is None)
    recs = curl_records(os.path.join(work, "curl.log"))
    s["curl_sent"] = len(recs)
    s["curl_errors"] = sum(1 for r in recs if not r["ok"])
    with open(os.path.join(work, "samples.jsonl"), "a") as f:
        f.write(json.dumps(s) + "\n")
    print(
        f"soak: t={s['t']:.0f}s rss={(s['rss_kb'] or 0) / 1024:.1f}MiB shared={s['shared_data_bytes']} "
        f"routed={s['routed_total']} 5xx={s['http.sglang_ingress.downstream_rq_5xx']} "
        f"client_errors={s['load_errors'] + s['curl_errors']} load={s['loadavg']}",
        flush=True,
    )


# ---------------------------------------------------------------- report
def fmt(v, spec=""):
    return "n/a" if v is None else format(v, spec)


def esc(v):
    return str(v).replace("|", "\\|")


def first_host(route):
    """dprank's choice: the first host of the route header (the rest are the
    alternates Envoy retries on)."""
    return route.split(",")[0] if route and route != "-" else route


LABEL = {
    "injected": "injected (in flight on a stopped worker)",
    "injected-retry": "injected (worker down; the shipped connect-failure retry used up on it)",
    "retry-rank": "injected worker stop + retry onto fewer ranks (the retry-rank limitation)",
    "unexplained": "UNEXPLAINED",
}


def report(work, out):
    meta = json.load(open(os.path.join(work, "meta.json")))
    samples = [json.loads(l) for l in open(os.path.join(work, "samples.jsonl")) if l.strip()]
    t0 = float(meta["t0"])
    events = []
    for line in open(os.path.join(work, "events.tsv")):
        p = line.rstrip("\n").split("\t")
        events.append(
            {
                "epoch": float(p[0]),
                "t": float(p[0]) - t0,
                "kind": p[1],
                "worker": p[2],
                "detail": p[3] if len(p) > 3 else "",
            }
        )
    ports = {NAMES[i]: p for i, p in enumerate(meta["worker_ports"])}
    addr_name = {f"127.0.0.1:{p}": n for n, p in ports.items()}

    # Outages and fault windows, from the event log.
    outages, faults = [], []
    for e in events:
        if e["kind"] == "stop":
            outages.append(
                {"worker": e["worker"], "stop": e["epoch"], "exited": None, "ready": None, "restart_detail": ""}
            )
        elif e["kind"] == "stopped":
            for o in reversed(outages):
                if o["worker"] == e["worker"] and o["exited"] is None:
                    o["exited"] = e["epoch"]
                    break
        elif e["kind"] == "ready" and outages:
            for o in reversed(outages):
                if o["worker"] == e["worker"] and o["ready"] is None:
                    o["ready"] = e["epoch"]
                    o["restart_detail"] = e["detail"]
                    break
        elif e["kind"] == "fault_on":
            faults.append({"worker": e["worker"], "on": e["epoch"], "off": None, "detail": e["detail"]})
        elif e["kind"] == "fault_off":
            for f in reversed(faults):
                if f["worker"] == e["worker"] and f["off"] is None:
                    f["off"] = e["epoch"]
                    break
    end_epoch = float(meta.get("end_epoch") or time.time())
    for o in outages:
        o["ready"] = o["ready"] or end_epoch
        o["exited"] = o["exited"] or o["stop"]
    for f in faults:
        f["off"] = f["off"] or end_epoch

    def in_force(epoch):
        tags = [f"{o['worker']} down" for o in outages if o["stop"] <= epoch <= o["ready"]]
        tags += [f"{f['worker']} load 500" for f in faults if f["on"] <= epoch <= f["off"]]
        return ", ".join(tags)

    # The access log: every request Envoy finished.
    access = []
    for line in open(os.path.join(work, "access.log"), errors="replace"):
        try:
            access.append(json.loads(line))
        except ValueError:
            continue

    def num(v, default=0.0):
        try:
            return float(v)
        except (TypeError, ValueError):
            return default

    expected_code = {"nonjson": 400, "notobject": 400}
    failures = []
    per_kind_envoy = {}
    for a in access:
        sid = a.get("soak_id") or "-"
        kind = sid.split("-", 2)[2] if sid.startswith("curl-") and sid.count("-") >= 2 else "load"
        if sid == "-" and a.get("path", "").split("?")[0] != "/generate":
            kind = "other"
        want = expected_code.get(kind, 200)
        code = int(num(a.get("code"), 0))
        flags = a.get("flags") or "-"
        start = num(a.get("start"))
        end = start + num(a.get("dur_ms")) / 1000.0
        a["_kind"], a["_start"], a["_end"], a["_code"] = kind, start, end, code
        per_kind_envoy.setdefault(kind, [0, 0])
        per_kind_envoy[kind][0] += 1
        if code != want or flags != "-":
            per_kind_envoy[kind][1] += 1
            failures.append(a)

    # Ranks of each worker over time, from the start/restart events.
    dp_changes = {n: [] for n in NAMES}
    for e in events:
        m = re.match(r"dp_size=(\d+)", e["detail"])
        if e["kind"] in ("start", "restart") and m:
            dp_changes[e["worker"]].append((e["epoch"], int(m.group(1))))

    def dp_at(name, epoch):
        dp = None
        for t, d in dp_changes.get(name, []):
            if t <= epoch:
                dp = d
        return dp

    def down_at(name, epoch):
        return next((o for o in outages if o["worker"] == name and o["stop"] <= epoch <= o["ready"]), None)

    def attribute(worker_addr, route, start, end, code=0):
        up_name, choice = addr_name.get(worker_addr), addr_name.get(first_host(route))
        o = down_at(choice, start) if choice else None
        if o and up_name and up_name != choice and code == 400:
            return "retry-rank", (
                f"dprank chose {choice} ({dp_at(choice, o['stop'] - 1)} ranks), which was down (+{o['stop'] - t0:.1f} to +{o['ready'] - t0:.1f} s); "
                f"the connect-failure retry sent the request, with the rank written for {choice}, to {up_name}, "
                f"which has {dp_at(up_name, start)} ranks: the worker's 400 (rank out of range)"
            )
        w = up_name or choice
        for o in outages:
            # Sent before the process was gone, still unanswered when SIGTERM was sent.
            if w == o["worker"] and start <= o["exited"] + 0.25 and end + 1.0 >= o["stop"]:
                return "injected", f"in flight on {w} when it was stopped (SIGTERM at +{o['stop'] - t0:.1f} s)"
        for o in outages:
            if w == o["worker"] and o["stop"] <= start <= o["ready"]:
                return "injected-retry", (
                    f"sent to {w} while it was down (+{o['stop'] - t0:.1f} to +{o['ready'] - t0:.1f} s); "
                    "every attempt of the shipped connect-failure retry failed"
                )
        return "unexplained", "no injected fault explains it"

    fail_rows = []
    for a in failures:
        verdict, why = attribute(a.get("upstream"), a.get("route"), a["_start"], a["_end"], a["_code"])
        a["_verdict"], a["_why"] = verdict, why
        fail_rows.append(a)

    # Client side.
    runs = load_runs(os.path.join(work, "load.log"))
    curl = curl_records(os.path.join(work, "curl.log"))
    by_id = {a.get("soak_id"): a for a in access if a.get("soak_id") not in (None, "-")}
    curl_fail = [r for r in curl if not r["ok"]]
    load_errors = sum(r["errors"] or 0 for r in runs)
    load_sent = sum(r["sent"] or 0 for r in runs)
    load_ok = sum(r["ok"] or 0 for r in runs)
    envoy_load_fail = [a for a in fail_rows if a["_kind"] == "load"]

    last = samples[-1]

    def at(t):
        return min(samples, key=lambda s: abs(s["t"] - t))

    mark = at(120)
    rss = [s["rss_kb"] / 1024 for s in samples if s.get("rss_kb")]
    shd = [s["shared_data_bytes"] for s in samples if s.get("shared_data_bytes") is not None]

    # Envoy log.
    envoy_log = open(os.path.join(work, "envoy.log"), errors="replace").read().splitlines()
    bad = re.compile(r"(?i:panic|\[critical\]|\[error\]|backtrace|abort|fatal|unreachable|out of bounds)|Caught [A-Z]")
    bad_lines = [l for l in envoy_log if bad.search(l) and "guarddog_actions" not in l]
    warn_lines = [l for l in envoy_log if "[warning]" in l]
    warn_kinds = {}
    for l in warn_lines:
        k = re.sub(r"127\.0\.0\.1:\d+", "<worker>", l.split("] ", 3)[-1] if "] " in l else l)
        k = re.sub(r"\d+", "N", k)
        warn_kinds.setdefault(k, [0, l])[0] += 1
    sim_bad = []
    for n in NAMES:
        for fn in sorted(os.listdir(work)):
            if fn.startswith(f"sim-{n}") and fn.endswith(".log"):
                for l in open(os.path.join(work, fn), errors="replace"):
                    if re.search(r"panic|ERROR|error", l):
                        sim_bad.append(f"{fn}: {l.rstrip()}")

    L = []
    w = L.append
    w("# Soak: Envoy + dprank under mixed traffic while workers come and go\n")
    w(f"- Command: `{meta['command']}`")
    w(f"- Date: {meta['date']} (traffic from {meta['t0_utc']} to {meta['end_utc']})")
    w(f"- Machine: {meta['machine']}")
    w(
        f"- Duration: {meta['minutes']} min planned, {(end_epoch - t0) / 60:.1f} min from the first request sent to the last answered; {len(samples)} samples, one every 10 s"
    )
    w(
        f"- Build: git `{meta['git_head']}`{(' (uncommitted changes at the start: ' + str(meta['src_dirty']) + ')') if meta['src_dirty'] else ' (src/ clean at the start)'}, "
        f"`{meta.get('wasm_mtime', '?')}` wasm from target/ (sha256 `{meta['wasm_sha256'][:16]}…`, copied at the start); {meta['envoy_version']}"
    )
    avg_load = statistics.mean(s["loadavg"] for s in samples)
    busy = []
    for a_, b_ in zip(samples, samples[1:], strict=False):
        dt = b_["machine_ticks"] - a_["machine_ticks"]
        if dt > 0:
            busy.append((1 - (b_["machine_idle_ticks"] - a_["machine_idle_ticks"]) / dt) * 100)
    envoy_cpu = []
    hz = os.sysconf("SC_CLK_TCK")
    for a_, b_ in zip(samples, samples[1:], strict=False):
        dt = b_["epoch"] - a_["epoch"]
        if dt > 0 and a_["envoy_pids"][0] == b_["envoy_pids"][0]:
            envoy_cpu.append((b_["envoy_cpu_ticks"] - a_["envoy_cpu_ticks"]) / hz / dt * 100)
    w(
        f"- Machine load (shared with other engineers' builds, tests and fuzzing): 1-min load average {min(s['loadavg'] for s in samples):.2f}–{max(s['loadavg'] for s in samples):.2f} (mean {avg_load:.2f}) on {os.cpu_count()} cores; "
        f"all cores busy {statistics.mean(busy) if busy else float('nan'):.0f}% on average (max {max(busy) if busy else float('nan'):.0f}%), of which Envoy {statistics.mean(envoy_cpu) if envoy_cpu else float('nan'):.0f}% of one core on average."
    )
    w(f"- Other processes at the start (top CPU): {meta['top_start']}")
    w(f"- At the end: {meta.get('top_end', 'n/a')}")
    w(f"- Logs and rendered config (not committed): `{work}`\n")

    w("## Set-up\n")
    w(
        f"- Envoy `--concurrency 2 --disable-hot-restart`, `envoy/dprank.yaml` rendered: listener 127.0.0.1:{meta['listener']}, admin 127.0.0.1:{meta['admin']}, "
        f"filter `workers` and cluster `sglang` endpoints = worker_a 127.0.0.1:{ports['worker_a']}, worker_b :{ports['worker_b']}, worker_c :{ports['worker_c']} (no `dp_size` configured: learned from the reports); "
        "everything else as shipped (poll every 1000 ms, stale after 3000 ms, passive health at its defaults, retry `connect-failure,refused-stream,reset-before-request,reset` x2 "
        "over the hosts dprank lists in `x-dprank-endpoint`, then the fallback round robin with `previous_hosts`), plus a JSON access log on the connection manager to attribute failures."
    )
    w(
        f"- Workers: one `dprank-sim --cost-model legacy --dp-size 4 --time-scale {meta['time_scale']}` process each (200k KV tokens and 64 sequences per rank)."
    )
    w(
        f"- Load: `dprank-bench load --path /generate --time-scale {meta['time_scale']} --rate {meta['rate']}` (streamed, Poisson, prompts lognormal median 200 tokens, outputs median 180), back to back in runs of 30 s wall (300 simulated s) with seeds 1, 2, …; "
        f"about {float(meta['rate']) * meta['time_scale']:.0f} requests per wall second. The fleet is kept busy, not saturated: see the running/waiting columns below."
    )
    w(
        "- Trickle: one curl request every 0.5 s, cycling through `/v1/completions`, streamed and plain `/v1/chat/completions`, a non-JSON body and a JSON array on `/generate` (the worker's 400 is the expected answer), "
        "a `/generate` body with client rank fields (`routed_dp_rank: 3`, `data_parallel_rank: 99`, must be overwritten), `GET /v1/models`, `GET /health`, `GET /get_server_info`. Each must come from a worker (`x-sim-worker`), with the expected status, and streams must end with `[DONE]`."
    )
    w(
        '- Faults: every 60 s one worker gets SIGTERM and is restarted 20 s later on the same port (worker_a, b, c in turn; the second restart with `--dp-size 2`, that worker\'s next restart with 4 again); once `POST /_sim/control {"load_fault":"http_500"}` on one worker for 30 s.\n'
    )

    w("## Fault timeline\n")
    w("| t (s) | event |")
    w("|---:|---|")
    for e in events:
        if e["kind"] in (
            "start",
            "stop",
            "stopped",
            "restart",
            "ready",
            "fault_on",
            "fault_off",
            "traffic_start",
            "traffic_end",
        ):
            w(f"| {e['t']:.1f} | {e['kind']} {e['worker']} {e['detail']} |")
    w("")

    w(
        "Routing around each fault (from the access log: the first host of `x-dprank-endpoint` is dprank's choice, the upstream is where Envoy sent it after retries):\n"
    )
    w(
        "| fault | window (s) | requests dprank sent to that worker during the window | of them retried elsewhere by Envoy (where they landed) | failed | last sent there (s after start of window) | first sent there after the window (s after its end) |"
    )
    w("|---|---|---:|---|---:|---:|---:|")

    def routed_to(name, a_, b_):
        addr = f"127.0.0.1:{ports[name]}"
        return [a for a in access if first_host(a.get("route")) == addr and a_ <= num(a.get("start")) <= b_]

    windows = [
        (f"{o['worker']} stopped, back with {o['restart_detail'] or '?'}", o["worker"], o["stop"], o["ready"])
        for o in outages
    ]
    windows += [(f"{f['worker']} load endpoint 500", f["worker"], f["on"], f["off"]) for f in faults]
    for label, name, a_, b_ in sorted(windows, key=lambda x: x[2]):
        inside = routed_to(name, a_, b_)
        addr = f"127.0.0.1:{ports[name]}"
        moved = [a for a in inside if a.get("upstream") != addr]
        bad_ = [a for a in inside if a in failures]
        after = [a for a in access if first_host(a.get("route")) == addr and num(a.get("start")) > b_]
        last_in = max((num(a.get("start")) for a in inside), default=None)
        first_after = min((num(a.get("start")) for a in after), default=None)
        landed = {}
        for a in moved:
            landed_name = addr_name.get(a.get("upstream"), a.get("upstream"))
            landed[landed_name] = landed.get(landed_name, 0) + 1
        landed_s = ", ".join(f"{k} {v}" for k, v in sorted(landed.items(), key=lambda kv: str(kv[0])))
        w(
            f"| {label} | {a_ - t0:.1f} – {b_ - t0:.1f} | {len(inside)} | {len(moved)}{' (' + landed_s + ')' if landed_s else ''} | {len(bad_)} | {fmt(last_in and last_in - a_, '.1f')} | {fmt(first_after and first_after - b_, '.1f')} |"
        )
    w("")
    retried = [a for a in access if num(a.get("attempts"), 1) > 1]
    by_attempts = {}
    for a in retried:
        key = (
            "dprank's choice was a worker that was down"
            if any(
                first_host(a.get("route")) == f"127.0.0.1:{ports[o['worker']]}"
                and o["stop"] <= num(a.get("start")) <= o["ready"]
                for o in outages
            )
            else "no dprank choice (passthrough: fallback round robin)"
            if a.get("route") in (None, "-")
            else "other"
        )
        d = by_attempts.setdefault(key, {})
        n = int(num(a.get("attempts"), 1))
        d[n] = d.get(n, 0) + 1
    exhausted = [a for a in failures if num(a.get("attempts"), 1) >= 3 and a["_code"] >= 500]
    w(
        f"Envoy's connect-failure retry (2 retries): {len(retried)} requests needed more than one attempt: "
        + (
            "; ".join(
                f"{k}: " + ", ".join(f"{v} with {n} attempts" for n, v in sorted(d.items()))
                for k, d in by_attempts.items()
            )
            or "none"
        )
        + f". {len(exhausted)} failed with every attempt used. "
        f"dprank's counters: last attempt on a listed alternate {fmt(last.get('retry.to_alternate'))}, on the fallback policy's pick {fmt(last.get('retry.to_fallback'))}; "
        f"routed with no alternate holding the rank {fmt(last.get('retry.no_alternate'))}.\n"
    )
    w("## Samples\n")
    w(
        "Routed = `wasmcustom.dprank.routed.*` summed; passthrough = `passthrough.*` summed; poll failed = `poll_failed.*` summed; "
        "Envoy 5xx = `http.sglang_ingress.downstream_rq_5xx`; upstream 5xx / connect fail = `cluster.sglang.upstream_rq_5xx` / `upstream_cx_connect_fail`; "
        "failed (Envoy) = requests the access log shows failed, so far; client errors = errors reported by finished load runs plus failed curl requests, so far; "
        "running / waiting = sequences on the live workers (`/v1/loads`).\n"
    )

    # Bytes that do not depend on rank counts (lease, VM counter, the fixed part of each
    # worker record): the idle end (no request in flight, no pending bucket) minus 8 B per rank.
    def records(ranks):
        return sum(8 * r for r in ranks)

    end_ranks = [(samples[-1]["fleet"].get(n) or {}).get("ranks") for n in NAMES]
    base = None
    if all(end_ranks) and samples[-1].get("shared_data_bytes") is not None:
        base = samples[-1]["shared_data_bytes"] - records(end_ranks)
        if not 0 <= base <= 4096:
            base = None
    known = {}
    for s in samples:
        for n in NAMES:
            v = s["fleet"].get(n)
            if v and v.get("ranks"):
                known[n] = v["ranks"]
        s["_floor"] = base + records(known.values()) if base is not None and len(known) == len(NAMES) else None
    w(
        "| t (s) | Envoy RSS MiB | shared-data bytes (above floor) | routed | passthrough | poll failed | Envoy 5xx | upstream 5xx | connect fail | retries | failed (Envoy) | client errors | running / waiting | load avg | faults in force |"
    )
    w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for s in samples:
        failed_so_far = sum(1 for a in fail_rows if a["_end"] <= s["epoch"])
        fl = [v for v in s["fleet"].values() if v]
        above = ""
        if s.get("_floor") and s.get("shared_data_bytes") is not None:
            d = s["shared_data_bytes"] - s["_floor"]
            above = f" ({d:+d})" if d >= 0 else " (worker records not written yet)"
        w(
            f"| {s['t']:.0f} | {fmt(s['rss_kb'] and s['rss_kb'] / 1024, '.1f')} | {fmt(s['shared_data_bytes'])}{above} | {s['routed_total']} | {sum(s['passthrough'].values())} | "
            f"{sum(s['poll_failed'].values())} | {fmt(s['http.sglang_ingress.downstream_rq_5xx'])} | {fmt(s['cluster.sglang.upstream_rq_5xx'])} | {fmt(s['cluster.sglang.upstream_cx_connect_fail'])} | "
            f"{fmt(s['cluster.sglang.upstream_rq_retry'])} | {failed_so_far} | {s['load_errors'] + s['curl_errors']} | {sum(v['running'] for v in fl)} / {sum(v['waiting'] for v in fl)} | {s['loadavg']:.2f} | {in_force(s['epoch'])} |"
        )
    w("")

    w("## Memory and shared data\n")
    mark_rss = mark["rss_kb"] / 1024 if mark.get("rss_kb") else None
    w(
        "| | first | last | max | at the 2-minute mark (t = %.0f s) | growth from the 2-minute mark to the end |"
        % mark["t"]
    )
    w("|---|---:|---:|---:|---:|---:|")
    if rss:
        g = rss[-1] - mark_rss
        w(
            f"| Envoy RSS (MiB, VmRSS of every Envoy process) | {rss[0]:.1f} | {rss[-1]:.1f} | {max(rss):.1f} | {mark_rss:.1f} | {g:+.1f} MiB ({g / mark_rss * 100:+.1f}%) |"
        )
    if shd:
        m = mark["shared_data_bytes"]
        g = shd[-1] - m
        w(
            f"| dprank shared data (bytes, `shared_data_bytes`) | {shd[0]} | {shd[-1]} | {max(shd)} | {m} | {g:+d} B ({(g / m * 100) if m else 0:+.1f}%) |"
        )
    for key, label in (
        ("server.memory_allocated", "Envoy heap allocated (MiB, `server.memory_allocated`)"),
        ("server.memory_heap_size", "Envoy heap size (MiB, `server.memory_heap_size`)"),
    ):
        vals = [s[key] / 1048576 for s in samples if s.get(key) is not None]
        if vals and mark.get(key) is not None:
            mv = mark[key] / 1048576
            w(f"| {label} | {vals[0]:.1f} | {vals[-1]:.1f} | {max(vals):.1f} | {mv:.1f} | {vals[-1] - mv:+.1f} MiB |")
    w("")
    later = [s for s in samples if s["t"] >= mark["t"]]
    if len(later) >= 4:
        xs = [s["t"] for s in later if s.get("rss_kb")]
        ys = [s["rss_kb"] / 1024 for s in later if s.get("rss_kb")]
        if len(xs) >= 2 and len(set(xs)) > 1:
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
            w(f"Least-squares trend of Envoy RSS from the 2-minute mark to the end: {slope * 60:+.2f} MiB per minute.")
        rl = [s["routed_total"] for s in later]
        w(f"Requests routed from the 2-minute mark to the end: {rl[-1] - rl[0]}.\n")
    over = [
        (s["shared_data_bytes"] - s["_floor"], s)
        for s in samples
        if s.get("shared_data_bytes") is not None and s.get("_floor")
    ]
    w(
        "What the gauge counts (src/shared_data.rs, src/worker_state.rs): the poller lease, the VM counter, the health record (workers and ranks out of rotation or back for less than "
        "`max_cooldown_ms`; empty on a healthy fleet) and one record per worker; a record holds 8 B per rank "
        "plus 12 + 8 x ranks B per pending-estimate bucket (requests routed since a poll round whose report is not in yet; "
        "a bucket leaves when a later report arrives or its requests end). So the size follows the rank counts and the requests in flight between polls, not the number of requests served"
        + (
            f". The part that does not depend on ranks, taken from the idle end of this run, is {base} B, so the idle floor is {base + records([4, 4, 4])} B for 3 workers x 4 ranks and "
            f"{base + records([4, 4, 2])} B while one worker has 2 ranks"
            if base is not None
            else ""
        )
        + ". The samples table shows, in brackets, the bytes above the floor for the rank counts the workers report."
    )
    if over:
        mo, ms = max(over, key=lambda x: x[0])
        w(
            f"Bytes above the floor: at most {mo} (t = {ms['t']:.0f} s), i.e. about {mo / 44:.1f} buckets of a 4-rank worker; at the end {over[-1][0]}.\n"
        )
    else:
        w("")

    w("## Traffic and counters at the end\n")
    w(
        f"- Load generator: {len(runs)} runs, {load_sent} requests sent, {load_ok} ok, {load_errors} errors (client side: non-2xx, transport errors, streams without `[DONE]`)."
    )
    kinds = {}
    for r in curl:
        k = kinds.setdefault(r["kind"], [0, 0])
        k[0] += 1
        k[1] += 0 if r["ok"] else 1
    w(
        "- curl trickle: "
        + ", ".join(f"{k} {v[0]} ({v[1]} failed)" for k, v in sorted(kinds.items()))
        + f"; {len(curl)} in all, {len(curl_fail)} failed."
    )
    w(
        f"- Envoy access log: {len(access)} requests, {len(fail_rows)} failed (status other than expected, or a response flag). Per kind: "
        + ", ".join(f"{k} {v[0]} ({v[1]} failed)" for k, v in sorted(per_kind_envoy.items()))
        + "."
    )
    w(
        f"- dprank routed {last['routed_total']} requests: "
        + ", ".join(f"{wn} {sum(v for k, v in last['routed'].items() if k.startswith(wn + '.'))}" for wn in NAMES)
        + "."
    )
    w(f"- passthrough: {json.dumps(last['passthrough'])}; rejected: {json.dumps(last['rejected'])}")
    w(
        f"- polls ok: {json.dumps(last['poll_ok'])}; failed: {json.dumps(last['poll_failed'])}; skipped: {json.dumps(last['poll_skipped'])}; dp_size_mismatch: {json.dumps(last['dp_size_mismatch'])}"
    )
    w(
        f"- accounting_skipped: {fmt(last['accounting_skipped'])}; shared_data_conflicts: {fmt(last['shared_data_conflicts'])}"
    )
    w(
        f"- passive health: failures {json.dumps(last.get('failures', {}))}; ejections {json.dumps(last.get('ejections', {}))}; "
        f"rank ejections {json.dumps(last.get('rank_ejections', {}))}; refused load reports {json.dumps(last.get('report_refused', {}))}"
    )
    w(
        f"- retries (dprank's count): last attempt on a listed alternate {fmt(last.get('retry.to_alternate'))}, on the fallback policy's pick "
        f"{fmt(last.get('retry.to_fallback'))}; routed with no alternate holding the rank {fmt(last.get('retry.no_alternate'))}"
    )
    w(
        "- Envoy: "
        + ", ".join(
            f"`{k}` {fmt(last.get(k))}"
            for k in (
                "http.sglang_ingress.downstream_rq_total",
                "http.sglang_ingress.downstream_rq_2xx",
                "http.sglang_ingress.downstream_rq_4xx",
                "http.sglang_ingress.downstream_rq_5xx",
                "cluster.sglang.upstream_rq_5xx",
                "cluster.sglang.upstream_cx_connect_fail",
                "cluster.sglang.upstream_rq_retry",
                "cluster.sglang.upstream_rq_retry_success",
                "cluster.sglang.upstream_rq_retry_limit_exceeded",
                "cluster.sglang.upstream_cx_destroy_remote_with_active_rq",
                "cluster.dprank_poll.upstream_rq_total",
                "wasm.envoy.wasm.runtime.v8.created",
            )
        )
    )
    # Polls failed while no fault was in force (sample resolution).
    quiet_poll_fail = []
    for a_, b_ in zip(samples, samples[1:], strict=False):
        d = sum(b_["poll_failed"].values()) - sum(a_["poll_failed"].values())
        if (
            d
            and not in_force(a_["epoch"])
            and not in_force(b_["epoch"])
            and not any(a_["epoch"] <= x <= b_["epoch"] for o in outages for x in (o["stop"], o["ready"]))
            and not any(a_["epoch"] <= x <= b_["epoch"] for f in faults for x in (f["on"], f["off"]))
        ):
            quiet_poll_fail.append(f"+{a_['t']:.0f}–{b_['t']:.0f} s: {d}")
    w(
        f"- Failed polls in 10 s windows with no fault in force or starting/ending: {', '.join(quiet_poll_fail) if quiet_poll_fail else 'none'}."
    )
    # Ranks a 2-rank worker must never get.
    shrink_checks = []
    for o in outages:
        if "dp_size=2" in o["restart_detail"]:
            nxt = [p for p in outages if p["worker"] == o["worker"] and p["stop"] > o["stop"]]
            until = nxt[0]["stop"] if nxt else end_epoch
            win = [s for s in samples if o["ready"] <= s["epoch"] <= until]
            if len(win) >= 2:

                def routed_to(s, ranks, worker=o["worker"]):
                    return sum(v for k, v in s["routed"].items() if k in [f"{worker}.rank_{r}" for r in ranks])

                hi = lambda s: routed_to(s, (2, 3))
                lo = lambda s: routed_to(s, (0, 1))
                shrink_checks.append(
                    f"{o['worker']} with 2 ranks (+{win[0]['t']:.0f} to +{win[-1]['t']:.0f} s): routed to ranks 0-1 {lo(win[-1]) - lo(win[0])}, to ranks 2-3 {hi(win[-1]) - hi(win[0])} (must be 0)"
                )
    if shrink_checks:
        w("- Worker restarted with fewer ranks: " + "; ".join(shrink_checks) + ".")
    w("")

    w("## Errors, attributed\n")
    unexplained = [a for a in fail_rows if a["_verdict"] == "unexplained"]
    curl_unmatched = [r for r in curl_fail if r["id"] not in by_id]
    w(
        f"Client side: {load_errors} load-generator errors and {len(curl_fail)} curl failures. Envoy's access log shows {len(envoy_load_fail)} failed load-generator requests "
        f"({'matches' if len(envoy_load_fail) == load_errors else 'does NOT match'} the client count) and {len(fail_rows) - len(envoy_load_fail)} failed other requests; "
        f"{len(curl_unmatched)} curl failures have no Envoy record."
    )
    in_flight = [a for a in fail_rows if a["_verdict"] == "injected"]
    used_up = [a for a in fail_rows if a["_verdict"] == "injected-retry"]
    retry_rank = [a for a in fail_rows if a["_verdict"] == "retry-rank"]
    w(
        f"**{len(in_flight)} injected: in flight on a worker when it was stopped; "
        f"{len(used_up)} injected: sent to a stopped worker, and every attempt of the shipped connect-failure retry went to it (Envoy's 503); "
        f"{len(retry_rank)} retried onto a worker with fewer ranks (400, rank out of range: the retry-rank limitation); "
        f"{len(unexplained) + len(curl_unmatched)} unexplained.**\n"
    )
    if fail_rows:
        w(
            "| t (s) | request | status | flags / details | upstream (dprank's choice) | attempts | duration ms | attribution |"
        )
        w("|---:|---|---:|---|---|---:|---:|---|")
        for a in sorted(fail_rows, key=lambda a: a["_start"]):
            up = addr_name.get(a.get("upstream"), a.get("upstream"))
            rt = addr_name.get(a.get("route"), a.get("route"))
            sid = a.get("soak_id") if a.get("soak_id") not in (None, "-") else "load"
            w(
                f"| {a['_start'] - t0:.1f} | {esc(a.get('method'))} {esc(a.get('path'))} ({esc(sid)}) | {a['_code']} | {esc(a.get('flags'))} / {esc(a.get('details'))} | {up} ({rt}) | {a.get('attempts')} | {a.get('dur_ms')} | {LABEL[a['_verdict']]}: {a['_why']} |"
            )
        w("")
    if curl_fail:
        w("curl failures (client view):\n")
        w("| t (s) | id | status | curl rc | worker | note | Envoy record |")
        w("|---:|---|---:|---:|---|---|---|")
        for r in curl_fail:
            a = by_id.get(r["id"])
            w(
                f"| {r['start'] - t0:.1f} | {r['id']} | {r['code']} | {r['rc']} | {r['worker']} | {esc(r['note'])} | {(LABEL[a['_verdict']] + ': ' + a['_why']) if a else 'none: unexplained'} |"
            )
        w("")
    w("Load runs (client view; up to 5 error examples per run):\n")
    w("| run | t (s) | wall s | sent | ok | errors | examples |")
    w("|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        ex = "; ".join(e[:160].replace("|", "/") for e in r["examples"])
        w(
            f"| {r['run']} | {r['start'] - t0:.0f} | {r['wall_s']:.0f} | {fmt(r['sent'])} | {fmt(r['ok'])} | {fmt(r['errors'])} | {ex} |"
        )
    w("")

    w("## Logs\n")
    w(
        f"- Envoy log: {len(envoy_log)} lines, {len(warn_lines)} warnings, {len(bad_lines)} lines matching panic / critical / error / backtrace / abort / fatal."
    )
    for l in bad_lines[:30]:
        w(f"    - `{l[:300]}`")
    for _kind, (n, example) in sorted(warn_kinds.items(), key=lambda kv: -kv[1][0]):
        w(f"    - warning x{n}: `{example[:300]}`")
    w(f"- Simulator logs: {len(sim_bad)} lines matching panic / error.")
    for l in sim_bad[:10]:
        w(f"    - `{l[:300]}`")
    w("")

    w("## Findings\n")
    findings = []
    if retry_rank:
        firsts = sorted(retry_rank, key=lambda a: a["_start"])
        ex = firsts[0]
        findings.append(
            f"**Retry onto a worker with fewer ranks turned a worker stop into client 400s ({len(retry_rank)} requests).** "
            f"dprank wrote a rank chosen for a worker that had just been stopped; Envoy's retry re-sent the same body to a worker with fewer ranks, "
            f"which answered 400 `routed_dp_rank=N is out of range`. First at +{ex['_start'] - t0:.1f} s: {ex['_why']}. "
            "dprank lists only workers with the chosen rank as alternates; this happens when none is left (`retry.no_alternate`) and the fallback policy picks."
        )
    if used_up:
        findings.append(
            f"**Every attempt of the retry failed ({len(used_up)} requests got Envoy's 503).** "
            "See above how many requests needed all 3 attempts and where they went."
        )
    if unexplained or curl_unmatched:
        findings.append(
            f"**{len(unexplained) + len(curl_unmatched)} failures no injected fault explains**: see the table above."
        )
    if bad_lines:
        findings.append(f"**{len(bad_lines)} panic/critical/error lines in Envoy's log**: see Logs.")
    if rss and mark_rss and rss[-1] - mark_rss > max(5.0, 0.1 * mark_rss):
        findings.append(f"**Envoy RSS grew {rss[-1] - mark_rss:+.1f} MiB from the 2-minute mark to the end.**")
    if over and over[-1][0] > 44 * 3 * 3:
        findings.append(f"**Shared data ended {over[-1][0]} B above its idle floor.**")
    if vms_all := [
        s_["wasm.envoy.wasm.runtime.v8.created"]
        for s_ in samples
        if s_.get("wasm.envoy.wasm.runtime.v8.created") is not None
    ]:
        if vms_all[-1] != vms_all[0]:
            findings.append(f"**Wasm VMs were rebuilt during the soak ({vms_all[0]} → {vms_all[-1]} created).**")
    down = [s_ for s_ in samples if not s_.get("stats_ok")]
    if down:
        findings.append(f"**Envoy's admin did not answer {len(down)} samples** (first at t = {down[0]['t']:.0f} s).")
    for f_ in findings:
        w(f"- {f_}")
    if not findings:
        w(
            "- None: every failure is explained by an injected fault, memory and shared data stay bounded, no VM was rebuilt, Envoy's log is clean."
        )
    w("")

    w("## Verdict\n")
    verdict = []
    if rss:
        verdict.append(
            f"Envoy RSS {rss[0]:.1f} → {rss[-1]:.1f} MiB (max {max(rss):.1f}); {rss[-1] - mark_rss:+.1f} MiB from the 2-minute mark to the end."
        )
    if shd:
        verdict.append(f"Shared data {shd[0]} → {shd[-1]} bytes (max {max(shd)}).")
    vms = [
        s_["wasm.envoy.wasm.runtime.v8.created"]
        for s_ in samples
        if s_.get("wasm.envoy.wasm.runtime.v8.created") is not None
    ]
    if vms:
        verdict.append(
            f"Wasm VMs created: {vms[0]} at the start, {vms[-1]} at the end ({'no VM was rebuilt' if vms[-1] == vms[0] else 'VMs were REBUILT: FAIL_RELOAD fired'})."
        )
    verdict.append(
        f"{len(fail_rows)} failed requests seen by Envoy: {len(in_flight)} in flight on a stopped worker, {len(used_up)} with every retry spent on a stopped worker, "
        f"{len(retry_rank)} retried onto a worker with fewer ranks (the retry-rank limitation), {len(unexplained)} unexplained; "
        f"{load_errors + len(curl_fail)} client-side errors; Envoy log: {len(bad_lines)} panic/critical/error lines."
    )
    w(" ".join(verdict))
    open(out, "w").write("\n".join(L) + "\n")
    print(
        f"soak: wrote {out}: {len(fail_rows)} failed requests ({len(retry_rank)} retry onto fewer ranks, {len(unexplained)} unexplained), "
        f"RSS {rss[0] if rss else 0:.1f}->{rss[-1] if rss else 0:.1f} MiB, shared data {shd[0] if shd else None}->{shd[-1] if shd else None} B"
    )


def meta_start(out, repo, minutes, rate, time_scale, t0, wasm, envoy, admin, listener, ports):
    """The run's metadata at the start of the traffic (meta.json)."""
    import datetime
    import hashlib
    import platform
    import subprocess

    def sh(c):
        try:
            return subprocess.run(c, shell=True, capture_output=True, text=True, cwd=repo).stdout.strip()
        except Exception:
            return ""

    utc = datetime.timezone.utc
    t0 = float(t0)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
    mem = next((int(l.split()[1]) // 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    top = sh("ps -eo pcpu,comm --sort=-pcpu --no-headers | head -8").splitlines()
    version = re.search(r"version: \S+?/([0-9.]+)/", sh(f"'{envoy}' --version"))
    meta = {
        "command": f"scripts/soak.sh {minutes}" + (f" (SOAK_RATE={rate})" if rate != "2" else ""),
        "minutes": minutes,
        "rate": rate,
        "time_scale": int(time_scale),
        "t0": t0,
        "date": datetime.datetime.fromtimestamp(t0, utc).strftime("%Y-%m-%d %H:%M UTC"),
        "t0_utc": datetime.datetime.fromtimestamp(t0, utc).strftime("%H:%M:%S"),
        "machine": f"{cpu}, {os.cpu_count()} cores, {mem} MiB RAM, Linux {platform.release()}",
        "git_head": sh("git rev-parse --short HEAD"),
        "src_dirty": sh("git status --porcelain -- src Cargo.toml Cargo.lock").replace("\n", "; "),
        "wasm_sha256": hashlib.sha256(open(wasm, "rb").read()).hexdigest(),
        "wasm_mtime": datetime.datetime.fromtimestamp(os.path.getmtime(wasm), utc).strftime("built %H:%M UTC"),
        "envoy_version": "Envoy " + (version.group(1) if version else "?"),
        "admin": int(admin),
        "listener": int(listener),
        "worker_ports": [int(p) for p in ports],
        "top_start": "; ".join(" ".join(l.split()) for l in top) + " (ps: % CPU over each process's life)",
    }
    json.dump(meta, open(out, "w"), indent=1)


def meta_end(path):
    """Adds the end of the run to meta.json."""
    import datetime
    import subprocess

    m = json.load(open(path))
    t = time.time()
    top = subprocess.run(
        "ps -eo pcpu,comm --sort=-pcpu --no-headers | head -8", shell=True, capture_output=True, text=True
    ).stdout.splitlines()
    m["top_end"] = "; ".join(" ".join(l.split()) for l in top)
    m["end_epoch"] = t
    m["end_utc"] = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S")
    json.dump(m, open(path, "w"), indent=1)


def main(argv):
    cmd = argv[1]
    if cmd == "ports":
        print(" ".join(map(str, free_ports())))
    elif cmd == "render":
        src, dst, admin, listener, wasm, access_log, *workers = argv[2:]
        render(src, dst, admin, listener, wasm, access_log, [int(p) for p in workers])
    elif cmd == "sample":
        work, admin, pid, t0, *workers = argv[2:]
        sample(work, admin, pid, t0, workers)
    elif cmd == "report":
        report(argv[2], argv[3])
    elif cmd == "meta-start":
        meta_start(*argv[2:12], argv[12:])
    elif cmd == "meta-end":
        meta_end(argv[2])
    else:
        sys.exit(f"soak.py: unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv)
