#!/usr/bin/env python3
"""convert_bench.py - how long `pi0 convert` takes on a real-size openpi checkpoint.

Writes a checkpoint of random weights in openpi's JAX layout (the param tree of openpi's Pi0 or Pi0.5
model: PaliGemma/img (SigLIP So400m/14), PaliGemma/llm (Gemma-2B + the Gemma-300M action expert as the
`_1` params, scanned over layers), the action heads) as openpi releases them: params/ written by orbax's
PyTreeCheckpointer (OCDBT + zarr) and assets/<id>/norm_stats.json. It uses orbax when it is installed
(as on the GPU machines, which have jax, orbax-checkpoint and tensorstore but no package registry), else
writes the same layout with tensorstore. Then it times `pi0 convert` on it and prints the time, the
conversion's own convert/verify split, throughput and the peak memory of the conversion.

    python3 bench/convert_bench.py --pi0 build/pi0 --out /tmp/convert_bench           # Pi0, real size
    python3 bench/convert_bench.py --pi0 build/pi0 --out /tmp/cb --model pi05 --lora --source-dtype bf16
    python3 bench/convert_bench.py --pi0 build/pi0 --out /tmp/cb --tiny               # the fixtures' dims
    python3 bench/convert_bench.py --pi0 build/pi0 --out /tmp/cb --depth 3            # real widths, 3 layers

The real size takes ~13 GB of disk and ~30 GB of memory with float32 source params (half with bf16).
--lora adds the LoRA params of openpi's gemma_2b_lora / gemma_300m_lora (ranks 16 and 32).
"""
import argparse
import copy
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import tensorstore as ts

try:
    import orbax.checkpoint as ocp
except ImportError:
    ocp = None

# (width, depth, mlp_dim, num_heads, head_dim) of the vision tower; Gemma stacks add num_kv_heads.
REAL = {"vision": dict(width=1152, depth=27, mlp=4304, heads=16, head_dim=72), "patch": 14, "positions": 256,
        "llm": dict(width=2048, depth=18, mlp=16384, heads=8, kv_heads=1, head_dim=256),
        "expert": dict(width=1024, depth=18, mlp=4096, heads=8, kv_heads=1, head_dim=256),
        "vocab": 257152, "action_dim": 32}
TINY = {"vision": dict(width=64, depth=2, mlp=128, heads=4, head_dim=16), "patch": 14, "positions": 256,
        "llm": dict(width=64, depth=3, mlp=160, heads=4, kv_heads=1, head_dim=32),
        "expert": dict(width=48, depth=3, mlp=96, heads=4, kv_heads=1, head_dim=32),
        "vocab": 512, "action_dim": 32}
LORA_RANKS = {"llm": 16, "expert": 32}  # openpi's gemma_2b_lora and gemma_300m_lora


class Weights:
    """Random arrays of one dtype, drawn from one seeded generator."""

    def __init__(self, dtype, seed=0):
        self.rng, self.dtype, self.count = np.random.default_rng(seed), dtype, 0

    def __call__(self, *shape):
        self.count += int(np.prod(shape))
        return (self.rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(self.dtype)


def vision_tree(d, w):
    v, W = d["vision"], d["vision"]["width"]
    L, F, N, H = v["depth"], v["mlp"], v["heads"], v["head_dim"]
    attn = {name: {"kernel": w(L, W, N, H), "bias": w(L, N, H)} for name in ("query", "key", "value")}
    attn["out"] = {"kernel": w(L, N, H, W), "bias": w(L, W)}
    block = {"LayerNorm_0": {"scale": w(L, W), "bias": w(L, W)}, "LayerNorm_1": {"scale": w(L, W), "bias": w(L, W)},
             "MlpBlock_0": {"Dense_0": {"kernel": w(L, W, F), "bias": w(L, F)},
                            "Dense_1": {"kernel": w(L, F, W), "bias": w(L, W)}},
             "MultiHeadDotProductAttention_0": attn}
    return {"embedding": {"kernel": w(d["patch"], d["patch"], 3, W), "bias": w(W)},
            "pos_embedding": w(1, d["positions"], W),
            "Transformer": {"encoderblock": block, "encoder_norm": {"scale": w(W), "bias": w(W)}},
            "head": {"kernel": w(W, d["llm"]["width"]), "bias": w(d["llm"]["width"])}}


def einsum_param(w, shape, rank):
    """openpi's lora.Einsum params: `w`, and with LoRA lora_a (last axis -> rank), lora_b (the one before)."""
    p = {"w": w(*shape)}
    if rank:
        p["lora_a"], p["lora_b"] = w(*shape[:-1], rank), w(*shape[:-2], rank, shape[-1])
    return p


def gemma_layers(g, suffix, w, adaptive, rank):
    """One expert's params under PaliGemma/llm/layers (openpi's gemma.py Block, scanned over depth)."""
    L, D, F, N, K, H = g["depth"], g["width"], g["mlp"], g["heads"], g["kv_heads"], g["head_dim"]
    attn = {f"q_einsum{suffix}": einsum_param(w, (L, N, D, H), rank),
            f"kv_einsum{suffix}": einsum_param(w, (L, 2, K, D, H), rank),
            f"attn_vec_einsum{suffix}": einsum_param(w, (L, N, H, D), rank)}
    mlp = {"gating_einsum": w(L, 2, D, F), "linear": w(L, F, D)}
    if rank:
        mlp.update(gating_einsum_lora_a=w(L, 2, D, rank), gating_einsum_lora_b=w(L, 2, rank, F),
                   linear_lora_a=w(L, F, rank), linear_lora_b=w(L, rank, D))
    def norm():  # Pi0.5's expert has adaRMSNorms: a Dense (D -> 3D) of the time conditioning instead of a scale
        return {"Dense_0": {"kernel": w(L, D, 3 * D), "bias": w(L, 3 * D)}} if adaptive else {"scale": w(L, D)}
    return attn, {f"mlp{suffix}": mlp, f"pre_attention_norm{suffix}": norm(), f"pre_ffw_norm{suffix}": norm()}


def openpi_tree(d, kind, w, lora):
    """The whole param tree of openpi's Pi0 (kind "pi0") or Pi0.5 ("pi05"), as `{"params": ...}`."""
    pi05 = kind == "pi05"
    llm_attn, llm_rest = gemma_layers(d["llm"], "", w, False, LORA_RANKS["llm"] if lora else 0)
    exp_attn, exp_rest = gemma_layers(d["expert"], "_1", w, pi05, LORA_RANKS["expert"] if lora else 0)
    We, A = d["expert"]["width"], d["action_dim"]
    final_1 = {"Dense_0": {"kernel": w(We, 3 * We), "bias": w(3 * We)}} if pi05 else {"scale": w(We)}
    llm = {"embedder": {"input_embedding": w(d["vocab"], d["llm"]["width"])},
           "layers": {"attn": {**llm_attn, **exp_attn}, **llm_rest, **exp_rest},
           "final_norm": {"scale": w(d["llm"]["width"])}, "final_norm_1": final_1}
    linear = lambda d_in, d_out: {"kernel": w(d_in, d_out), "bias": w(d_out)}  # noqa: E731
    heads = {"action_in_proj": linear(A, We), "action_out_proj": linear(We, A)}
    if pi05:
        heads.update(time_mlp_in=linear(We, We), time_mlp_out=linear(We, We))
    else:
        heads.update(state_proj=linear(A, We), action_time_mlp_in=linear(2 * We, We),
                     action_time_mlp_out=linear(We, We))
    return {"params": {"PaliGemma": {"img": vision_tree(d, w), "llm": llm}, **heads}}


def flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def orbax_chunks(array, limit=2**31):
    """Chunks of at most 2 GiB, split along the first axis: orbax splits arrays larger than its OCDBT target data
    file size (2 GiB on local disks) into chunks no larger than that."""
    row_bytes = array.nbytes // max(array.shape[0], 1)
    return [max(1, min(array.shape[0], limit // max(row_bytes, 1))), *array.shape[1:]]


def save_with_tensorstore(params_dir, tree):
    """orbax's layout without orbax: each leaf a zarr v2 array (zstd level 1) named by its key path joined with
    dots, in one OCDBT database, and _METADATA listing the tree."""
    kvstore = {"driver": "ocdbt", "base": "file://" + params_dir + "/"}
    context, tree_metadata = ts.Context(), {}
    for path, array in flatten(tree):
        store = ts.open({"driver": "zarr", "kvstore": kvstore, "path": ".".join(path),
                         "metadata": {"compressor": {"id": "zstd", "level": 1}, "chunks": orbax_chunks(array)}},
                        create=True, dtype=ts.dtype(array.dtype.name), shape=array.shape, context=context).result()
        store.write(array).result()
        tree_metadata[str(path)] = {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                                    "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False,
                                                       "write_shape": list(array.shape)}}
    with open(os.path.join(params_dir, "_METADATA"), "w") as f:
        json.dump({"tree_metadata": tree_metadata, "use_ocdbt": True, "use_zarr3": False}, f)


def write_checkpoint(out, kind, dims, source_dtype, lora):
    src = os.path.join(out, f"{kind}_openpi_jax")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(os.path.join(src, "assets", "bench_robot"))
    w = Weights(source_dtype)
    tree = openpi_tree(dims, kind, w, lora)
    t0 = time.monotonic()
    if ocp:
        ocp.PyTreeCheckpointer().save(os.path.join(src, "params"), tree)
    else:
        os.makedirs(os.path.join(src, "params"))
        save_with_tensorstore(os.path.join(src, "params"), tree)
    stats = {"mean": [0.0] * 8, "std": [1.0] * 8, "q01": [-1.0] * 8, "q99": [1.0] * 8}
    with open(os.path.join(src, "assets", "bench_robot", "norm_stats.json"), "w") as f:
        json.dump({"norm_stats": {"state": stats, "actions": stats}}, f)
    print(f"wrote {src}: {w.count / 1e9:.3f}B params in {np.dtype(source_dtype).name} with "
          f"{'orbax ' + ocp.__version__ if ocp else 'tensorstore (no orbax here)'} in {time.monotonic() - t0:.1f} s",
          flush=True)
    return src, w.count


def time_convert(pi0, src, dst, dtype, extra):
    cmd = [pi0, "convert", src, dst, "--dtype", dtype, "--force", "--json", *extra]
    t0 = time.monotonic()
    run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    seconds = time.monotonic() - t0
    if run.returncode:
        sys.exit(f"convert_bench: `{' '.join(cmd)}` exited {run.returncode}")
    return seconds, json.loads(run.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pi0", default="build/pi0", help="the pi0 binary (default build/pi0)")
    p.add_argument("--out", required=True, help="work directory (the checkpoint and its conversion go here)")
    p.add_argument("--model", choices=("pi0", "pi05", "both"), default="pi0")
    p.add_argument("--tiny", action="store_true", help="the fixtures' tiny dims instead of the real size")
    p.add_argument("--depth", type=int, help="this many layers in every stack (real widths, less memory and disk)")
    p.add_argument("--source-dtype", choices=("f32", "bf16"), default="f32", help="dtype of the written params")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16", help="pi0 convert --dtype")
    p.add_argument("--lora", action="store_true", help="add openpi's gemma_2b_lora / gemma_300m_lora params")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: delete them after timing)")
    args = p.parse_args()
    dims = copy.deepcopy(TINY if args.tiny else REAL)
    for stack in ("vision", "llm", "expert"):
        dims[stack]["depth"] = args.depth or dims[stack]["depth"]
    source_dtype = np.float32 if args.source_dtype == "f32" else ts.bfloat16.numpy_dtype
    # Other than at the real dims the stacks are none of openpi's LoRA variants, so the alphas must be given
    # (= rank, as the variants have); at the real dims pi0 convert must infer them.
    extra = ["--lora-alpha", "llm=16,expert=32"] if args.lora and dims != REAL else []
    results = []
    for kind in (("pi0", "pi05") if args.model == "both" else (args.model,)):
        # in a process of its own: a child inherits its parent's peak RSS (Linux keeps it across fork and exec),
        # so the conversion's reported peak memory would be the generator's otherwise
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            src, count = pool.apply(write_checkpoint, (args.out, kind, dims, source_dtype, args.lora))
        dst = os.path.join(args.out, f"{kind}_converted")
        seconds, summary = time_convert(args.pi0, src, dst, args.dtype, extra)
        peak_gb = summary["peak_memory_bytes"] / 1e9
        out_gb, source_gb = summary["bytes"] / 1e9, count * np.dtype(source_dtype).itemsize / 1e9
        split = summary["seconds"]
        print(f"pi0 convert {kind}{' +lora' if args.lora else ''}: {seconds:.1f} s ({split['convert']:.1f} convert + "
              f"{split['verify']:.1f} verify + start-up), {count / 1e9:.3f}B params: {source_gb:.2f} GB "
              f"{args.source_dtype} read ({source_gb / seconds:.2f} GB/s) -> {out_gb:.2f} GB {args.dtype}, "
              f"peak memory {peak_gb:.1f} GB", flush=True)
        results.append({"model": kind, "seconds": seconds, "summary": summary, "peak_gb": peak_gb})
        if not args.keep:
            shutil.rmtree(src)
            shutil.rmtree(dst)
    print(json.dumps([{"model": r["model"], "seconds": round(r["seconds"], 2), "peak_gb": round(r["peak_gb"], 2),
                       "convert_s": r["summary"]["seconds"]["convert"], "verify_s": r["summary"]["seconds"]["verify"],
                       "bytes": r["summary"]["bytes"]} for r in results]))


if __name__ == "__main__":
    main()
