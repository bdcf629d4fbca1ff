"""Unit tests of the pure parts of scripts/soak.py: the rendered Envoy config
and the parsing of the load generator's and curl's logs."""

import os
import socket
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import soak  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent


class Render(unittest.TestCase):
    def test_the_shipped_config_gets_our_ports_workers_wasm_and_access_log(self):
        with tempfile.TemporaryDirectory() as tmp:
            dst = os.path.join(tmp, "envoy.yaml")
            soak.render(
                str(ROOT / "envoy/dprank.yaml"), dst, 24001, 24002, "/w/dprank.wasm", "/w/access.log", [1, 2, 3]
            )
            text = Path(dst).read_text()
        self.assertIn("port_value: 24001", text)
        self.assertIn("port_value: 24002", text)
        self.assertNotIn("port_value: 9901", text)
        self.assertIn("filename: /w/dprank.wasm", text)
        for name, port in zip(soak.NAMES, [1, 2, 3], strict=True):
            self.assertIn(f'{{"address": "127.0.0.1:{port}", "name": "{name}"}}', text)
            self.assertIn(f"address: 127.0.0.1, port_value: {port} }}", text)
        self.assertNotIn("30001", text)
        self.assertIn("path: /w/access.log", text)

    def test_a_config_it_cannot_render_stops_the_soak(self):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "other.yaml")
            with open(src, "w") as f:
                f.write("admin: {}\n")
            with self.assertRaises(SystemExit):
                soak.render(src, os.path.join(tmp, "out.yaml"), 1, 2, "w", "a", [3])


class Logs(unittest.TestCase):
    def write(self, text):
        f = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        f.write(text)
        f.close()
        self.addCleanup(os.unlink, f.name)
        return f.name

    def test_load_runs_reads_finished_runs_only(self):
        path = self.write(
            "=== run 1 seed 1 start 100.5 wall 30\n"
            "load: 60 sent, 58 ok, 2 errors\n"
            "error: connection reset\n"
            "=== end 1 131.0 rc 0\n"
            "=== run 2 seed 2 start 131.5 wall 30\n"
            "load: 3 sent, 3 ok, 0 errors\n"
        )
        runs = soak.load_runs(path)
        self.assertEqual(len(runs), 1, "the unfinished run is left out")
        r = runs[0]
        self.assertEqual(
            (r["run"], r["seed"], r["start"], r["wall_s"], r["end"], r["rc"]), (1, 1, 100.5, 30.0, 131.0, 0)
        )
        self.assertEqual((r["sent"], r["ok"], r["errors"]), (60, 58, 2))
        self.assertEqual(r["examples"], ["connection reset"])
        self.assertEqual(soak.load_runs("/nonexistent/load.log"), [])

    def test_curl_records_skip_short_lines(self):
        path = self.write("1.0\t2.5\tcurl-0-chat\tchat\t200\t0\tworker_a\t1\t-\nbroken line\n")
        recs = soak.curl_records(path)
        self.assertEqual(len(recs), 1)
        self.assertEqual((recs[0]["kind"], recs[0]["code"], recs[0]["ok"], recs[0]["end"]), ("chat", "200", True, 2.5))

    def test_report_cells(self):
        self.assertEqual(soak.fmt(None), "n/a")
        self.assertEqual(soak.fmt(1.234, ".1f"), "1.2")
        self.assertEqual(soak.esc("a|b"), "a\\|b")


class Ports(unittest.TestCase):
    def test_free_ports_are_consecutive_and_bindable(self):
        ports = soak.free_ports(3)
        self.assertEqual(ports, list(range(ports[0], ports[0] + 3)))
        for p in ports:
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            s.close()


if __name__ == "__main__":
    unittest.main()
