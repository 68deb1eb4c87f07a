#!/usr/bin/env bash
# Per-kernel GPU time of one eager inference (no GEMM tuning, so every kernel belongs to the
# inference), through Nsight Compute, summed by kernel family. Run after bench/device.sh built.
# Usage: bench/profile.sh [pi0 bench options...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT"
root=$PWD/.deps/root; lib=$root/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib/openblas-openmp:$lib:${LD_LIBRARY_PATH:-}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
PI0_GEMM_TUNE=0 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    build/pi0 bench --warmup 0 --iters 1 "$@" > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || { tail -20 "$OUT/ncu.err"; exit 1; }
python3 - "$OUT/ncu.csv" <<'PY'
import csv, collections, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
name, value = head.index("Kernel Name"), head.index("Metric Value")
# The inference starts at the first image kernel: what ran before it is the model's load (the weights' upload).
first = next((i for i, r in enumerate(rows) if re.search(r"im2col_kernel|frames_to_images", r[name])), 0)
rows = rows[first:]
def kernel_name(k):  # "void <unnamed>::skinny_kernel<1, 8, 1, 0>(<unnamed>::SkinnyParams)" -> "skinny_kernel"
    return re.sub(r"[<(].*", "", re.sub(r"^void\s+", "", k.replace("<unnamed>::", "")))
fam = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    k = r[name]
    key = "cublas gemm" if re.search(r"gemm|sm90_|cutlass|xmma|Kernel2", k) else kernel_name(k)
    fam[key][0] += 1
    fam[key][1] += float(r[value].replace(",", "")) / 1e3  # ns -> us
total = sum(v[1] for v in fam.values())
print(f"{'kernel family':<40} {'count':>6} {'total us':>10} {'mean us':>8} {'share':>6}")
for k, (n, t) in sorted(fam.items(), key=lambda kv: -kv[1][1]):
    print(f"{k[:40]:<40} {n:>6} {t:>10.1f} {t / n:>8.2f} {100 * t / total:>5.1f}%")
print(f"{'total (kernels back to back, no gaps)':<40} {sum(v[0] for v in fam.values()):>6} {total:>10.1f}")
# One layer of each stack in launch order: the first vision layer and the first prefix layer.
names = [kernel_name(r[name])[:60] for r in rows]
times = [float(r[value].replace(",", "")) / 1e3 for r in rows]
starts = {"vision (from the patch embedding)": 0}
if "assemble_prefix_kernel" in names: starts["prefix (from the embedding)"] = names.index("assemble_prefix_kernel")
for label, at in starts.items():
    print(f"\n{label}:")
    for n, t in list(zip(names, times))[at:at + 13]: print(f"  {t:9.2f} us  {n}")
PY
