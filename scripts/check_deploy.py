"""The checks of scripts/check-deploy.sh that need parsing: the Envoy
configs, the compose file, the Dockerfiles and the Kubernetes manifests.
check-deploy.sh runs it after installing its tools; `smoke-env` prints the
settings of its smoke run.
"""

import copy
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

# Set by main() from the environment check-deploy.sh exports.
ROOT = Path(__file__).resolve().parent.parent
TMP = Path("/nonexistent")
WASM_REL = "target/wasm32-wasip1/release/dprank.wasm"
WASM = ROOT / WASM_REL
ENVOY = "envoy"
errors = []


def ok(msg):
    print(f"ok  {msg}", flush=True)


def bad(msg):
    errors.append(msg)
    print(f"BAD {msg}", flush=True)


def load(path):
    import yaml

    return yaml.safe_load((ROOT / path).read_text())


def envoy_validate(config, label):
    """Writes a bootstrap and runs envoy --mode validate on it."""
    import yaml

    path = TMP / (re.sub(r"[^A-Za-z0-9]+", "_", label) + ".yaml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run = subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode != 0 or "OK" not in run.stdout:
        tail = "\n".join(line[:400] for line in (run.stdout + run.stderr).strip().splitlines()[-6:])
        bad(f"{label}: envoy --mode validate failed:\n{tail}")
        return False
    ok(f"{label}: envoy --mode validate")
    return True


# ----- walking Envoy configs -------------------------------------------------
WASM_FILTER = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
WASM_SERVICE = "type.googleapis.com/envoy.extensions.wasm.v3.WasmService"
OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"


def walk(node):
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def plugin_configs(doc):
    """(kind, PluginConfig) for every Wasm HTTP filter and WasmService."""
    out = []
    for n in walk(doc):
        if isinstance(n, dict) and n.get("@type") == WASM_FILTER:
            out.append(("filter", n["config"]))
        if isinstance(n, dict) and n.get("@type") == WASM_SERVICE:
            out.append(("service", n))
    return out


def dprank_json(plugin_config):
    value = plugin_config.get("configuration", {}).get("value", "{}")
    return json.loads(value)


def point_wasm_at_build(doc):
    """Every Wasm code source becomes the built filter (local file)."""
    for n in walk(doc):
        if isinstance(n, dict) and "vm_config" in n and isinstance(n["vm_config"], dict):
            n["vm_config"]["code"] = {"local": {"filename": str(WASM)}}
    return doc


def clusters(doc):
    return {c["name"]: c for c in doc.get("static_resources", {}).get("clusters", [])}


def override_headers(cluster):
    out = []
    for n in walk(cluster.get("load_balancing_policy", {})):
        if isinstance(n, dict) and n.get("@type") == OVERRIDE_HOST:
            out += [s.get("header") for s in n.get("override_host_sources", [])]
    return out


def endpoints(cluster):
    out = set()
    for n in walk(cluster.get("load_assignment", {})):
        if isinstance(n, dict) and "socket_address" in n:
            sa = n["socket_address"]
            out.add(f"{sa['address']}:{sa['port_value']}")
    return out


def check_poll_cluster(label, cluster):
    if cluster is None:
        bad(f"{label}: the poll cluster is missing")
        return
    if (
        cluster.get("type") != "ORIGINAL_DST"
        or cluster.get("lb_policy") != "CLUSTER_PROVIDED"
        or not cluster.get("original_dst_lb_config", {}).get("use_http_header")
    ):
        bad(
            f"{label}: poll cluster {cluster.get('name')} must be ORIGINAL_DST, CLUSTER_PROVIDED, use_http_header: true"
        )


# Requests in flight a cluster that carries requests must allow: Envoy's
# default of 1024 queues a fleet's streams unseen (docs/envoy.md#circuit-breakers).
MIN_IN_FLIGHT = 16384
THRESHOLDS = ("max_connections", "max_pending_requests", "max_requests")


def check_circuit_breakers(label, cluster):
    """The default-priority thresholds of a cluster that carries requests."""
    name = cluster.get("name")
    thresholds = cluster.get("circuit_breakers", {}).get("thresholds", [])
    default = next((t for t in thresholds if t.get("priority", "DEFAULT") == "DEFAULT"), {})
    low = [key for key in THRESHOLDS if int(default.get(key, 1024)) < MIN_IN_FLIGHT]
    if low:
        bad(
            f"{label}: cluster {name} allows {', '.join(f'{k}={default.get(k, 1024)}' for k in low)}; "
            f"set them to at least {MIN_IN_FLIGHT} (Envoy's 1024 queues requests unseen)"
        )


def check_gateway_circuit_breaker(label, policy):
    """Envoy Gateway's BackendTrafficPolicy `circuitBreaker` (defaults 1024)."""
    breaker = policy.get("spec", {}).get("circuitBreaker", {})
    keys = ("maxConnections", "maxPendingRequests", "maxParallelRequests")
    low = [key for key in keys if int(breaker.get(key, 1024)) < MIN_IN_FLIGHT]
    if low:
        bad(f"{label}: BackendTrafficPolicy circuitBreaker {', '.join(low)} below {MIN_IN_FLIGHT}")


def check_filter_settings(label, pc):
    if pc.get("allow_on_headers_stop_iteration") is not True:
        bad(f"{label}: Wasm filter lacks allow_on_headers_stop_iteration: true (without it routed requests hang)")
    if pc.get("failure_policy") != "FAIL_RELOAD":
        bad(f"{label}: Wasm filter failure_policy is {pc.get('failure_policy')!r}, expected FAIL_RELOAD")


def routed_workers(cfg):
    """The workers requests are routed to (None when taken from a cluster)."""
    if "workers_from_cluster" in cfg:
        return None
    return {w["address"] for w in cfg.get("workers", cfg.get("decode_workers", []))}


def check_admin_cluster(label, cluster, admin_address):
    """dprank's admin cluster must point at Envoy's own admin listener."""
    if cluster is None:
        bad(f"{label}: the admin cluster for workers_from_cluster is missing")
        return
    eps = endpoints(cluster)
    if admin_address and eps != {admin_address}:
        bad(
            f"{label}: admin cluster {cluster['name']} points at {sorted(eps)}, "
            f"Envoy's admin listens on {admin_address}"
        )


def check_plain(path):
    """Lints a plain-Envoy config, then validates it with the built wasm."""
    doc = load(path)
    pcs = plugin_configs(doc)
    filters = [pc for kind, pc in pcs if kind == "filter"]
    services = [pc for kind, pc in pcs if kind == "service"]
    cl = clusters(doc)
    sa = doc.get("admin", {}).get("address", {}).get("socket_address")
    admin_address = f"{sa['address']}:{sa['port_value']}" if sa else None
    n_errors = len(errors)
    if not filters:
        bad(f"{path}: no dprank Wasm HTTP filter")
    for pc in filters:
        check_filter_settings(path, pc)
        cfg = dprank_json(pc)
        route_header = cfg.get("route_header", "x-dprank-endpoint")
        workers = routed_workers(cfg)
        targets = [c for c in cl.values() if override_headers(c)]
        if not targets:
            bad(f"{path}: no cluster with the override_host LB policy")
        for c in targets:
            check_circuit_breakers(path, c)
            if route_header not in override_headers(c):
                bad(f"{path}: cluster {c['name']} reads {override_headers(c)}, dprank writes {route_header}")
            if workers is not None and endpoints(c) and workers != endpoints(c):
                bad(f"{path}: dprank workers {sorted(workers)} != cluster {c['name']} endpoints {sorted(endpoints(c))}")
        disc = cfg.get("workers_from_cluster")
        if disc:
            c = cl.get(disc["cluster"])
            if c is None or route_header not in override_headers(c):
                bad(
                    f"{path}: workers_from_cluster names {disc['cluster']}, which must be "
                    "a cluster with the override_host policy"
                )
            check_admin_cluster(path, cl.get(disc.get("admin_cluster", "dprank_admin")), admin_address)
        if "prefill_workers" in cfg:
            prefill = cl.get(cfg.get("prefill_cluster", "dprank_prefill"))
            check_poll_cluster(path, prefill)
            if prefill is not None:
                check_circuit_breakers(path, prefill)
        if cfg.get("poll_loads", True):
            check_poll_cluster(path, cl.get(cfg.get("poll_cluster", "dprank_poll")))
    for svc in services:
        spc = svc["config"]
        scfg = dprank_json(spc)
        if not svc.get("singleton"):
            bad(f"{path}: the WasmService must be singleton: true")
        check_poll_cluster(path, cl.get(scfg.get("poll_cluster", "dprank_poll")))
        for pc in filters:
            fcfg = dprank_json(pc)
            if pc["vm_config"].get("vm_id") != spc["vm_config"].get("vm_id"):
                bad(f"{path}: service and filter vm_id differ (they share data per vm_id)")
            if fcfg.get("state_key", "dprank") != scfg.get("state_key", "dprank"):
                bad(f"{path}: service and filter state_key differ")
            for key in ("workers", "workers_from_cluster", "prefill_workers", "decode_workers"):
                if fcfg.get(key) != scfg.get(key):
                    bad(f"{path}: service and filter differ in {key}")
            if fcfg.get("poll_loads", True) is not False:
                bad(f"{path}: with a poller service the filter must set poll_loads: false")
            if scfg.get("poll_loads", True) is not True:
                bad(f"{path}: the poller service must not set poll_loads: false")
            if fcfg.get("poll_interval_ms") != scfg.get("poll_interval_ms"):
                bad(
                    f"{path}: service and filter poll_interval_ms differ (the filter's sets how old a snapshot may get)"
                )
    if len(errors) == n_errors:
        ok(
            f"{path}: dprank settings (stop-iteration flag, FAIL_RELOAD, header, "
            f"workers, circuit breakers, poll cluster{', service pairing' if services else ''})"
        )
    envoy_validate(point_wasm_at_build(copy.deepcopy(doc)), path)
    return doc


def normalised(doc):
    """A config with the deployment-specific parts blanked, to compare."""
    doc = copy.deepcopy(doc)
    doc.pop("admin", None)
    doc.pop("bootstrap_extensions", None)
    for listener in doc["static_resources"]["listeners"]:
        listener["address"] = "-"
    for _, pc in plugin_configs(doc):
        pc["vm_config"]["code"] = "-"
        cfg = dprank_json(pc)
        for key in ("workers", "poll_loads", "poll_cluster", "state_key"):
            cfg.pop(key, None)
        pc["configuration"]["value"] = cfg
    for c in doc["static_resources"]["clusters"]:
        c.pop("load_assignment", None)
    return doc


def as_shipped_for_sglang(doc):
    """A vLLM config with its names and its `engine` key put back to the
    shipped config's: envoy/vllm.yaml differs from envoy/dprank.yaml only there."""
    doc = normalised(doc)
    for _, pc in plugin_configs(doc):
        pc["configuration"]["value"].pop("engine", None)
    text = json.dumps(doc).replace('"vllm_ingress"', '"sglang_ingress"').replace('"vllm"', '"sglang"')
    return json.loads(text)


def check_envoy_configs():
    """1. Plain Envoy configs; returns (shipped, wasm_service, compose_envoy)."""
    shipped = check_plain("envoy/dprank.yaml")
    wasm_service = check_plain("envoy/wasm-service.yaml")
    compose_envoy = check_plain("docker/envoy-compose.yaml")
    for other in sorted((ROOT / "envoy").glob("*.yaml")):
        rel = str(other.relative_to(ROOT))
        if rel not in ("envoy/dprank.yaml", "envoy/wasm-service.yaml") and "static_resources" in (load(rel) or {}):
            check_plain(rel)

    if as_shipped_for_sglang(load("envoy/vllm.yaml")) != normalised(shipped):
        bad(
            "envoy/vllm.yaml has drifted from envoy/dprank.yaml beyond names, workers and `engine`: carry the change over"
        )
    else:
        ok("envoy/vllm.yaml: same as envoy/dprank.yaml but for names, workers and engine")

    for path, doc in (("docker/envoy-compose.yaml", compose_envoy), ("envoy/wasm-service.yaml", wasm_service)):
        if normalised(doc) != normalised(shipped):
            bad(
                f"{path} has drifted from envoy/dprank.yaml beyond addresses, workers "
                "and the wasm path: carry the change over"
            )
        else:
            ok(f"{path}: same as envoy/dprank.yaml but for addresses, workers, wasm path")

    return shipped, wasm_service, compose_envoy


def repository_files():
    """The files of the checkout (tracked, or new and not ignored): what a
    user who has only cloned the repository has. Build products are not."""
    return set(
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    )


def check_compose(compose_envoy):
    """2. The compose file against its Envoy config, and runnable with Docker
    alone: Envoy with the filter is built from a Dockerfile stage, and every
    bind mount is a file of the repository, not a host build product."""
    import dockerfile

    n_errors = len(errors)
    compose = json.loads((TMP / "compose.json").read_text())
    services = compose["services"]
    cfg = dprank_json(plugin_configs(compose_envoy)[0][1])
    workers = {w["address"] for w in cfg["workers"]}
    sim_services = {
        n: s for n, s in services.items() if "sim.Dockerfile" in str(s.get("build", {}).get("dockerfile", ""))
    }
    addresses = set()
    for name, svc in sim_services.items():
        ips = [net.get("ipv4_address") for net in (svc.get("networks") or {}).values() if net]
        cmd = svc.get("command") or []
        listen = cmd[cmd.index("--listen") + 1] if "--listen" in cmd else None
        if len(ips) != 1 or not ips[0]:
            bad(f"docker-compose.yml: {name} needs one fixed ipv4_address")
            continue
        if listen and listen.rsplit(":", 1)[0] not in (ips[0], "0.0.0.0"):
            bad(f"docker-compose.yml: {name} listens on {listen}, not its IP {ips[0]}")
        port = listen.rsplit(":", 1)[1] if listen else "30000"
        addresses.add(f"{ips[0]}:{port}")
    if addresses != workers:
        bad(f"docker-compose.yml workers {sorted(addresses)} != docker/envoy-compose.yaml workers {sorted(workers)}")

    wasm_target = plugin_configs(compose_envoy)[0][1]["vm_config"]["code"]["local"]["filename"]
    envoy_svc = next(
        (
            s
            for s in services.values()
            if str(s.get("build", {}).get("dockerfile", "")).endswith("wasm-image.Dockerfile")
        ),
        None,
    )
    if envoy_svc is None:
        bad("docker-compose.yml: no service builds Envoy with the filter (docker/wasm-image.Dockerfile)")
    else:
        build = envoy_svc["build"]
        df = (Path(build.get("context", ROOT)) / build["dockerfile"]).resolve()
        stage = stage_named(build_stages(dockerfile.parse_file(str(df))), build.get("target"))
        if stage is None:
            bad(
                f"docker-compose.yml: the Envoy service's build target {build.get('target')!r} is no stage of {df.name}"
            )
        else:
            check_envoy_stage(f"docker-compose.yml (Envoy from {df.name}, target {stage['name']})", stage, wasm_target)
        mounts = {v["target"]: v for v in envoy_svc.get("volumes", [])}
        if wasm_target in mounts:
            bad(f"docker-compose.yml: a mount at {wasm_target} would hide the filter built into the image")
        cmd = envoy_svc.get("command") or []
        conf_target = cmd[cmd.index("-c") + 1] if "-c" in cmd else "/etc/envoy/envoy.yaml"
        m_conf = mounts.get(conf_target)
        if (
            not m_conf
            or Path(m_conf["source"]).resolve() != (ROOT / "docker/envoy-compose.yaml").resolve()
            or not m_conf.get("read_only")
        ):
            bad(f"docker-compose.yml: docker/envoy-compose.yaml must be mounted read-only at {conf_target}")
    for name, source in mounts_outside_repository(services, repository_files(), ROOT):
        bad(
            f"docker-compose.yml: {name} mounts {source}, which is not a file of the repository "
            "(a host build product?): with Docker alone it would be missing"
        )
    if len(errors) == n_errors:
        ok(
            f"docker-compose.yml: {len(sim_services)} workers at fixed IPs = dprank's workers; Envoy built "
            "with the filter from a Dockerfile stage; every mount a repository file (Docker alone suffices)"
        )


def mounts_outside_repository(services, files, root):
    """(service, source) for each bind mount whose source is not one of the
    repository's files (relative paths in `files`)."""
    out = []
    root = Path(root).resolve()
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            if v.get("type") != "bind":
                continue
            src = Path(v["source"]).resolve()
            rel = str(src.relative_to(root)) if root in src.parents else None
            if rel not in files:
                out.append((name, v["source"]))
    return out


def build_stages(cmds):
    """A parsed Dockerfile's stages in order: {name, base, cmds}."""
    out = []
    for c in cmds:
        if c.cmd.upper() == "FROM":
            v = c.value
            name = v[2] if len(v) >= 3 and v[1].upper() == "AS" else str(len(out))
            out.append({"name": name, "base": v[0], "cmds": []})
        elif out:
            out[-1]["cmds"].append(c)
    return out


def stage_named(stages, name):
    """The stage a build target names (no target: the last stage)."""
    if not name:
        return stages[-1] if stages else None
    return next((st for st in stages if st["name"] == name), None)


def copies(stage):
    """(from stage or None, sources, destination) for each COPY/ADD."""
    out = []
    for c in stage["cmds"]:
        if c.cmd.upper() in ("COPY", "ADD"):
            src = next((f.split("=", 1)[1] for f in c.flags if f.startswith("--from=")), None)
            out.append((src, list(c.value[:-1]), c.value[-1]))
    return out


def cargo_builds(stage):
    """The `cargo build` command lines a stage runs."""
    out = []
    for c in stage["cmds"]:
        if c.cmd.upper() == "RUN":
            for part in re.split(r"&&|;|\|\|", " ".join(c.value)):
                if re.search(r"\bcargo\s+build\b", part):
                    out.append(part.strip())
    return out


def cargo_packages(command):
    return re.findall(r"(?:-p|--package)[ =](\S+)", command)


def check_envoy_stage(label, stage, wasm_target):
    """An Envoy stage: the official image pinned to 1.x >= 1.35, the filter
    copied from a stage that builds it for wasm32-wasip1 to wasm_target."""
    m = re.match(r"envoyproxy/envoy:v?1\.(\d+)\.\d+$", stage["base"])
    if not m or int(m.group(1)) < 35:
        bad(f"{label}: base image {stage['base']} is not envoyproxy/envoy pinned to a 1.x >= 1.35 release")
    wasm_copies = [c for c in copies(stage) if c[2] == wasm_target]
    if len(wasm_copies) != 1 or wasm_copies[0][0] is None:
        bad(f"{label}: must COPY the filter --from a build stage to {wasm_target} (the path the Envoy config loads)")


def check_wasm_build(label, stages):
    """The wasm image's stages: a build stage compiling the filter for
    wasm32-wasip1, an `envoy` stage, and last the OCI layout."""
    builder = {
        st["name"]
        for st in stages
        if any("--target wasm32-wasip1" in b and "dprank" in cargo_packages(b) for b in cargo_builds(st))
    }
    targets_added = {
        st["name"]
        for st in stages
        for c in st["cmds"]
        if c.cmd.upper() == "RUN" and re.search(r"rustup target add [^&;]*wasm32-wasip1", " ".join(c.value))
    }
    if not builder:
        bad(f"{label}: no stage runs cargo build --target wasm32-wasip1 -p dprank")
    elif not builder <= targets_added:
        bad(f"{label}: the build stage must add the wasm32-wasip1 target (rustup target add wasm32-wasip1)")
    last = stages[-1] if stages else None
    if (
        last is None
        or last["base"] != "scratch"
        or len(last["cmds"]) != 1
        or len(copies(last)) != 1
        or copies(last)[0][2] != "/plugin.wasm"
        or copies(last)[0][0] not in builder
    ):
        bad(
            f"{label}: the last (default) stage must be FROM scratch with one COPY --from the build stage "
            "to /plugin.wasm (the layout Istio and Envoy Gateway read)"
        )
    envoy = stage_named(stages, "envoy")
    if envoy is None:
        bad(f"{label}: no `envoy` stage (docker-compose.yml builds it)")
    elif not any(src in builder for src, _, _ in copies(envoy)):
        bad(f"{label}: the envoy stage must copy the filter from the build stage")


def ignore_patterns(dockerfile_path):
    specific = dockerfile_path.with_name(dockerfile_path.name + ".dockerignore")
    path = specific if specific.exists() else ROOT / ".dockerignore"
    if not path.exists():
        return []
    pats = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pats.append(line)
    return pats


def included(rel, pats):
    """Docker's rule: the last matching pattern wins; a pattern matching a
    parent directory matches its contents."""
    import fnmatch

    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    keep = True
    for p in pats:
        neg = p.startswith("!")
        pat = p[1:] if neg else p
        pat = pat.strip("/")
        if any(fnmatch.fnmatchcase(pre, pat) and pre.count("/") == pat.count("/") for pre in prefixes):
            keep = neg
    return keep


def check_dockerfiles():
    """3. Dockerfiles: parsed, COPY sources in their build context."""
    import dockerfile

    # What a fresh clone holds: a Dockerfile may not COPY a host build product.
    candidates = repository_files()
    for df in sorted((ROOT / "docker").glob("*.Dockerfile")):
        label = str(df.relative_to(ROOT))
        try:
            cmds = dockerfile.parse_file(str(df))
        except dockerfile.GoParseError as err:
            bad(f"{label}: {err}")
            continue
        pats = ignore_patterns(df)
        context = {f for f in candidates if (ROOT / f).exists() and included(f, pats)}
        ctx_dir = TMP / ("ctx_" + df.stem.replace(".", "_"))
        for f in context:
            (ctx_dir / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, ctx_dir / f)
        n_errors = len(errors)
        for c in cmds:
            if c.cmd.upper() in ("COPY", "ADD") and not any(f.startswith("--from") for f in c.flags):
                for src in c.value[:-1]:
                    src = src.strip("./") if src not in (".", "./") else ""
                    if src and not any(f == src or f.startswith(src + "/") for f in context):
                        bad(
                            f"{label}: COPY source {src} is not in the build context "
                            f"({'its .dockerignore excludes it' if (ROOT / src).exists() else 'missing'})"
                        )
        stages = build_stages(cmds)
        if df.name == "wasm-image.Dockerfile":
            check_wasm_build(label, stages)
        packages = [p for st in stages for b in cargo_builds(st) for p in cargo_packages(b)]
        if packages:
            meta = ["cargo", "metadata", "--format-version", "1", "--locked"]
            run = subprocess.run(meta + ["--offline"], cwd=ctx_dir, capture_output=True, text=True)
            if run.returncode != 0:
                run = subprocess.run(meta, cwd=ctx_dir, capture_output=True, text=True)
            if run.returncode != 0:
                bad(
                    f"{label}: its build context is not a complete Cargo workspace:\n"
                    + "\n".join(run.stderr.strip().splitlines()[-4:])
                )
            else:
                names = {p["name"] for p in json.loads(run.stdout)["packages"]}
                for p in packages:
                    if p not in names:
                        bad(f"{label}: cargo build -p {p}, but its build context has no package {p}")
        if len(errors) == n_errors:
            ok(
                f"{label}: parsed; COPY sources in its {len(context)}-file build context"
                + (f"; context is a locked Cargo workspace with {', '.join(packages)}" if packages else "")
            )


KNOWN = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
    ("extensions.istio.io/v1alpha1", "WasmPlugin"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"),
}


def load_manifests():
    """4. Kubernetes manifests: valid YAML of known kinds, by kind."""
    import yaml

    manifests = {}
    for path in sorted(
        list((ROOT / "envoy/istio").rglob("*.yaml")) + list((ROOT / "envoy/envoy-gateway").rglob("*.yaml"))
    ):
        label = str(path.relative_to(ROOT))
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as err:
            bad(f"{label}: not valid YAML: {err}")
            continue
        n_errors = len(errors)
        for d in docs:
            key = (d.get("apiVersion"), d.get("kind"))
            if key not in KNOWN:
                bad(f"{label}: unexpected {key}")
            if not d.get("metadata", {}).get("name") or not isinstance(d.get("spec"), dict):
                bad(f"{label}: {key[1]} without metadata.name or spec")
            manifests.setdefault(d.get("kind"), []).append(d)
        if len(errors) == n_errors:
            ok(f"{label}: valid YAML, {', '.join(d['kind'] for d in docs)}")
    return manifests


def bootstrap(http_filter_config, workers_cluster, extra_clusters, buffer_limit=None):
    """A minimal static bootstrap around the pieces a platform would generate."""
    listener = {
        "name": "check",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                            "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "check",
                            "route_config": {
                                "virtual_hosts": [
                                    {
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": [
                                            {"match": {"prefix": "/"}, "route": {"cluster": workers_cluster["name"]}}
                                        ],
                                    }
                                ]
                            },
                            "http_filters": [
                                {"name": "dprank", "typed_config": http_filter_config},
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                    },
                                },
                            ],
                        },
                    }
                ]
            }
        ],
    }
    if buffer_limit:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit
    return point_wasm_at_build(
        {"static_resources": {"listeners": [listener], "clusters": [workers_cluster] + extra_clusters}}
    )


def workers_cluster(cfg, merge=None):
    """A stand-in for the platform's cluster of the workers."""
    disc = cfg.get("workers_from_cluster")
    name = disc["cluster"] if disc else "workers"
    addresses = [w["address"] for w in cfg["workers"]] if not disc else ["10.0.0.1:30000"]
    c = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": a.rsplit(":", 1)[0].strip("[]"),
                                        "port_value": int(a.rsplit(":", 1)[1]),
                                    }
                                }
                            }
                        }
                        for a in addresses
                    ]
                }
            ],
        },
    }
    c.update(merge or {})
    return c


def check_platform_links(label, cfg, lb_headers, added, workers_cluster_name, admin_port):
    """dprank's configuration against what the platform generates and the
    patches add: header, poll cluster, and (workers_from_cluster) the cluster
    name the platform gives the workers and the admin cluster."""
    n_errors = len(errors)
    rh = cfg.get("route_header", "x-dprank-endpoint")
    if rh not in lb_headers:
        bad(f"{label}: override_host reads {lb_headers}, dprank writes {rh}")
    names = {c["name"]: c for c in added}
    check_poll_cluster(label, names.get(cfg.get("poll_cluster", "dprank_poll")))
    disc = cfg.get("workers_from_cluster")
    if disc:
        if disc["cluster"] != workers_cluster_name:
            bad(
                f"{label}: workers_from_cluster names {disc['cluster']!r}; the platform "
                f"names the workers' cluster {workers_cluster_name!r}"
            )
        check_admin_cluster(label, names.get(disc.get("admin_cluster", "dprank_admin")), f"127.0.0.1:{admin_port}")
    if len(errors) == n_errors:
        ok(
            f"{label}: route header = override_host header; poll cluster added"
            + ("; workers from the platform's cluster via the admin cluster" if disc else "")
        )


def check_istio(manifests):
    """Istio: EnvoyFilters (the working form) and the reference WasmPlugin."""
    efs = {d["metadata"]["name"]: d for d in manifests.get("EnvoyFilter", [])}
    if efs:
        patches = [p for d in efs.values() for p in d["spec"]["configPatches"]]
        ext = [p for p in patches if p["applyTo"] == "EXTENSION_CONFIG"]
        http = [p for p in patches if p["applyTo"] == "HTTP_FILTER"]
        cl_add = [
            p["patch"]["value"] for p in patches if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "ADD"
        ]
        cl_merge = [p for p in patches if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE"]
        lst = [p["patch"]["value"] for p in patches if p["applyTo"] == "LISTENER"]
        if len(ext) != 1 or len(http) != 1 or len(cl_merge) != 1 or not cl_add:
            bad(
                "envoy/istio: expected one EXTENSION_CONFIG, one HTTP_FILTER, one CLUSTER MERGE and CLUSTER ADD patches"
            )
        else:
            ec = ext[0]["patch"]["value"]
            hf = http[0]["patch"]["value"]
            label = "envoy/istio (EnvoyFilters)"
            if hf.get("name") != ec.get("name") or WASM_FILTER not in hf.get("config_discovery", {}).get(
                "type_urls", []
            ):
                bad(
                    f"{label}: HTTP_FILTER config_discovery must name the EXTENSION_CONFIG "
                    f"{ec.get('name')!r} with the Wasm type URL"
                )
            if (
                http[0]["patch"]["operation"] != "INSERT_BEFORE"
                or http[0]["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
                != "envoy.filters.http.router"
            ):
                bad(f"{label}: the filter must go right before the router")
            uri = ec["typed_config"]["config"]["vm_config"]["code"]["remote"]["http_uri"]["uri"]
            if not uri.startswith("oci://"):
                bad(f"{label}: the Wasm code should be an oci:// image, got {uri}")
            pc = ec["typed_config"]["config"]
            check_filter_settings(label, pc)
            cfg = dprank_json(pc)
            merge = cl_merge[0]["patch"]["value"]
            m = cl_merge[0]["match"]["cluster"]
            istio_cluster = f"outbound|{m.get('portNumber', '')}|{m.get('subset', '')}|{m['service']}"
            check_platform_links(label, cfg, override_headers(merge), cl_add, istio_cluster, 15000)
            limit = next((v.get("per_connection_buffer_limit_bytes") for v in lst), None)
            envoy_validate(
                bootstrap(copy.deepcopy(ec["typed_config"]), workers_cluster(cfg, merge), cl_add, limit), label
            )

    for wp in manifests.get("WasmPlugin", []):
        label = f"envoy/istio WasmPlugin {wp['metadata']['name']}"
        spec = wp["spec"]
        if not spec["url"].startswith("oci://"):
            bad(f"{label}: url should be oci://")
        cfg = json.loads(json.dumps(spec["pluginConfig"]))
        # What Istio generates from it (plus the flag it cannot set yet).
        pc = {
            "name": wp["metadata"]["name"],
            "root_id": spec.get("pluginName", ""),
            "failure_policy": spec.get("failStrategy", "FAIL_CLOSE").replace("FAIL_CLOSE", "FAIL_CLOSED"),
            "allow_on_headers_stop_iteration": True,
            "vm_config": {"runtime": "envoy.wasm.runtime.v8"},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(cfg)},
        }
        envoy_validate(
            bootstrap({"@type": WASM_FILTER, "config": pc}, workers_cluster(cfg), []), label + " pluginConfig"
        )


def check_envoy_gateway(manifests):
    """Envoy Gateway: the EnvoyExtensionPolicy with its patch and traffic policies."""
    eeps = manifests.get("EnvoyExtensionPolicy", [])
    btps = manifests.get("BackendTrafficPolicy", [])
    epps = manifests.get("EnvoyPatchPolicy", [])
    if eeps:
        label = "envoy/envoy-gateway"
        eep = eeps[0]
        wasm = eep["spec"]["wasm"][0]
        if wasm["code"]["type"] != "Image" or not wasm["code"]["image"]["url"]:
            bad(f"{label}: the EnvoyExtensionPolicy should load an OCI image")
        cfg = wasm["config"]
        filter_name = (
            f"envoy.filters.http.wasm/envoyextensionpolicy/"
            f"{eep['metadata']['namespace']}/{eep['metadata']['name']}/wasm/0"
        )
        # What Envoy Gateway generates (internal/xds/translator/wasm.go), then the
        # EnvoyPatchPolicy's listener patches applied to it.
        pc = {
            "name": wasm.get("name", ""),
            "root_id": wasm.get("rootID", ""),
            "vm_config": {"vm_id": filter_name.split("/", 1)[1], "runtime": "envoy.wasm.runtime.v8"},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(cfg)},
        }
        if wasm.get("failOpen"):
            pc["fail_open"] = True
        added = []
        for epp in epps:
            for jp in epp["spec"]["jsonPatches"]:
                op = jp["operation"]
                if jp["type"].endswith("listener.v3.Listener"):
                    if filter_name not in op.get("jsonPath", ""):
                        bad(
                            f"{label}: listener patch jsonPath {op.get('jsonPath')!r} does not "
                            f"select the filter Envoy Gateway names {filter_name}"
                        )
                    if not op.get("jsonPath", "").endswith(".typed_config.config") or op["op"] != "add":
                        bad(f"{label}: listener patches must add to ...typed_config.config")
                    pc[op["path"].strip("/")] = op["value"]
                elif jp["type"].endswith("cluster.v3.Cluster") and op["op"] == "add" and not op.get("path"):
                    if op["value"].get("name") != jp["name"]:
                        bad(f"{label}: added cluster name {op['value'].get('name')} != {jp['name']}")
                    added.append(op["value"])
                else:
                    bad(f"{label}: unexpected patch {jp['type']} {op}")
        check_filter_settings(label + " (after EnvoyPatchPolicy)", pc)
        for policy in btps:
            check_gateway_circuit_breaker(label, policy)
        headers = [
            e.get("header")
            for b in btps
            for e in b["spec"].get("loadBalancer", {}).get("endpointOverride", {}).get("extractFrom", [])
        ]
        route = next((r for r in eep["spec"].get("targetRefs", []) if r["kind"] == "HTTPRoute"), None)
        eg_cluster = f"httproute/{eep['metadata']['namespace']}/{route['name']}/rule/0" if route else None
        if not any(
            r.get("kind") == "HTTPRoute" and r.get("name") == (route or {}).get("name")
            for b in btps
            for r in b["spec"].get("targetRefs", [])
        ):
            bad(f"{label}: the BackendTrafficPolicy must target the same HTTPRoute as the EnvoyExtensionPolicy")
        check_platform_links(label, cfg, headers, added, eg_cluster, 19000)
        lb_type = btps[0]["spec"]["loadBalancer"]["type"] if btps else "LeastRequest"
        fallback = {"LeastRequest": "least_request", "RoundRobin": "round_robin", "Random": "random"}.get(
            lb_type, "least_request"
        )
        camel = {"least_request": "LeastRequest", "round_robin": "RoundRobin", "random": "Random"}
        merge = {
            "load_balancing_policy": {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": OVERRIDE_HOST,
                                "override_host_sources": [{"header": h} for h in headers],
                                "fallback_policy": {
                                    "policies": [
                                        {
                                            "typed_extension_config": {
                                                "name": f"envoy.load_balancing_policies.{fallback}",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions."
                                                    f"load_balancing_policies.{fallback}.v3."
                                                    f"{camel[fallback]}"
                                                },
                                            }
                                        }
                                    ]
                                },
                            },
                        }
                    }
                ]
            }
        }
        envoy_validate(bootstrap({"@type": WASM_FILTER, "config": pc}, workers_cluster(cfg, merge), added), label)


def smoke_env(compose_json):
    """Shell assignments for the smoke run: loopback ports for the workers,
    the listener and the admin API, and the simulator arguments the compose
    file gives its workers."""
    with open(compose_json) as f:
        compose = json.load(f)
    workers = {}
    args = None
    for svc in compose["services"].values():
        cmd = svc.get("command") or []
        if "--listen" in cmd:
            workers[cmd[cmd.index("--listen") + 1]] = None
            i = cmd.index("--listen")
            args = cmd[:i] + cmd[i + 2 :]
    socks = [socket.socket() for _ in range(len(workers) + 2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    print("LISTENER=%d" % ports[0])
    print("ADMIN=%d" % ports[1])
    print("SIM_ARGS=%s" % shlex.quote(" ".join(args or [])))
    print(
        "WORKER_MAP=%s" % shlex.quote(" ".join(f"{addr}={port}" for addr, port in zip(workers, ports[2:], strict=True)))
    )


def main(argv):
    global ROOT, TMP, WASM_REL, WASM, ENVOY
    if argv[1:2] == ["smoke-env"]:
        smoke_env(Path(os.environ["TMP"]) / "compose.json")
        return 0
    ROOT = Path(os.environ["ROOT"])
    TMP = Path(os.environ["TMP"])
    WASM_REL = os.environ["WASM"]
    WASM = ROOT / WASM_REL
    ENVOY = os.environ["ENVOY"]
    _, _, compose_envoy = check_envoy_configs()
    check_compose(compose_envoy)
    check_dockerfiles()
    manifests = load_manifests()
    check_istio(manifests)
    check_envoy_gateway(manifests)
    if errors:
        print(f"\n{len(errors)} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
