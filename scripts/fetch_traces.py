"""Fetches the public Mooncake FAST'25 traces the benchmark replays and
checks each file against its git blob id at the pinned commit (and its
sha256 where one is pinned), so a replay runs on exactly the published file.

    python3 scripts/fetch_traces.py [--dir DIR] [--from LOCAL_DIR] [NAME ...]

Writes to DIR (default target/traces/mooncake, where dprank-bench looks
unless --trace-dir or DPRANK_TRACE_DIR says otherwise). --from copies and
checks local copies instead of downloading. NAME is a file name
(conversation_trace.jsonl, ...); default: all three. A file that fails its
check is not kept. The list and ids are those of bench/src/workload/traces.rs.
"""

import argparse
import hashlib
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

COMMIT = "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb"
BASE = f"https://raw.githubusercontent.com/kvcache-ai/Mooncake/{COMMIT}/FAST25-release/traces/"
# name: (git blob id, sha256 or None)
TRACES = {
    "conversation_trace.jsonl": (
        "5a371794b81d7fc7487ec8a02a2c631bcc7fbdf8",
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
    ),
    "synthetic_trace.jsonl": (
        "e4838049c0dcfc358a5f24ab08251279475cba94",
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    ),
    "toolagent_trace.jsonl": ("b765599d1e0828b37f68d481563c385d3c11de54", None),
}


def git_blob_id(data):
    """What `git hash-object` prints for a file holding `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check(name, data):
    """None if `data` is the published `name`, else what is wrong."""
    blob, sha256 = TRACES[name]
    got = git_blob_id(data)
    if got != blob:
        return f"{name}: git blob {got}, expected {blob}"
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return f"{name}: sha256 {hashlib.sha256(data).hexdigest()}, expected {sha256}"
    return None


def fetch(name, source):
    """The bytes of `name`: from the local directory `source`, else downloaded."""
    if source is not None:
        return (Path(source) / name).read_bytes()
    with urllib.request.urlopen(BASE + name, timeout=120) as response:
        return response.read()


def store(name, data, directory):
    """Writes `data` to directory/name through a temporary file (no partial file is left)."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as tmp:
        tmp.write(data)
    shutil.move(tmp.name, directory / name)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="target/traces/mooncake")
    parser.add_argument("--from", dest="source", default=None, help="copy from this local directory")
    parser.add_argument("names", nargs="*", default=sorted(TRACES))
    args = parser.parse_args(argv)
    failed = 0
    for name in args.names:
        if name not in TRACES:
            print(f"{name}: not one of {', '.join(sorted(TRACES))}", file=sys.stderr)
            failed += 1
            continue
        try:
            data = fetch(name, args.source)
        except OSError as err:
            print(f"{name}: cannot fetch: {err}", file=sys.stderr)
            failed += 1
            continue
        problem = check(name, data)
        if problem:
            print(f"{problem}; not kept", file=sys.stderr)
            failed += 1
            continue
        store(name, data, Path(args.dir))
        print(f"{name}: {len(data)} bytes, checked, in {args.dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
