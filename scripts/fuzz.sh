#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for N seconds each (default 30) and
# fails if any of them crashes (panic, failed property, timeout, OOM).
#
#   scripts/fuzz.sh [seconds-per-target]
#
# Each target runs as
#   cargo +nightly fuzz run <target> corpus/<t> seeds/<t> [regressions/<t>] -- -max_total_time=N
# so the committed seeds and the inputs that once found a bug (regressions/<t>)
# are replayed before the fuzzer mutates anything; new inputs go to the
# untracked fuzz/corpus/<t>. A crash leaves its input in fuzz/artifacts/<t>/
# (copy it to fuzz/regressions/<t>/ once the bug is fixed). libFuzzer's own
# output goes to fuzz/logs/<t>.log; the script prints one line per target
# and the log's tail when a target fails.
#
# Environment:
#   FUZZ_TARGETS     targets to run (default: all, from `cargo fuzz list`)
#   FUZZ_SANITIZER   cargo-fuzz --sanitizer (default none: dprank is safe
#                    Rust, and without ASan builds and runs are ~2x faster)
#   FUZZ_JOBS        libFuzzer -jobs/-workers (default 1)
# Budget: the first build takes ~1 min on 2 cores, then N s per target (5
# targets; with the first 4, `scripts/fuzz.sh 20` took 2.5 min from a clean
# fuzz/target).
set -euo pipefail

secs="${1:-30}"
case "$secs" in
    '' | *[!0-9]*) echo "usage: $0 [seconds-per-target]" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "== installing the nightly toolchain" >&2
    if ! rustup toolchain install nightly --profile minimal; then
        # cargo-fuzz needs nightly; a machine that cannot fetch toolchains
        # still runs every other test. Say so loudly rather than fail them.
        echo "== fuzz smoke SKIPPED: no nightly toolchain on this machine and none could be installed" >&2
        exit 0
    fi
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

sanitizer="${FUZZ_SANITIZER:-none}"
jobs="${FUZZ_JOBS:-1}"
targets="${FUZZ_TARGETS:-$(cargo +nightly fuzz list)}"

mkdir -p logs
echo "== building fuzz targets (sanitizer: $sanitizer; log in fuzz/logs/build.log)" >&2
if ! cargo +nightly fuzz build --sanitizer "$sanitizer" > logs/build.log 2>&1; then
    tail -n 40 logs/build.log >&2
    echo "== fuzz build FAILED" >&2
    exit 1
fi

failed=()
for t in $targets; do
    mkdir -p "corpus/$t"
    dirs=("corpus/$t")
    [ -d "seeds/$t" ] && dirs+=("seeds/$t")
    [ -d "regressions/$t" ] && dirs+=("regressions/$t")
    args=(-max_total_time="$secs" -timeout=10 -print_final_stats=1)
    [ "$jobs" -gt 1 ] && args+=(-jobs="$jobs" -workers="$jobs")
    case "$t" in
        body_rewrite | load_report | config) args+=(-dict=dicts/json.dict) ;;
        vllm_metrics) args+=(-dict=dicts/prometheus.dict) ;;
    esac
    log="logs/$t.log"
    if cargo +nightly fuzz run --sanitizer "$sanitizer" "$t" "${dirs[@]}" -- "${args[@]}" > "$log" 2>&1; then
        runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
        corpus="$(find "corpus/$t" -type f | wc -l)"
        echo "fuzz $t: ok, ${runs:-?} runs in ${secs}s, corpus ${corpus} inputs" >&2
    else
        tail -n 60 "$log" >&2
        echo "fuzz $t: FAILED (input in fuzz/artifacts/$t/, log in fuzz/$log)" >&2
        failed+=("$t")
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "== fuzzing failed: ${failed[*]}" >&2
    exit 1
fi
echo "== fuzzing passed: $(echo $targets)" >&2
