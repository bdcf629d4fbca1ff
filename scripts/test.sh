#!/usr/bin/env bash
# Runs every test suite of `make test` (after the build and lint steps) and
# ends with a summary: one line per suite, then the totals.
#
#   scripts/test.sh [fuzz-seconds-per-target]     (default 15)
#
# Every suite runs even when an earlier one fails; the exit status is
# non-zero if any failed. Each suite's output is shown as it runs and kept in
# target/test-logs/<suite>.log.
set -uo pipefail
cd "$(dirname "$0")/.."

fuzz_secs="${1:-15}"
logs=target/test-logs
mkdir -p "$logs"

summary=()
passed=0
failed=0
status=0

# run <name> <command...>: runs a suite, keeps its log, returns its status.
run() {
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$logs/$name.log"
    return "${PIPESTATUS[0]}"
}

# record <name> <rc> <passed> <failed> <what>
record() {
    local verdict=ok
    if [ "$2" != 0 ] || [ "$4" != 0 ]; then
        verdict=FAILED
        status=1
    fi
    passed=$((passed + $3))
    failed=$((failed + $4))
    summary+=("$(printf '%-8s %-6s %s' "$1" "$verdict" "$5")")
}

# Sums cargo's "test result:" lines of a log: "<passed> <failed>".
cargo_counts() {
    sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1 \2/p' "$1" |
        awk '{ p += $1; f += $2 } END { print p + 0, f + 0 }'
}

run rust cargo test --workspace --release --no-fail-fast -- --test-threads 2
rc=$?
read -r p f < <(cargo_counts "$logs/rust.log")
# A build failure runs no test: count it as one failure.
[ "$rc" != 0 ] && [ "$f" = 0 ] && f=1
record rust "$rc" "$p" "$f" "$p passed, $f failed (unit, simulator, end-to-end in Envoy; cargo test)"

# The overhead benchmark's no-op filter is a workspace of its own.
run noop cargo test --release --manifest-path bench/noop-filter/Cargo.toml --target-dir target
rc=$?
read -r p f < <(cargo_counts "$logs/noop.log")
[ "$rc" != 0 ] && [ "$f" = 0 ] && f=1
record noop "$rc" "$p" "$f" "$p passed, $f failed (the overhead benchmark's no-op filter; cargo test)"

run python python3 -m unittest discover -s scripts/tests
rc=$?
ran=$(sed -n 's/^Ran \([0-9]*\) tests\{0,1\} in .*/\1/p' "$logs/python.log" | tail -n 1)
bad=$(sed -n 's/^FAILED (\(.*\))$/\1/p' "$logs/python.log" | grep -o '[0-9]\+' | awk '{ s += $1 } END { print s + 0 }')
ran=${ran:-0}
[ "$rc" != 0 ] && [ "$bad" = 0 ] && bad=1
record python "$rc" "$((ran - bad > 0 ? ran - bad : 0))" "$bad" "$((ran - bad > 0 ? ran - bad : 0)) passed, $bad failed (scripts' unit tests)"

run links python3 scripts/check_links.py
rc=$?
# One line per broken link, then the verdict line (check-links: ...).
bad=$(grep -vc '^check-links: ' "$logs/links.log")
[ "$rc" != 0 ] && [ "$bad" = 0 ] && bad=1
record links "$rc" "$((bad == 0 ? 1 : 0))" "$bad" "$(tail -n 1 "$logs/links.log" | sed 's/^check-links: //') (scripts/check_links.py)"

run deploy ./scripts/check-deploy.sh
rc=$?
ok=$(grep -c '^ok  ' "$logs/deploy.log")
bad=$(grep -c '^BAD ' "$logs/deploy.log")
[ "$rc" != 0 ] && [ "$bad" = 0 ] && bad=1
record deploy "$rc" "$ok" "$bad" "$ok checks passed, $bad failed (deployment files, Envoy validation, compose smoke)"

run fuzz ./scripts/fuzz.sh "$fuzz_secs"
rc=$?
ok=$(grep -c '^fuzz .*: ok' "$logs/fuzz.log")
bad=$(grep -c '^fuzz .*: FAILED' "$logs/fuzz.log")
if grep -q 'fuzz smoke SKIPPED' "$logs/fuzz.log"; then
    what="skipped (no nightly toolchain)"
else
    [ "$rc" != 0 ] && [ "$bad" = 0 ] && bad=1
    what="$ok targets passed, $bad failed (${fuzz_secs}s each)"
fi
record fuzz "$rc" "$ok" "$bad" "$what"

echo
echo "== summary (logs in $logs/)"
printf '%s\n' "${summary[@]}"
echo "total: $passed passed, $failed failed"
exit "$status"
