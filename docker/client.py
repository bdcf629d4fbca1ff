#!/usr/bin/env python3
"""The compose demo's client: a short workload through Envoy + dprank, then
the per-worker, per-rank result.

It waits until Envoy is ready and dprank has polled every worker, sends
REQUESTS generate requests of varied prompt and output lengths from a few
concurrent connections, and prints where they went, twice: as the workers saw
it (the x-sim-worker / x-sim-dp-rank response headers of the simulator) and
as dprank counted it (Envoy's wasmcustom.dprank.routed.* stats, read from the
admin API). Standard library only; runs in the python:3 slim image.

Environment (defaults are the compose service names):
  ENVOY_URL  http://envoy:10000     the listener
  ADMIN_URL  http://envoy:9901      Envoy's admin API
  REQUESTS   50                     requests to send
  CLIENTS    8                      concurrent connections
  WAIT_S     60                     how long to wait for Envoy and the polls
Exit status: 0 when every request succeeded and every one was routed by
dprank (its routed.* counters add up to the requests sent), 1 otherwise.
"""

import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ENVOY_URL = os.environ.get("ENVOY_URL", "http://envoy:10000").rstrip("/")
ADMIN_URL = os.environ.get("ADMIN_URL", "http://envoy:9901").rstrip("/")
REQUESTS = int(os.environ.get("REQUESTS", "50"))
CLIENTS = int(os.environ.get("CLIENTS", "8"))
WAIT_S = float(os.environ.get("WAIT_S", "60"))

WORDS = "the quick brown fox jumps over a lazy dog while ranks fill and drain".split()


def get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode("utf-8", "replace")


def stats(prefix):
    """Envoy counters/gauges whose name starts with prefix, as {name: int}."""
    _, text = get(f"{ADMIN_URL}/stats?filter=^{prefix}")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name.startswith(prefix) and value.strip().lstrip("-").isdigit():
            out[name] = int(value)
    return out


def wait_until_ready():
    """Envoy answers /ready and every worker has been polled at least once."""
    deadline = time.monotonic() + WAIT_S
    last = "nothing yet"
    while time.monotonic() < deadline:
        try:
            status, _ = get(f"{ADMIN_URL}/ready", timeout=2)
            polled = stats("wasmcustom.dprank.poll_ok.")
            if status == 200 and polled and all(v > 0 for v in polled.values()):
                print(f"envoy ready; dprank has polled {len(polled)} worker(s)")
                return
            last = f"ready={status}, polled={polled or 'none'}"
        except (urllib.error.URLError, OSError) as err:
            last = str(err)
        time.sleep(0.5)
    sys.exit(f"client: envoy or the load polls not ready after {WAIT_S:.0f}s ({last})")


def make_request(i, rng):
    # Mostly short prompts, some long ones: the case round robin handles badly.
    words = rng.choice([8, 16, 32, 64, 128, 512, 2048])
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    max_new = rng.choice([16, 32, 64, 128, 256])
    body = {"text": f"[{i}] {prompt}", "sampling_params": {"max_new_tokens": max_new}}
    return json.dumps(body).encode(), words, max_new


def send(args):
    i, payload = args
    request = urllib.request.Request(
        f"{ENVOY_URL}/generate",
        data=payload,
        headers={"content-type": "application/json"},
        method="POST",
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return (
                i,
                response.status,
                response.headers.get("x-sim-worker", "?"),
                response.headers.get("x-sim-dp-rank", "?"),
                time.monotonic() - started,
            )
    except urllib.error.HTTPError as err:
        return i, err.code, err.headers.get("x-sim-worker", "?"), "?", time.monotonic() - started
    except (urllib.error.URLError, OSError) as err:
        return i, f"error: {err}", "?", "?", time.monotonic() - started


def main():
    wait_until_ready()
    before = stats("wasmcustom.dprank.routed.")
    rng = random.Random(42)
    work = []
    sizes = Counter()
    for i in range(REQUESTS):
        payload, words, max_new = make_request(i, rng)
        work.append((i, payload))
        sizes[words] += 1
    print(f"sending {REQUESTS} POST /generate over {CLIENTS} connections; prompt words: {dict(sorted(sizes.items()))}")
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        results = list(pool.map(send, work))
    elapsed = time.monotonic() - started

    failed = [r for r in results if r[1] != 200]
    by_rank = Counter((r[2], r[3]) for r in results if r[1] == 200)
    by_worker = Counter(r[2] for r in results if r[1] == 200)
    print(f"\n{len(results) - len(failed)}/{len(results)} succeeded in {elapsed:.1f}s")
    for r in failed[:5]:
        print(f"  request {r[0]} failed: {r[1]}")

    print("\nas the workers saw it (x-sim-worker, x-sim-dp-rank):")
    for worker in sorted(by_worker):
        ranks = {rank: n for (w, rank), n in sorted(by_rank.items()) if w == worker}
        line = "  ".join(f"rank {rank}: {n:3d}" for rank, n in ranks.items())
        print(f"  {worker:<22} {by_worker[worker]:3d} requests   {line}")

    after = stats("wasmcustom.dprank.routed.")
    routed = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0}
    print("\nas dprank counted it (Envoy stats wasmcustom.dprank.routed.<worker>.rank_<r>):")
    for name, n in sorted(routed.items()):
        print(f"  {name.removeprefix('wasmcustom.dprank.routed.'):<22} {n:3d}")
    other = stats("wasmcustom.dprank.")
    notable = {
        k.removeprefix("wasmcustom.dprank."): v
        for k, v in other.items()
        if v and (".passthrough." in k or ".rejected." in k or "poll_failed" in k)
    }
    if notable:
        print(f"\nother dprank counters: {notable}")

    total_routed = sum(routed.values())
    ok = not failed and total_routed == REQUESTS
    print(f"\n{'OK' if ok else 'FAILED'}: {total_routed} of {REQUESTS} requests routed by dprank")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
