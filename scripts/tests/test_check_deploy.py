"""Unit tests of the pure parts of scripts/check_deploy.py (no Envoy, no YAML files)."""

import io
import json
import os
import sys
import tempfile
import unittest
from collections import namedtuple
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import check_deploy as cd  # noqa: E402

FILTER = {
    "@type": cd.WASM_FILTER,
    "config": {
        "allow_on_headers_stop_iteration": True,
        "failure_policy": "FAIL_RELOAD",
        "vm_config": {"vm_id": "dprank", "code": {"local": {"filename": "x.wasm"}}},
        "configuration": {"value": json.dumps({"workers": [{"address": "127.0.0.1:30001"}]})},
    },
}


def cluster(name, *addresses, header=None):
    c = {
        "name": name,
        "load_assignment": {
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": a, "port_value": p}}}}
                        for a, p in addresses
                    ]
                }
            ]
        },
    }
    if header:
        c["load_balancing_policy"] = {
            "policies": [
                {
                    "typed_extension_config": {
                        "typed_config": {"@type": cd.OVERRIDE_HOST, "override_host_sources": [{"header": header}]}
                    }
                }
            ]
        }
    return c


def bootstrap(admin_port=9901, listener_port=10000, workers=("127.0.0.1:30001",)):
    f = json.loads(json.dumps(FILTER))
    f["config"]["configuration"]["value"] = json.dumps({"workers": [{"address": w} for w in workers]})
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"address": {"socket_address": {"port_value": listener_port}}, "filters": [f]}],
            "clusters": [cluster("sglang", ("127.0.0.1", 30001), header="x-dprank-endpoint")],
        },
    }


class Walking(unittest.TestCase):
    def setUp(self):
        cd.errors.clear()
        quiet = redirect_stdout(io.StringIO())
        quiet.__enter__()
        self.addCleanup(quiet.__exit__, None, None, None)

    def test_plugin_configs_and_dprank_json(self):
        doc = bootstrap()
        service = {"@type": cd.WASM_SERVICE, "singleton": True, "config": {}}
        doc["bootstrap_extensions"] = [{"typed_config": service}]
        kinds = [kind for kind, _ in cd.plugin_configs(doc)]
        self.assertEqual(sorted(kinds), ["filter", "service"])
        pc = next(pc for kind, pc in cd.plugin_configs(doc) if kind == "filter")
        self.assertEqual(cd.dprank_json(pc)["workers"][0]["address"], "127.0.0.1:30001")
        self.assertEqual(cd.dprank_json({}), {})

    def test_cluster_headers_and_endpoints(self):
        c = cluster("sglang", ("10.0.0.1", 1), ("10.0.0.2", 2), header="x-pick")
        self.assertEqual(cd.override_headers(c), ["x-pick"])
        self.assertEqual(cd.endpoints(c), {"10.0.0.1:1", "10.0.0.2:2"})
        self.assertEqual(cd.override_headers(cluster("plain")), [])

    def test_routed_workers_per_mode(self):
        self.assertEqual(cd.routed_workers({"workers": [{"address": "a:1"}]}), {"a:1"})
        self.assertEqual(cd.routed_workers({"decode_workers": [{"address": "d:1"}]}), {"d:1"})
        self.assertIsNone(cd.routed_workers({"workers_from_cluster": {"cluster": "s"}}))

    def test_settings_checks_record_problems(self):
        cd.check_filter_settings("x", FILTER["config"])
        self.assertEqual(cd.errors, [])
        cd.check_filter_settings("x", {"failure_policy": "FAIL_OPEN"})
        self.assertEqual(len(cd.errors), 2)
        cd.check_poll_cluster("x", {"type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED"})
        self.assertIn("use_http_header", cd.errors[-1])
        cd.check_poll_cluster("x", None)
        self.assertIn("missing", cd.errors[-1])

    def test_clusters_carrying_requests_must_raise_envoys_1024_limits(self):
        c = cluster("sglang", ("10.0.0.1", 1))
        cd.check_circuit_breakers("x", c)
        self.assertIn("max_connections=1024", cd.errors[-1])
        raised = {key: 65536 for key in cd.THRESHOLDS}
        cd.errors.clear()
        cd.check_circuit_breakers("x", dict(c, circuit_breakers={"thresholds": [raised]}))
        self.assertEqual(cd.errors, [])
        # Only the default priority counts; a HIGH entry raises nothing.
        high = dict(raised, priority="HIGH")
        cd.check_circuit_breakers("x", dict(c, circuit_breakers={"thresholds": [high]}))
        self.assertEqual(len(cd.errors), 1)
        cd.check_circuit_breakers("x", dict(c, circuit_breakers={"thresholds": [dict(raised, max_requests=2048)]}))
        self.assertIn("max_requests=2048", cd.errors[-1])
        self.assertNotIn("max_connections", cd.errors[-1])

    def test_envoy_gateway_policy_must_raise_its_circuit_breaker(self):
        cd.check_gateway_circuit_breaker("x", {"spec": {}})
        self.assertEqual(len(cd.errors), 1)
        breaker = {"maxConnections": 65536, "maxPendingRequests": 65536, "maxParallelRequests": 65536}
        cd.check_gateway_circuit_breaker("x", {"spec": {"circuitBreaker": breaker}})
        self.assertEqual(len(cd.errors), 1)

    def test_admin_cluster_must_point_at_envoys_admin(self):
        cd.check_admin_cluster("x", cluster("dprank_admin", ("127.0.0.1", 9901)), "127.0.0.1:9901")
        self.assertEqual(cd.errors, [])
        cd.check_admin_cluster("x", cluster("dprank_admin", ("127.0.0.1", 9902)), "127.0.0.1:9901")
        self.assertEqual(len(cd.errors), 1)

    def test_normalised_ignores_only_deployment_details(self):
        a = bootstrap()
        b = bootstrap(admin_port=19901, listener_port=20000, workers=("10.0.0.1:1", "10.0.0.2:1"))
        self.assertEqual(cd.normalised(a), cd.normalised(b))
        c = bootstrap()
        c["static_resources"]["listeners"][0]["filters"][0]["config"]["failure_policy"] = "FAIL_OPEN"
        self.assertNotEqual(cd.normalised(a), cd.normalised(c))

    def test_the_vllm_config_compares_to_the_shipped_one_but_for_names_and_engine(self):
        shipped = bootstrap()
        vllm = json.loads(json.dumps(shipped).replace('"sglang"', '"vllm"'))
        pc = vllm["static_resources"]["listeners"][0]["filters"][0]["config"]
        pc["configuration"]["value"] = json.dumps({"engine": "vllm", "workers": [{"address": "10.0.0.9:8000"}]})
        self.assertEqual(cd.as_shipped_for_sglang(vllm), cd.normalised(shipped))
        pc["failure_policy"] = "FAIL_OPEN"
        self.assertNotEqual(cd.as_shipped_for_sglang(vllm), cd.normalised(shipped))

    def test_workers_cluster_stands_in_for_the_platforms(self):
        c = cd.workers_cluster({"workers": [{"address": "[::1]:8000"}, {"address": "10.0.0.1:1"}]})
        self.assertEqual(c["name"], "workers")
        self.assertEqual(cd.endpoints(c), {"::1:8000", "10.0.0.1:1"})
        d = cd.workers_cluster({"workers_from_cluster": {"cluster": "sglang"}}, {"type": "EDS"})
        self.assertEqual((d["name"], d["type"]), ("sglang", "EDS"))


class DockerIgnore(unittest.TestCase):
    def test_last_matching_pattern_wins_and_parents_match(self):
        pats = ["target", "!target/wasm32-wasip1/release/dprank.wasm", "*.md"]
        self.assertFalse(cd.included("target/release/x", pats))
        self.assertTrue(cd.included("target/wasm32-wasip1/release/dprank.wasm", pats))
        self.assertFalse(cd.included("README.md", pats))
        self.assertTrue(cd.included("docs/protocol.md", pats), "* does not cross /")
        self.assertTrue(cd.included("src/lib.rs", []))


class SmokeEnv(unittest.TestCase):
    def test_ports_and_simulator_arguments_from_the_compose_file(self):
        compose = {
            "services": {
                "a": {"command": ["--listen", "172.28.0.11:30000", "--dp-size", "4"]},
                "b": {"command": ["--listen", "172.28.0.12:30000", "--dp-size", "4"]},
                "envoy": {"image": "envoyproxy/envoy:v1.40.0"},
            }
        }
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "compose.json")
            with open(path, "w") as f:
                json.dump(compose, f)
            out = io.StringIO()
            with redirect_stdout(out):
                cd.smoke_env(path)
        lines = dict(line.split("=", 1) for line in out.getvalue().splitlines())
        self.assertEqual(sorted(lines), ["ADMIN", "LISTENER", "SIM_ARGS", "WORKER_MAP"])
        self.assertEqual(lines["SIM_ARGS"], "'--dp-size 4'")
        pairs = lines["WORKER_MAP"].strip("'").split()
        self.assertEqual([p.split("=")[0] for p in pairs], ["172.28.0.11:30000", "172.28.0.12:30000"])
        ports = {int(lines["ADMIN"]), int(lines["LISTENER"])} | {int(p.split("=")[1]) for p in pairs}
        self.assertEqual(len(ports), 4, "distinct free ports")


Cmd = namedtuple("Cmd", "cmd flags value")


def parse(text):
    """A stand-in for dockerfile.parse_string: one command per line, no
    continuation lines (enough for these tests)."""
    out = []
    for line in text.strip().splitlines():
        words = line.split()
        n = 1
        while n < len(words) and words[n].startswith("--"):
            n += 1
        flags, rest = tuple(words[1:n]), words[n:]
        value = (" ".join(rest),) if words[0] == "RUN" else tuple(rest)
        out.append(Cmd(words[0], flags, value))
    return out


WASM_IMAGE = """
FROM rust:1.95-slim-trixie AS build
RUN rustup target add wasm32-wasip1
COPY src ./src
RUN --mount=type=cache,target=/src/target cargo build --release --locked --target wasm32-wasip1 -p dprank && install -D x /out/dprank.wasm
FROM envoyproxy/envoy:v1.40.0 AS envoy
COPY --from=build /out/dprank.wasm /etc/dprank/dprank.wasm
FROM scratch AS plugin
COPY --from=build /out/dprank.wasm /plugin.wasm
"""


class Dockerfiles(unittest.TestCase):
    def setUp(self):
        cd.errors.clear()
        quiet = redirect_stdout(io.StringIO())
        quiet.__enter__()
        self.addCleanup(quiet.__exit__, None, None, None)

    def test_stages_copies_and_cargo_builds(self):
        stages = cd.build_stages(parse(WASM_IMAGE))
        self.assertEqual(
            [(st["name"], st["base"]) for st in stages],
            [
                ("build", "rust:1.95-slim-trixie"),
                ("envoy", "envoyproxy/envoy:v1.40.0"),
                ("plugin", "scratch"),
            ],
        )
        self.assertIs(cd.stage_named(stages, None), stages[-1], "no target: the last stage")
        self.assertIsNone(cd.stage_named(stages, "nope"))
        self.assertEqual(cd.copies(stages[1]), [("build", ["/out/dprank.wasm"], "/etc/dprank/dprank.wasm")])
        self.assertEqual(cd.copies(stages[0]), [(None, ["src"], "./src")])
        (build,) = cd.cargo_builds(stages[0])
        self.assertTrue(build.startswith("cargo build") and "install" not in build)
        self.assertEqual(cd.cargo_packages(build), ["dprank"])
        self.assertEqual(
            cd.cargo_packages("cargo build -p dprank-sim --package=dprank-bench"), ["dprank-sim", "dprank-bench"]
        )

    def test_the_shipped_layout_passes(self):
        stages = cd.build_stages(parse(WASM_IMAGE))
        cd.check_wasm_build("x", stages)
        cd.check_envoy_stage("x", stages[1], "/etc/dprank/dprank.wasm")
        self.assertEqual(cd.errors, [])

    def test_broken_layouts_are_reported(self):
        cases = {
            "no stage runs cargo build": WASM_IMAGE.replace("-p dprank", "-p other"),
            "must add the wasm32-wasip1 target": WASM_IMAGE.replace("RUN rustup target add wasm32-wasip1\n", ""),
            "last (default) stage": WASM_IMAGE.replace(
                "COPY --from=build /out/dprank.wasm /plugin.wasm", "COPY target/x.wasm /plugin.wasm"
            ),
            "one COPY": WASM_IMAGE + "COPY --from=build /out/dprank.wasm /again.wasm\n",
            "FROM scratch": WASM_IMAGE + "FROM debian AS later\n",
            "no `envoy` stage": WASM_IMAGE.replace("AS envoy", "AS other"),
        }
        for expected, text in cases.items():
            cd.errors.clear()
            cd.check_wasm_build("x", cd.build_stages(parse(text)))
            self.assertTrue(any(expected in e for e in cd.errors), f"{expected}: {cd.errors}")

    def test_envoy_stage_pins_envoy_and_copies_the_filter_where_the_config_reads_it(self):
        stages = cd.build_stages(parse(WASM_IMAGE))
        cd.check_envoy_stage("x", stages[1], "/elsewhere/dprank.wasm")
        self.assertEqual(len(cd.errors), 1)
        for base in ("envoyproxy/envoy:latest", "envoyproxy/envoy:v1.34.0", "nginx:1.40.0"):
            cd.errors.clear()
            cd.check_envoy_stage("x", dict(stages[1], base=base), "/etc/dprank/dprank.wasm")
            self.assertEqual(len(cd.errors), 1, base)

    def test_mounts_must_be_repository_files(self):
        with tempfile.TemporaryDirectory() as root:
            services = {
                "envoy": {
                    "volumes": [
                        {"type": "bind", "source": f"{root}/docker/envoy-compose.yaml"},
                        {"type": "bind", "source": f"{root}/target/wasm32-wasip1/release/dprank.wasm"},
                        {"type": "volume", "source": "data"},
                    ]
                },
                "client": {"volumes": [{"type": "bind", "source": "/etc/passwd"}]},
            }
            out = cd.mounts_outside_repository(services, {"docker/envoy-compose.yaml"}, root)
        self.assertEqual(
            out,
            [("envoy", f"{root}/target/wasm32-wasip1/release/dprank.wasm"), ("client", "/etc/passwd")],
        )


if __name__ == "__main__":
    unittest.main()
