"""Unit tests of scripts/fetch_traces.py without the network: the checks and
the copy from a local directory."""

import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fetch_traces  # noqa: E402


class Checks(unittest.TestCase):
    def test_the_git_blob_id_is_what_git_computes(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "f"
            path.write_bytes(b"hello\n")
            expected = subprocess.run(
                ["git", "hash-object", str(path)], capture_output=True, text=True, check=True
            ).stdout.strip()
        self.assertEqual(fetch_traces.git_blob_id(b"hello\n"), expected)

    def test_a_wrong_file_is_refused_and_not_kept(self):
        self.assertIn("git blob", fetch_traces.check("synthetic_trace.jsonl", b"{}\n"))
        with tempfile.TemporaryDirectory() as src, tempfile.TemporaryDirectory() as dst:
            (Path(src) / "synthetic_trace.jsonl").write_bytes(b"not the trace\n")
            code = fetch_traces.main(["--from", src, "--dir", dst, "synthetic_trace.jsonl"])
            self.assertEqual(code, 1)
            self.assertEqual(list(Path(dst).iterdir()), [])

    def test_unknown_names_fail(self):
        with tempfile.TemporaryDirectory() as dst:
            self.assertEqual(fetch_traces.main(["--dir", dst, "nope.jsonl"]), 1)


if __name__ == "__main__":
    unittest.main()
