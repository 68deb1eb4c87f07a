#!/usr/bin/env bash
# The host footprint of a GPU deployment (make test-gpu): a real-size bf16 checkpoint loaded on the cuda
# backend leaves the process at most 2 GB of its own memory (RssAnon: the page cache and the mapped
# checkpoint do not count), its weights streamed to the GPU as they are stored. Timed twice: with the
# checkpoint evicted from the page cache (cold) and again (warm). Writes a 6.6 GB checkpoint under
# $PI0_FOOTPRINT_DIR (default /tmp; kept for later runs).
set -u
pi0=${PI0_BIN:-build/pi0}
dir=${PI0_FOOTPRINT_DIR:-/tmp}/pi0_footprint_bf16
limit_gb=2.0
passed=0; failed=0
result() { # name, ok (0/1), detail
    if [ "$2" = 1 ]; then passed=$((passed + 1)); echo "ok   $1: $3"; else failed=$((failed + 1)); echo "FAIL $1: $3"; fi
}
if [ ! -f "$dir/model.safetensors" ]; then
    "$pi0" init --output "$dir" --bf16 >&2 || { echo "FAIL footprint: pi0 init --bf16 failed"; echo "0 passed, 1 failed"; exit 1; }
fi
evict() { # drop the checkpoint's pages from the page cache (no root needed)
    python3 -c 'import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$dir/model.safetensors"
}
for cache in cold warm; do
    [ $cache = cold ] && evict
    out=$("$pi0" bench --checkpoint "$dir" --backend cuda --warmup 3 --iters 20 --json) || {
        result "load_$cache" 0 "pi0 bench failed"; continue; }
    echo "$out" >&2
    line=$(python3 -c 'import json, sys
o = json.loads(sys.argv[1])
print(o["load_s"], o["host_memory_after_load_gb"], o["peak_host_memory_gb"], o["peak_gpu_memory_gb"], o["latency_ms"]["p50"])' "$out")
    read -r load_s host_gb peak_gb gpu_gb p50 <<< "$line"
    ok=$(python3 -c "print(int($host_gb <= $limit_gb))")
    result "load_$cache" "$ok" "load ${load_s} s, host memory after load ${host_gb} GB (limit ${limit_gb}), peak host RSS ${peak_gb} GB (with mapped pages), GPU ${gpu_gb} GB, p50 ${p50} ms"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
