#!/usr/bin/env bash
# A kernel launched as a programmatic dependent (one that calls griddepcontrol.wait) starts while the kernel before is
# still writing, and must read that output only after its wait. ptxas keeps a weak load after the wait and keeps one
# issued before the wait in the source before it; a non-coherent load (ld.global.nc: `__ldg`, or a `const __restrict__`
# pointer the compiler proves read-only) it moves across the wait either way (bench/NOTES.md, session 23: the skinny
# kernels' x). So no such kernel has a non-coherent load, constants included: this compiles each CUDA source to PTX
# for sm_90a (the build whose kernels wait) and checks every kernel. Needs nvcc ($NVCC, else the one on PATH).
set -u
nvcc=${NVCC:-$(command -v nvcc 2>/dev/null)}
if [ -z "$nvcc" ]; then
    echo "skip pdl_loads: no nvcc (the CUDA toolkit) to compile the kernels with"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
passed=0; failed=0
for src in src/cuda/*.cu; do
    name=pdl_loads_$(basename "$src" .cu)
    if ! "$nvcc" -ptx -O3 -std=c++17 -arch=compute_90a --expt-relaxed-constexpr -DPI0_SM90A_BUILD -Iinclude -Isrc \
         "$src" -o "$tmp/k.ptx" 2>"$tmp/err"; then
        failed=$((failed + 1)); echo "FAIL $name: nvcc -ptx failed"; tail -n 20 "$tmp/err"; continue
    fi
    # Per kernel (.entry to the next): whether it waits and how many non-coherent loads it has. First line: the kernels
    # and how many wait; then one line per kernel that has both.
    report=$(awk '/^(\.visible |\.weak )?\.entry /{ k = $NF; sub(/\($/, "", k); order[++n] = k }
                  n && /griddepcontrol\.wait/ { waits[k]++ }
                  n && /ld\.global\.nc/ { nc[k]++ }
                  END { for (i = 1; i <= n; i++) waiting += waits[order[i]] > 0
                        print n, waiting
                        for (i = 1; i <= n; i++) if (waits[order[i]] && nc[order[i]])
                            printf "  %s: %d non-coherent loads\n", order[i], nc[order[i]] }' "$tmp/k.ptx")
    read -r kernels waiting <<< "${report%%$'\n'*}"
    bad=$(printf '%s\n' "$report" | tail -n +2)
    if [ -n "$bad" ]; then
        failed=$((failed + 1)); echo "FAIL $name: kernels that wait for the kernel before and read through ld.global.nc"
        printf '%s\n' "$bad"
    else
        passed=$((passed + 1)); echo "ok   $name: $kernels kernels, $waiting of them wait (griddepcontrol.wait), none reads through ld.global.nc"
    fi
done

# The prefix's gate|up (gate_up.cu) copies its first stages' weights before its wait and its tokens, the norm's output,
# after it. The GPU test cannot force the race a token copy before the wait would open (the kernel's blocks take whole
# multiprocessors, which the norm leaves only as it ends), so the order is checked here, in the PTX of each of its
# kernels: after the first weight copy (a tensor load into the cluster's shared memory, not multicast) comes a
# griddepcontrol.wait, and only then the first token copy (the multicast ones).
name=pdl_order_gate_up
if ! "$nvcc" -ptx -O3 -std=c++17 -arch=compute_90a --expt-relaxed-constexpr -DPI0_SM90A_BUILD -Iinclude -Isrc \
     src/cuda/gate_up.cu -o "$tmp/g.ptx" 2>"$tmp/err"; then
    failed=$((failed + 1)); echo "FAIL $name: nvcc -ptx failed"; tail -n 20 "$tmp/err"
else
    report=$(awk '/^(\.visible |\.weak )?\.entry / { k = $NF; sub(/\($/, "", k); gu = k ~ /gate_up_gelu_kernel/; if (gu) { n++; w[k] = 0; ok[k] = 0; bad[k] = 0; order[n] = k } }
                  gu && /cp\.async\.bulk\.tensor.*shared::cluster\.global/ {
                      if (/multicast/) { if (!(w[k] == 2)) bad[k] = 1; else ok[k] = 1 }
                      else if (w[k] == 0) w[k] = 1 }
                  gu && /griddepcontrol\.wait/ && w[k] == 1 { w[k] = 2 }
                  END { for (i = 1; i <= n; i++) print order[i], (ok[order[i]] && !bad[order[i]]) ? "ordered" : "UNORDERED" }' "$tmp/g.ptx")
    if [ -z "$report" ] || printf '%s\n' "$report" | grep -q UNORDERED; then
        failed=$((failed + 1)); echo "FAIL $name: a token copy is not after the wait that follows the first weight copies"
        printf '%s\n' "${report:-  no gate_up_gelu_kernel in the PTX}"
    else
        passed=$((passed + 1)); echo "ok   $name: $(printf '%s\n' "$report" | wc -l) kernels copy weights, wait, then tokens"
    fi
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
