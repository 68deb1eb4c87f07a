#!/usr/bin/env bash
# smoke.sh DIR [SECONDS] - runs every libFuzzer harness in DIR (`make fuzz` builds them into build-fuzz/fuzz/) for
# SECONDS each (default 30), starting from the seed corpus the harness writes ($PI0_FUZZ_SEEDS), the inputs of
# past findings (tests/fuzz/regressions/<fuzzer>/, each once a crash, now fixed) and what earlier runs kept in
# DIR/<fuzzer>.corpus/. A crash, sanitizer report, leak or timeout fails the run; the input that caused it is
# kept as DIR/<fuzzer>.crash-* (or leak-*, timeout-*), to replay with `DIR/<fuzzer> FILE`, and belongs in
# tests/fuzz/regressions/<fuzzer>/ once fixed.
# To fuzz one harness longer, e.g. an hour on both cores:
#   PI0_FUZZ_SEEDS=/tmp/seeds build-fuzz/fuzz/fuzz_policy && build-fuzz/fuzz/fuzz_policy -max_total_time=3600 \
#     -jobs=2 -workers=2 build-fuzz/fuzz/fuzz_policy.corpus /tmp/seeds
# Ends with "N passed, N failed": one per harness.
set -u
regressions=$(dirname "$0")/regressions
dir=${1:?usage: tests/fuzz/smoke.sh DIR [SECONDS]}
seconds=${2:-30}
export OMP_NUM_THREADS=1 # one inference thread: libFuzzer measures coverage per input, not per thread
passed=0; failed=0
for fuzzer in "$dir"/fuzz_*; do
    [ -x "$fuzzer" ] && [ -f "$fuzzer" ] || continue
    name=$(basename "$fuzzer")
    seeds=$(mktemp -d)
    mkdir -p "$fuzzer.corpus"
    corpora=("$fuzzer.corpus" "$seeds")
    [ -d "$regressions/$name" ] && corpora+=("$regressions/$name")
    log="$fuzzer.log"
    if PI0_FUZZ_SEEDS="$seeds" "$fuzzer" >"$log" 2>&1 &&
        "$fuzzer" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
            -artifact_prefix="$fuzzer." "${corpora[@]}" >>"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        echo "ok   $name: ${runs:-?} inputs in ${seconds} s, corpus $(ls "$fuzzer.corpus" | wc -l) files"
        passed=$((passed + 1))
    else
        echo "FAIL $name (log: $log)"
        grep -E "^(==[0-9]+==ERROR|SUMMARY|.*runtime error)" "$log" | head -5
        failed=$((failed + 1))
    fi
    rm -rf "$seeds"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
