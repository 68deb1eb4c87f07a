#!/usr/bin/env bash
# Everything a GPU session needs, in one call of the device machine: unpack the carried Debian
# packages (OpenBLAS, jansson), build for sm_90a, run the GPU tests, then the benchmarks.
# Usage (on the device): bench/device.sh [tests|bench|all]; logs go to $OUT (or ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT"
what=${1:-all}

# Carried packages (.deps/*.deb, see README "GPU") unpack into a local prefix.
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD/.deps/root
unpack() { # a .deb is an ar archive holding data.tar.*; dpkg -x when there is a dpkg
    if command -v dpkg >/dev/null; then dpkg -x "$1" "$root"; return; fi
    local tmp; tmp=$(mktemp -d); (cd "$tmp" && ar x "$OLDPWD/$1" && tar -xf data.tar.* -C "$root"); rm -rf "$tmp"
}
if [ ! -d "$root" ]; then mkdir -p "$root"; for deb in .deps/*.deb; do unpack "$deb"; done; fi
lib=$root/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib/openblas-openmp:$lib:${LD_LIBRARY_PATH:-}
export PI0_FIXTURES=${PI0_FIXTURES:-$PWD/.fixtures}   # carried copy of ../shared/fixtures
make_args=(BLAS_CFLAGS="-I$root/usr/include/x86_64-linux-gnu/openblas-openmp" BLAS_LIBS="-L$lib/openblas-openmp -lopenblas"
           JSON_CFLAGS="-I$root/usr/include" JSON_LIBS="-L$lib -ljansson"
           CUDA_ARCHS="-gencode arch=compute_90a,code=sm_90a")

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
make -j16 "${make_args[@]}" all > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
make -j16 "${make_args[@]}" $(ls tests/gpu/test_*.c | sed 's#tests/gpu/\(.*\)\.c#build/tests/gpu/\1#') >> "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }

if [ "$what" = tests ] || [ "$what" = all ]; then
    PI0_BIN=build/pi0 tests/run.sh build/tests/gpu/test_* 2>&1 | tee "$OUT/test-gpu.log" | grep -E '^(ok|FAIL|broken|[0-9]+ passed)'
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    run() { echo "## build/pi0 bench $*"; build/pi0 bench "$@" --json; }
    {
        run                                              # seed workload: B=1, 3 cameras (1 masked), H=10
        run --masked-cameras 0                           # 3 valid cameras
        run --horizon 50
        for b in 1 2 4 8 16 32 64; do run --batch $b --iters 30 --warmup 5; done
    } > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
    python3 bench/table.py "$OUT/bench.jsonl"
fi
