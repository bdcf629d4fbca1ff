"""Unit tests of the pure parts of scripts/check_deploy.py (no Envoy, no YAML files)."""

import io
import json
import os
import sys
import tempfile
import unittest
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


if __name__ == "__main__":
    unittest.main()
