#!/usr/bin/env bash
# Runs every test program given on the command line and adds up their "N passed, N failed" lines.
set -u
passed=0; failed=0; broken=()
logs=${PI0_LOG_DIR:-build/logs}; mkdir -p "$logs"
for t in "$@"; do
    log="$logs/$(basename "$t").log"
    out=$("$t" 2>"$log"); rc=$?
    printf '%s\n' "$out"
    line=$(printf '%s\n' "$out" | tail -n 1)
    if [[ $line =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
        passed=$((passed + BASH_REMATCH[1])); failed=$((failed + BASH_REMATCH[2]))
        [ $rc -eq 0 ] || [ "${BASH_REMATCH[2]}" -gt 0 ] || { failed=$((failed + 1)); broken+=("$t (exit $rc)"); }
    else
        failed=$((failed + 1)); broken+=("$t (exit $rc, no summary)")
    fi
    if [ $rc -ne 0 ]; then echo "--- $t stderr (last 40 lines) ---"; tail -n 40 "$log"; fi
done
for b in "${broken[@]+"${broken[@]}"}"; do echo "broken: $b"; done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
