#!/usr/bin/env bash
# Runs every test program given on the command line and adds up their closing lines,
# "N passed, N failed" or "N passed, N failed, N skipped". A program prints one line per test:
# "ok   NAME", "FAIL NAME" or "skip NAME: why". A skipped test is never counted as passed.
#
# PI0_NO_SKIPS=1 (CI sets it) turns every skip into a failure, except the tests named in
# PI0_ALLOWED_SKIPS (space-separated names): a group the README promises must have run.
set -u
passed=0; failed=0; skipped=0; broken=()
logs=${PI0_LOG_DIR:-build/logs}; mkdir -p "$logs"
allowed=" ${PI0_ALLOWED_SKIPS:-} "
for t in "$@"; do
    log="$logs/$(basename "$t").log"
    out=$("$t" 2>"$log"); rc=$?
    printf '%s\n' "$out"
    line=$(printf '%s\n' "$out" | tail -n 1)
    if [[ $line =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed(,\ ([0-9]+)\ skipped)?$ ]]; then
        passed=$((passed + BASH_REMATCH[1])); failed=$((failed + BASH_REMATCH[2])); skipped=$((skipped + ${BASH_REMATCH[4]:-0}))
        [ $rc -eq 0 ] || [ "${BASH_REMATCH[2]}" -gt 0 ] || { failed=$((failed + 1)); broken+=("$t (exit $rc)"); }
    else
        failed=$((failed + 1)); broken+=("$t (exit $rc, no summary)")
    fi
    if [ "${PI0_NO_SKIPS:-0}" = 1 ]; then
        while read -r name; do
            [[ $allowed == *" $name "* ]] && continue
            failed=$((failed + 1)); broken+=("$t: $name was skipped, and PI0_NO_SKIPS=1 requires it")
        done < <(printf '%s\n' "$out" | sed -n 's/^skip \([^ :]*\):.*/\1/p')
    fi
    if [ $rc -ne 0 ]; then echo "--- $t stderr (last 40 lines) ---"; tail -n 40 "$log"; fi
done
for b in "${broken[@]+"${broken[@]}"}"; do echo "broken: $b"; done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
