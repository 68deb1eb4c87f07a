#!/usr/bin/env python3
"""convert_openpi.py - `pi0 convert`: an openpi JAX/orbax checkpoint to the PyTorch format pi0 loads.

    python3 tools/convert_openpi.py SRC DST [--dtype bf16|f32] [--lora-alpha llm=A,expert=A] [--rslora]
                                    [--action-horizon N] [--max-token-len N] [--force] [--json]

openpi releases and trains its checkpoints as `SRC/params/` (orbax PyTreeCheckpointer: an OCDBT
key-value store of zarr arrays) with `SRC/assets/<asset_id>/norm_stats.json` beside it. This writes
DST/model.safetensors (names and layouts of openpi's examples/convert_jax_model_to_pytorch.py,
PI0_SPEC.md §5 and §8), DST/config.json (action_dim, variants, precision, a `dims` block read from the
param shapes, and action_horizon / max_token_len when given: the params do not store them) and copies
SRC/assets to DST/assets.

The param tree alone says what the model is (Pi0 or Pi0.5; Pi0-FAST and anything else are refused),
never the path. LoRA fine-tunes are merged the way openpi applies them (lora.py). Every param must be
understood: an unknown one stops the conversion with its name. After writing, the file is read back
and every tensor compared with the (merged) source; then DST/model.safetensors appears (a failed run
leaves no file of that name). Progress goes to stderr, the summary to stdout (--json: one JSON object).
Exit status: 0 done, 1 failed (one line on stderr says why), 2 bad command line.

The orbax format is read with tensorstore (Google's library behind orbax itself), not by hand.
"""
import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import mmap
import os
import re
import resource
import shutil
import sys
import time

PROG = "pi0 convert"
# What `pi0 convert` needs, and the pip command for it (the versions this script was tested with).
# tensorstore pulls numpy and ml_dtypes (numpy's bfloat16) with it.
INSTALL = {"numpy": "numpy", "ml_dtypes": "ml_dtypes==0.6.0", "tensorstore": "tensorstore==0.1.86"}
try:
    import ml_dtypes
    import numpy as np
    import tensorstore as ts
    MISSING_MODULE = None
except ImportError as e:
    MISSING_MODULE = e.name

HELP = f"""usage: {PROG} SRC DST [--dtype bf16|f32] [--lora-alpha llm=A,expert=A] [--rslora]
                   [--action-horizon N] [--max-token-len N] [--force] [--json]

Converts an openpi JAX checkpoint (SRC holds params/, written by orbax, and assets/; or SRC is the
params/ directory itself) into DST/model.safetensors + DST/config.json + DST/assets, the format
`pi0 sample|bench|infer|serve --checkpoint DST` loads. Pi0 and Pi0.5 are told apart by their params.
The written file is read back and checked against the source before it gets its name.

  --dtype bf16|f32        tensor dtype in model.safetensors (default bf16, as openpi's converter)
  --lora-alpha llm=A,expert=A
                          LoRA alpha of each stack that carries LoRA params (alpha is not stored in
                          the checkpoint; openpi's gemma_2b_lora (rank 16) and gemma_300m_lora (rank 32)
                          imply alpha = rank; any other rank needs this flag)
  --rslora                the LoRA was rank-stabilized: scale alpha/sqrt(rank) instead of alpha/rank
  --action-horizon N      action_horizon for config.json. The params do not store it: without this
                          flag config.json leaves it out and pi0 infer/serve take the adapter's
                          (openpi's configs: pi0_droid 10, pi05_droid 15, pi05_libero 10, others 50)
  --max-token-len N       max_token_len for config.json (not stored either; left out, pi0 uses
                          openpi's defaults: 48 for Pi0, 200 for Pi0.5)
  --force                 replace an existing DST/model.safetensors and DST/assets
  --json                  print the summary as one JSON object
"""

VISION = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
LLM = "paligemma_with_expert.paligemma.model.language_model."
EXPERT = "paligemma_with_expert.gemma_expert.model."
PROJECTOR = "paligemma_with_expert.paligemma.model.multi_modal_projector.linear."

# openpi's Gemma variants (gemma.py get_config): (width, depth, mlp_dim, num_heads, num_kv_heads, head_dim),
# and the LoRA rank and alpha of their `_lora` forms (the same for "attn" and "ffn").
GEMMA_VARIANTS = {"gemma_2b": ((2048, 18, 16384, 8, 1, 256), 16, 16.0),
                  "gemma_300m": ((1024, 18, 4096, 8, 1, 256), 32, 32.0)}


class ConvertError(Exception):
    """A failure explained in one line: the conversion stops and `pi0 convert` exits 1."""


class UsageError(Exception):
    """A bad command line: exit 2."""


# ---- reading the orbax checkpoint -------------------------------------------------------------------------


@dataclasses.dataclass
class Leaf:
    """One array of the param tree: its openpi name (`PaliGemma/llm/layers/attn/q_einsum/w`) and its store."""
    key: str
    shape: tuple
    dtype: object
    store: object  # an open tensorstore


def first_line(error):
    """An exception as one line, without the spec tensorstore appends to its messages."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r" \[tensorstore_spec=.*", "", text.splitlines()[0])


def find_params(src):
    """SRC's params/ directory and the assets/ directory beside it (which may not exist)."""
    src = os.path.abspath(src)
    if os.path.isfile(os.path.join(src, "params", "_METADATA")):
        return os.path.join(src, "params"), os.path.join(src, "assets")
    if os.path.isfile(os.path.join(src, "_METADATA")):
        return src, os.path.join(os.path.dirname(src), "assets")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: no such directory")
    steps = sorted((d for d in os.listdir(src) if d.isdigit() and os.path.isdir(os.path.join(src, d, "params"))),
                   key=int)
    if steps:
        raise ConvertError(f"{src} is a training run with checkpoints at steps {', '.join(steps)}: "
                           f"give one of them, e.g. {os.path.join(src, steps[-1])}")
    raise ConvertError(f"{src}: no params/_METADATA (an openpi checkpoint holds params/ written by orbax)")


def read_tree_metadata(params_dir):
    """The key paths of the tree's leaves, and whether the arrays live in OCDBT and zarr3, from _METADATA."""
    path = os.path.join(params_dir, "_METADATA")
    try:
        with open(path, "rb") as f:
            meta = json.load(f)
        paths = [tuple(str(k["key"]) for k in leaf["key_metadata"]) for leaf in meta["tree_metadata"].values()]
        return paths, bool(meta.get("use_ocdbt", False)), bool(meta.get("use_zarr3", False))
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConvertError(f"{path} is not an orbax PyTree metadata file ({first_line(e)})")


def openpi_key(paths):
    """Maps each stored key path to openpi's flat param name, as openpi's restore_params does: both tree forms
    have the params under a top `params` key, and the nnx.State form (written by openpi's training) puts
    every leaf under a `value` key."""
    roots = sorted({p[0] for p in paths})
    if roots != ["params"]:
        raise ConvertError(f"the tree's top-level keys are {roots}, not ['params'] as in openpi's params checkpoints")
    nnx_state = all(p[-1] == "value" for p in paths)
    return {p: "/".join(p[1:-1] if nnx_state else p[1:]) for p in paths}


def open_leaves(params_dir):
    """Opens every array of the checkpoint (reading only its zarr metadata) keyed by openpi name."""
    paths, use_ocdbt, use_zarr3 = read_tree_metadata(params_dir)
    base = "file://" + params_dir + "/"
    kvstore = {"driver": "ocdbt", "base": base} if use_ocdbt else base
    context = ts.Context()  # one for all arrays: the OCDBT manifest and B-tree are read once
    leaves = {}
    for path, key in openpi_key(paths).items():
        # orbax stores each leaf under its key path joined by dots
        spec = {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore, "path": ".".join(path)}
        try:
            store = ts.open(spec, open=True, read=True, context=context).result()
        except Exception as e:  # tensorstore raises ValueError for every storage or format error
            raise ConvertError(f"cannot open param {key} in {params_dir}: {first_line(e)}")
        dtype = store.dtype.numpy_dtype
        if dtype not in (np.float32, ml_dtypes.bfloat16):
            raise ConvertError(f"param {key} is {dtype}: only float32 and bfloat16 params are supported")
        leaves[key] = Leaf(key, tuple(store.shape), dtype, store)
    return leaves


def read_leaf(leaf):
    try:
        return leaf.store.read().result()
    except Exception as e:  # a truncated or corrupt chunk or B-tree node surfaces here
        raise ConvertError(f"cannot read param {leaf.key}: {first_line(e)}")


# ---- what the tree is ---------------------------------------------------------------------------------------


def model_kind(leaves):
    """'pi0' or 'pi05', from the params alone (openpi's own converter looks for "pi05" in the path)."""
    if not any(k.startswith("PaliGemma/llm/") for k in leaves):
        raise ConvertError("not an openpi Pi0/Pi0.5 param tree: no PaliGemma/llm params "
                           f"(top-level names: {', '.join(sorted({k.split('/')[0] for k in leaves}))})")
    if "action_in_proj/kernel" not in leaves and not any(re.match(r"PaliGemma/llm/.*_1(/|$)", k) for k in leaves):
        raise ConvertError("this is a Pi0-FAST checkpoint (PaliGemma alone decodes action tokens; no action expert, "
                           "no action_in_proj): pi0 runs Pi0 and Pi0.5 only")
    pi0_markers = ("state_proj/kernel", "action_time_mlp_in/kernel", "PaliGemma/llm/final_norm_1/scale")
    pi05_markers = ("time_mlp_in/kernel", "PaliGemma/llm/final_norm_1/Dense_0/kernel")
    pi0, pi05 = all(m in leaves for m in pi0_markers), all(m in leaves for m in pi05_markers)
    if pi0 == pi05:
        found = [m for m in pi0_markers + pi05_markers if m in leaves]
        raise ConvertError("neither a Pi0 nor a Pi0.5 tree: Pi0 has state_proj, action_time_mlp_in and "
                           "final_norm_1/scale, Pi0.5 has time_mlp_in and final_norm_1/Dense_0; this one has "
                           f"{', '.join(found) or 'none of them'}")
    return "pi05" if pi05 else "pi0"


def shape_of(leaves, key, rank):
    leaf = leaves.get(key)
    if leaf is None:
        raise ConvertError(f"missing param {key}")
    if len(leaf.shape) != rank:
        raise ConvertError(f"param {key} has shape {leaf.shape}: expected {rank} dimensions")
    return leaf.shape


def gemma_dims(leaves, suffix):
    """A Gemma stack's dims from its einsums: q (L, N, D, H), kv (L, 2, K, D, H), gating (L, 2, D, F)."""
    depth, heads, width, head_dim = shape_of(leaves, f"PaliGemma/llm/layers/attn/q_einsum{suffix}/w", 4)
    kv_heads = shape_of(leaves, f"PaliGemma/llm/layers/attn/kv_einsum{suffix}/w", 5)[2]
    mlp = shape_of(leaves, f"PaliGemma/llm/layers/mlp{suffix}/gating_einsum", 4)[3]
    return {"width": width, "depth": depth, "mlp_dim": mlp, "num_heads": heads, "num_kv_heads": kv_heads,
            "head_dim": head_dim}


def model_dims(leaves):
    """Every dim, from the shapes: unlike the PyTorch format, the JAX tree keeps heads as their own axis."""
    patch, _, _, width = shape_of(leaves, "PaliGemma/img/embedding/kernel", 4)
    depth, _, heads, head_dim = shape_of(leaves, "PaliGemma/img/Transformer/encoderblock/"
                                         "MultiHeadDotProductAttention_0/query/kernel", 4)
    mlp = shape_of(leaves, "PaliGemma/img/Transformer/encoderblock/MlpBlock_0/Dense_0/kernel", 3)[2]
    return {"vision": {"width": width, "depth": depth, "mlp_dim": mlp, "num_heads": heads, "head_dim": head_dim,
                       "patch": patch,
                       "positions": shape_of(leaves, "PaliGemma/img/pos_embedding", 3)[1]},
            "llm": gemma_dims(leaves, ""), "expert": gemma_dims(leaves, "_1"),
            "vocab": shape_of(leaves, "PaliGemma/llm/embedder/input_embedding", 2)[0],
            "action_dim": shape_of(leaves, "action_in_proj/kernel", 2)[0]}


# ---- the mapping: openpi's examples/convert_jax_model_to_pytorch.py ----------------------------------------


@dataclasses.dataclass
class Tensor:
    """One tensor of model.safetensors and how to cut it from its (merged) source param `w`."""
    name: str
    shape: tuple
    cut: object  # w -> array of `shape`


@dataclasses.dataclass
class Param:
    """One param of the JAX tree (stacked over layers where openpi scans them) and the tensors cut from it."""
    key: str
    shape: tuple  # what the dims say it must be
    tensors: list
    lora: object = None  # a Lora to merge in before cutting


def per_layer(depth, name, shape, cut):
    """One tensor per layer `i` of a scanned param, named name.format(i=i), cut from w[i]."""
    return [Tensor(name.format(i=i), shape, lambda w, i=i: cut(w[i])) for i in range(depth)]


def same(w):
    return w


def linear_weight(w):
    """A flax kernel (in, out) as a PyTorch Linear weight (out, in)."""
    return w.T


def vision_params(v, llm_width):
    W, L, F, N, H = v["width"], v["depth"], v["mlp_dim"], v["num_heads"], v["head_dim"]
    P, S = v["patch"], v["positions"]
    block = "PaliGemma/img/Transformer/encoderblock/"
    layer = VISION + "encoder.layers.{i}."
    params = [
        Param("PaliGemma/img/embedding/kernel", (P, P, 3, W),  # HWIO -> OIHW
              [Tensor(VISION + "embeddings.patch_embedding.weight", (W, 3, P, P), lambda w: w.transpose(3, 2, 0, 1))]),
        Param("PaliGemma/img/embedding/bias", (W,), [Tensor(VISION + "embeddings.patch_embedding.bias", (W,), same)]),
        Param("PaliGemma/img/pos_embedding", (1, S, W),
              [Tensor(VISION + "embeddings.position_embedding.weight", (S, W), lambda w: w.reshape(S, W))]),
        Param("PaliGemma/img/Transformer/encoder_norm/scale", (W,),
              [Tensor(VISION + "post_layernorm.weight", (W,), same)]),
        Param("PaliGemma/img/Transformer/encoder_norm/bias", (W,),
              [Tensor(VISION + "post_layernorm.bias", (W,), same)]),
        Param("PaliGemma/img/head/kernel", (W, llm_width),
              [Tensor(PROJECTOR + "weight", (llm_width, W), linear_weight)]),
        Param("PaliGemma/img/head/bias", (llm_width,), [Tensor(PROJECTOR + "bias", (llm_width,), same)]),
    ]
    for jax_name, torch_name in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
        for jax_field, torch_field in (("scale", "weight"), ("bias", "bias")):
            params.append(Param(f"{block}{jax_name}/{jax_field}", (L, W),
                                per_layer(L, f"{layer}{torch_name}.{torch_field}", (W,), same)))
    for dense, name, d_in, d_out in (("Dense_0", "fc1", W, F), ("Dense_1", "fc2", F, W)):
        params.append(Param(f"{block}MlpBlock_0/{dense}/kernel", (L, d_in, d_out),
                            per_layer(L, f"{layer}mlp.{name}.weight", (d_out, d_in), linear_weight)))
        params.append(Param(f"{block}MlpBlock_0/{dense}/bias", (L, d_out),
                            per_layer(L, f"{layer}mlp.{name}.bias", (d_out,), same)))
    attn = block + "MultiHeadDotProductAttention_0/"
    for jax_name, torch_name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        # (D, N, H) -> (N*H, D). openpi writes reshape(-1, D).T, the same bytes because So400m has N*H == D
        params.append(Param(f"{attn}{jax_name}/kernel", (L, W, N, H),
                            per_layer(L, f"{layer}self_attn.{torch_name}.weight", (N * H, W),
                                      lambda w: w.reshape(W, N * H).T)))
        params.append(Param(f"{attn}{jax_name}/bias", (L, N, H),
                            per_layer(L, f"{layer}self_attn.{torch_name}.bias", (N * H,), lambda w: w.reshape(N * H))))
    params.append(Param(f"{attn}out/kernel", (L, N, H, W),
                        per_layer(L, f"{layer}self_attn.out_proj.weight", (W, N * H), lambda w: w.reshape(N * H, W).T)))
    params.append(Param(f"{attn}out/bias", (L, W), per_layer(L, f"{layer}self_attn.out_proj.bias", (W,), same)))
    return params


def gemma_params(g, suffix, prefix, adaptive_norms):
    """A Gemma stack: the LLM (suffix "") or the action expert ("_1", the second expert of openpi's gemma.py)."""
    D, L, F, N, K, H = g["width"], g["depth"], g["mlp_dim"], g["num_heads"], g["num_kv_heads"], g["head_dim"]
    llm = "PaliGemma/llm/"
    layer = prefix + "layers.{i}."
    params = [
        # (N, D, H) -> (N*H, D), head-major rows
        Param(f"{llm}layers/attn/q_einsum{suffix}/w", (L, N, D, H),
              per_layer(L, layer + "self_attn.q_proj.weight", (N * H, D),
                        lambda w: w.transpose(0, 2, 1).reshape(N * H, D))),
        # (N, H, D) -> (D, N*H). openpi's LLM line, transpose(2, 0, 1).reshape(N*H, D), is this only when N*H == D
        Param(f"{llm}layers/attn/attn_vec_einsum{suffix}/w", (L, N, H, D),
              per_layer(L, layer + "self_attn.o_proj.weight", (D, N * H), lambda w: w.reshape(N * H, D).T)),
        Param(f"{llm}layers/mlp{suffix}/linear", (L, F, D),
              per_layer(L, layer + "mlp.down_proj.weight", (D, F), linear_weight)),
    ]
    # kv (2, K, D, H): k = [0], v = [1], each (K, D, H) -> (K*H, D). openpi takes [i, 0, 0]: the same for K = 1
    kv = [Tensor(layer.format(i=i) + f"self_attn.{p}_proj.weight", (K * H, D),
                 lambda w, i=i, c=c: w[i, c].transpose(0, 2, 1).reshape(K * H, D))
          for i in range(L) for c, p in enumerate("kv")]
    gating = [Tensor(layer.format(i=i) + f"mlp.{p}_proj.weight", (F, D), lambda w, i=i, c=c: w[i, c].T)
              for i in range(L) for c, p in enumerate(("gate", "up"))]
    params += [Param(f"{llm}layers/attn/kv_einsum{suffix}/w", (L, 2, K, D, H), kv),
               Param(f"{llm}layers/mlp{suffix}/gating_einsum", (L, 2, D, F), gating)]
    norms = (("pre_attention_norm", "input_layernorm"), ("pre_ffw_norm", "post_attention_layernorm"))
    if adaptive_norms:  # Pi0.5's adaRMSNorm: Dense(D -> 3D) of the time conditioning, (in, out) -> (out, in)
        for jax_name, torch_name in norms:
            base = f"{llm}layers/{jax_name}{suffix}/Dense_0/"
            params.append(Param(base + "kernel", (L, D, 3 * D),
                                per_layer(L, layer + torch_name + ".dense.weight", (3 * D, D), linear_weight)))
            params.append(Param(base + "bias", (L, 3 * D),
                                per_layer(L, layer + torch_name + ".dense.bias", (3 * D,), same)))
        base = f"{llm}final_norm{suffix}/Dense_0/"
        params.append(Param(base + "kernel", (D, 3 * D),
                            [Tensor(prefix + "norm.dense.weight", (3 * D, D), linear_weight)]))
        params.append(Param(base + "bias", (3 * D,), [Tensor(prefix + "norm.dense.bias", (3 * D,), same)]))
    else:
        for jax_name, torch_name in norms:
            params.append(Param(f"{llm}layers/{jax_name}{suffix}/scale", (L, D),
                                per_layer(L, layer + torch_name + ".weight", (D,), same)))
        params.append(Param(f"{llm}final_norm{suffix}/scale", (D,), [Tensor(prefix + "norm.weight", (D,), same)]))
    return params


def projection_params(kind, width, action_dim):
    """The action heads: nnx.Linear kernels (in, out) -> PyTorch (out, in)."""
    shapes = [("action_in_proj", action_dim, width), ("action_out_proj", width, action_dim)]
    if kind == "pi05":
        shapes += [("time_mlp_in", width, width), ("time_mlp_out", width, width)]
    else:
        shapes += [("state_proj", action_dim, width), ("action_time_mlp_in", 2 * width, width),
                   ("action_time_mlp_out", width, width)]
    params = []
    for name, d_in, d_out in shapes:
        params.append(Param(f"{name}/kernel", (d_in, d_out), [Tensor(f"{name}.weight", (d_out, d_in), linear_weight)]))
        params.append(Param(f"{name}/bias", (d_out,), [Tensor(f"{name}.bias", (d_out,), same)]))
    return params


def model_params(kind, dims):
    embedding = Param("PaliGemma/llm/embedder/input_embedding", (dims["vocab"], dims["llm"]["width"]),
                      [Tensor(LLM + "embed_tokens.weight", (dims["vocab"], dims["llm"]["width"]), same)])
    return (vision_params(dims["vision"], dims["llm"]["width"]) + [embedding] +
            gemma_params(dims["llm"], "", LLM, adaptive_norms=False) +
            gemma_params(dims["expert"], "_1", EXPERT, adaptive_norms=kind == "pi05") +
            projection_params(kind, dims["expert"]["width"], dims["action_dim"]))


# ---- LoRA (openpi lora.py) ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Lora:
    """The LoRA pair of one weight. openpi adds x·A·B to x·W: scaled by alpha/rank on the attention einsums
    (lora.Einsum), unscaled in the MLP (lora.FeedForward._dot)."""
    a: Leaf
    b: Leaf
    stack: str  # "llm" or "expert"
    attention: bool
    scale: float = 1.0


def lora_update(key, a, b):
    """x·A·B as one weight update, per layer. lora_a replaces the weight's last axis by the rank, lora_b the
    one before it, so A @ B has the weight's shape (batched over the leading axes) -- except on attn_vec_einsum:
    there openpi's second einsum ("BTNH,NHD->BTD" becomes "BTL,NLD->BTD") sums lora_b over the heads N, which
    are in neither its input nor its output, so every head's A meets the sum of all heads' B."""
    if "/attn_vec_einsum" in key:
        b = b.sum(axis=0)
    return a @ b


# The weights openpi can give LoRA (gemma.py: lora.Einsum in the attention, lora.FeedForward), in either stack.
LORA_TARGET = re.compile(r"^PaliGemma/llm/layers/(attn/(q|kv|attn_vec)_einsum(_1)?/w|mlp(_1)?/(gating_einsum|linear))$")


def attach_lora(param, leaves):
    """Finds the LoRA pair of `param` (einsum `.../w` -> `.../lora_a`, MLP `X` -> `X_lora_a`) and checks its shapes."""
    target = LORA_TARGET.match(param.key)
    if not target:
        return None
    attention = param.key.endswith("/w")
    stem = param.key[:-len("/w")] + "/lora_" if attention else param.key + "_lora_"
    a, b = leaves.get(stem + "a"), leaves.get(stem + "b")
    if not a and not b:
        return None
    if not a or not b:
        have, lack = (stem + "a", stem + "b") if a else (stem + "b", stem + "a")
        raise ConvertError(f"LoRA param {have} has no partner {lack}")
    rank = a.shape[-1]
    want_a = param.shape[:-1] + (rank,)
    want_b = param.shape[:-2] + (rank, param.shape[-1])
    if a.shape != want_a or b.shape != want_b:
        raise ConvertError(f"LoRA params {a.key} {a.shape} and {b.key} {b.shape} do not fit {param.key} "
                           f"{param.shape}: expected {want_a} and {want_b}")
    stack = "expert" if target.group(3) or target.group(4) else "llm"
    return Lora(a, b, stack, attention)


def lora_ranks(params):
    """{stack: {"rank": attention rank, "mlp_rank": MLP rank}}, one rank per kind as openpi's LoRAConfig has."""
    ranks = {}
    for p in params:
        if not p.lora:
            continue
        field = "rank" if p.lora.attention else "mlp_rank"
        rank = p.lora.a.shape[-1]
        seen = ranks.setdefault(p.lora.stack, {}).setdefault(field, rank)
        if seen != rank:
            raise ConvertError(f"the {p.lora.stack}'s LoRA ranks differ: {seen} and {rank} ({p.lora.a.key})")
    return ranks


def default_alpha(stack, dims, rank):
    """openpi's LoRA variants fix alpha: gemma_2b_lora rank 16 alpha 16, gemma_300m_lora rank 32 alpha 32."""
    for name, (variant_dims, variant_rank, alpha) in GEMMA_VARIANTS.items():
        if gemma_dims_tuple(dims) == variant_dims and rank == variant_rank:
            return alpha
    raise ConvertError(f"the {stack} carries LoRA of rank {rank}, which is none of openpi's LoRA variants "
                       "(gemma_2b_lora: rank 16, gemma_300m_lora: rank 32); its alpha is not stored in the "
                       f"checkpoint: give it with --lora-alpha {stack}=ALPHA")


def gemma_dims_tuple(g):
    return (g["width"], g["depth"], g["mlp_dim"], g["num_heads"], g["num_kv_heads"], g["head_dim"])


def resolve_lora(params, dims, alphas, rslora):
    """Sets every Lora's scale; returns {stack: {rank, alpha, scale, mlp_rank}} for the summary."""
    ranks = lora_ranks(params)
    for stack in alphas:
        if stack not in ranks:
            raise ConvertError(f"--lora-alpha {stack}=... given, but the {stack} has no LoRA params")
    info = {}
    for stack, r in ranks.items():
        entry = {"mlp_rank": r.get("mlp_rank")}
        if "rank" in r:
            alpha = alphas.get(stack) or default_alpha(stack, dims[stack], r["rank"])
            scale = alpha / r["rank"] ** 0.5 if rslora else alpha / r["rank"]
            entry.update(rank=r["rank"], alpha=alpha, scale=scale)
        info[stack] = entry
    for p in params:
        if p.lora and p.lora.attention:
            p.lora.scale = info[p.lora.stack]["scale"]
    return info


def load_param(param, leaves):
    """The source param as an array, with its LoRA merged in: computed in float64 and rounded once to float32
    (the float32 weight nearest to W + scale·A·B), a layer at a time to bound the float64 temporaries."""
    w = read_leaf(leaves[param.key])
    if not param.lora:
        return w
    a, b = read_leaf(param.lora.a), read_leaf(param.lora.b)
    merged = np.empty(w.shape, np.float32)
    for i in range(w.shape[0]):
        update = lora_update(param.key, a[i].astype(np.float64), b[i].astype(np.float64))
        merged[i] = w[i].astype(np.float64) + param.lora.scale * update
    return merged


def plan(leaves, kind, dims):
    """The params the tree must hold, each checked against the dims, with LoRA attached; nothing may be left over."""
    params = model_params(kind, dims)
    used = set()
    for p in params:
        leaf = leaves.get(p.key)
        if leaf is None:
            raise ConvertError(f"missing param {p.key} (a {'Pi0.5' if kind == 'pi05' else 'Pi0'} tree has it)")
        if leaf.shape != p.shape:
            raise ConvertError(f"param {p.key} has shape {leaf.shape}; the other params' shapes imply {p.shape}")
        p.lora = attach_lora(p, leaves)
        used.add(p.key)
        if p.lora:
            used.update((p.lora.a.key, p.lora.b.key))
    unknown = sorted(set(leaves) - used)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConvertError(f"unknown param{'s' if len(unknown) > 1 else ''} {', '.join(unknown[:5])}{more}: "
                           "not part of openpi's Pi0/Pi0.5 (or its LoRA); refusing to drop it")
    return params


# ---- model.safetensors ------------------------------------------------------------------------------------------
# Written here rather than with the `safetensors` package: save_file needs every tensor in memory at once (13 GB
# for Pi0 in float32), this streams one source param at a time. The layout is the package's own (names sorted,
# compact JSON header padded with spaces to 8 bytes, no metadata): the tests check that converting openpi's fixtures
# reproduces the files safetensors wrote byte for byte. It is read back with numpy below, for the same reason
# and because the GPU machines this runs on have no package registry to fetch one more dependency from.

DTYPES = {"bf16": ("BF16", 2, "bfloat16"), "f32": ("F32", 4, "float32")}


def safetensors_layout(tensors, dtype):
    """The header bytes and each tensor's [begin, end) in the data region."""
    st_dtype, size = DTYPES[dtype][:2]
    header, offset = {}, 0
    for t in sorted(tensors, key=lambda t: t.name):
        nbytes = size * int(np.prod(t.shape, dtype=np.int64))
        header[t.name] = {"dtype": st_dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, header


def bf16_bits(x):
    """float32 (no NaNs) -> bfloat16 bit patterns, rounding to nearest even, in integer arithmetic: an
    implementation independent of ml_dtypes' (which writes the file), to check it."""
    u = x.view(np.uint32)
    rounded = (u >> 16) & np.uint32(1)  # in place from here: no other full-size temporaries
    rounded += np.uint32(0x7FFF)
    rounded += u  # no overflow: the largest finite magnitude plus 0x8000 is still below 2^32
    rounded >>= 16
    return rounded.astype(np.uint16)


def new_digest():
    """SHA-1 of the tensor bytes: equal digests mean equal bytes (no adversary here), at 2 GB/s where blake2b
    does 0.9 and an exact comparison would need the whole model in memory twice."""
    return hashlib.sha1(usedforsecurity=False)


BLOCK = 1 << 24  # elements converted, checked and hashed at a time: bounds the temporaries of a 2 GB tensor


def write_tensor(fd, offset, x, dtype, what):
    """Writes `x` (float32, C order) at `offset` of the file in `dtype` (os.pwrite: threads write side by side);
    returns the digest of the bytes the file must hold: `x` itself, or for bf16 the round-to-nearest-even of `x`
    computed independently."""
    expected = new_digest()
    flat = x.reshape(-1)
    for start in range(0, flat.size, BLOCK):
        block = flat[start:start + BLOCK]
        if np.isnan(block).any():
            raise ConvertError(f"{what} holds NaN values: a broken checkpoint")
        if dtype == "f32":
            data = block
            expected.update(block)
        else:
            data = block.astype(ml_dtypes.bfloat16).view(np.uint16)
            expected.update(bf16_bits(block))
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    return expected.digest()


def write_model(path, params, leaves, dtype, progress):
    """Streams every tensor into `path`; returns the digest of each tensor's expected bytes for the read-back.
    Threads (numpy, hashlib and the file writes release the GIL) convert a param's tensors side by side while
    the next param is read: the largest param and the one after it are in memory at once."""
    tensors = [t for p in params for t in p.tensors]
    head, header = safetensors_layout(tensors, dtype)
    expected = {}
    workers = min(16, os.cpu_count() or 1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            loading = pool.submit(load_param, params[0], leaves) if params else None
            for i, p in enumerate(params):
                w = loading.result()
                loading = pool.submit(load_param, params[i + 1], leaves) if i + 1 < len(params) else None
                jobs = {}
                for t in p.tensors:
                    x = np.ascontiguousarray(t.cut(w), dtype=np.float32)
                    assert x.shape == t.shape, (t.name, x.shape, t.shape)
                    offset = len(head) + header[t.name]["data_offsets"][0]
                    what = f"param {p.key} (tensor {t.name})"
                    jobs[t.name] = pool.submit(write_tensor, fd, offset, x, dtype, what)
                for name, job in jobs.items():
                    expected[name] = job.result()
                del w
                progress.advance(leaf_bytes(p, leaves))
        os.fsync(fd)
    finally:
        os.close(fd)
    return expected


def leaf_bytes(param, leaves):
    keys = [param.key] + ([param.lora.a.key, param.lora.b.key] if param.lora else [])
    return sum(int(np.prod(leaves[k].shape, dtype=np.int64)) * leaves[k].dtype.itemsize for k in keys)


def read_header(view, path):
    """The safetensors header of the mapped file, checked: sizes, contiguous offsets, nothing past the end."""
    try:
        n = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"read-back of {path}: unreadable header ({first_line(e)})")
    offset = 0
    for name in sorted(header):
        begin, end = header[name]["data_offsets"]
        if begin != offset or end < begin:
            raise ConvertError(f"read-back of {path}: {name} has data_offsets [{begin}, {end}], "
                               f"expected to begin at {offset}")
        offset = end
    if 8 + n + offset != len(view):
        raise ConvertError(f"read-back of {path}: {len(view)} bytes, the header accounts for {8 + n + offset}")
    return header, 8 + n


def verify_model(path, params, dtype, expected, progress):
    """Reads `path` back from disk and compares every tensor with what the source said it must hold."""
    tensors = {t.name: t for p in params for t in p.tensors}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
        header, start = read_header(view, path)
        if set(header) != set(tensors):
            raise ConvertError(f"read-back of {path}: the tensor names differ from those written")
        for name in sorted(header):
            entry, t = header[name], tensors[name]
            if entry["dtype"] != DTYPES[dtype][0] or tuple(entry["shape"]) != t.shape:
                raise ConvertError(f"read-back of {path}: {name} is {entry['dtype']} {entry['shape']}, "
                                   f"expected {DTYPES[dtype][0]} {list(t.shape)}")
            begin, end = entry["data_offsets"]
            data = view[start + begin:start + end]
            stored = new_digest()
            stored.update(data)
            if stored.digest() != expected[name]:
                rule = "exact float32" if dtype == "f32" else "round-to-nearest-even bfloat16"
                raise ConvertError(f"read-back of {path}: {name} differs from the source ({rule} expected)")
            del data
            progress.advance(end - begin)


class Progress:
    """'pi0 convert: STAGE  N% (x of y GB)' on stderr each time another tenth of the bytes is done."""

    def __init__(self, stage, total):
        self.stage, self.total, self.done, self.printed = stage, max(total, 1), 0, 0

    def advance(self, nbytes):
        self.done += nbytes
        tenth = min(10, self.done * 10 // self.total)
        if tenth > self.printed:
            self.printed = tenth
            print(f"{PROG}: {self.stage} {tenth * 10:3d}% ({size_text(self.done)} of {size_text(self.total)})",
                  file=sys.stderr, flush=True)


def size_text(nbytes):
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


# ---- config.json, assets, summary -------------------------------------------------------------------------


def variant_name(g, has_lora):
    """openpi's name for a stack of these dims (gemma.py), with `_lora` as in the config that trained it."""
    for name, (dims, _, _) in GEMMA_VARIANTS.items():
        if gemma_dims_tuple(g) == dims:
            return name + ("_lora" if has_lora else "")
    return "custom"


def config_json(dims, args, lora):
    """The config.json pi0 reads (src/model/config.c), in the fixtures' format. action_horizon and
    max_token_len only when given: a guess here would override the engine's better defaults (the
    adapter's horizon, openpi's token lengths per model kind)."""
    v = dims["vision"]
    given = {k: getattr(args, k) for k in ("action_horizon", "max_token_len") if getattr(args, k)}
    return {
        "action_dim": dims["action_dim"],
        **given,
        "paligemma_variant": variant_name(dims["llm"], "llm" in lora),
        "action_expert_variant": variant_name(dims["expert"], "expert" in lora),
        "precision": DTYPES[args.dtype][2],
        "dims": {"vision": {k: v[k] for k in ("width", "depth", "mlp_dim", "num_heads", "patch")},
                 "llm": dims["llm"], "expert": dims["expert"], "vocab": dims["vocab"]},
    }


def copy_assets(assets_dir, dst):
    """Copies SRC's assets/ to DST/assets, replacing it; returns the asset ids, the directories holding a
    norm_stats.json (openpi's ids may contain '/', e.g. physical-intelligence/libero)."""
    target = os.path.join(dst, "assets")
    shutil.rmtree(target, ignore_errors=True)
    ids = []
    for root, _, files in os.walk(assets_dir):  # files only, not their modes: a read-only source stays replaceable
        relative = os.path.relpath(root, assets_dir)
        os.makedirs(os.path.join(target, relative), exist_ok=True)
        for name in files:
            shutil.copyfile(os.path.join(root, name), os.path.join(target, relative, name))
        if "norm_stats.json" in files:
            ids.append(relative)
    return sorted(ids)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def source_dtype(leaves):
    names = sorted({DTYPES["bf16" if leaf.dtype == ml_dtypes.bfloat16 else "f32"][2] for leaf in leaves.values()})
    return "+".join(names)


def convert(args):
    t0 = time.monotonic()
    params_dir, assets_dir = find_params(args.src)
    dst = os.path.abspath(args.dst)
    model_path = os.path.join(dst, "model.safetensors")
    for path in (model_path, os.path.join(dst, "assets")):
        if os.path.exists(path) and not args.force:
            raise ConvertError(f"{path} exists (--force replaces it)")
    leaves = open_leaves(params_dir)
    kind = model_kind(leaves)
    dims = model_dims(leaves)
    params = plan(leaves, kind, dims)
    lora = resolve_lora(params, dims, args.lora_alpha, args.rslora)
    os.makedirs(dst, exist_ok=True)
    partial = model_path + ".partial"
    try:
        total = sum(leaf_bytes(p, leaves) for p in params)
        expected = write_model(partial, params, leaves, args.dtype, Progress("converting", total))
        t1 = time.monotonic()
        data_bytes = sum(DTYPES[args.dtype][1] * int(np.prod(t.shape)) for p in params for t in p.tensors)
        verify_model(partial, params, args.dtype, expected, Progress("verifying", data_bytes))
        os.replace(partial, model_path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    config = config_json(dims, args, lora)
    write_json(os.path.join(dst, "config.json"), config)
    assets = copy_assets(assets_dir, dst)
    return {
        "model": kind, "source": os.path.abspath(args.src), "output": dst,
        "dtype": config["precision"], "source_dtype": source_dtype(leaves),
        "tensors": sum(len(p.tensors) for p in params), "bytes": os.path.getsize(model_path), "verified": True,
        "dims": dims, "action_horizon": args.action_horizon, "max_token_len": args.max_token_len,
        "paligemma_variant": config["paligemma_variant"], "action_expert_variant": config["action_expert_variant"],
        "lora": lora, "rslora": args.rslora if lora else False, "assets": assets,
        "seconds": {"convert": round(t1 - t0, 3), "verify": round(time.monotonic() - t1, 3)},
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def format_stack(name, g):
    kv = f"  kv heads {g['num_kv_heads']}" if "num_kv_heads" in g else ""
    return (f"{name:<10} width {g['width']}  depth {g['depth']}  mlp {g['mlp_dim']}  heads {g['num_heads']}{kv}"
            f"  head_dim {g['head_dim']}")


def format_lora(lora, rslora):
    if not lora:
        return "none"
    parts = []
    for stack in [s for s in ("llm", "expert") if s in lora]:
        e = lora[stack]
        rule = "alpha/sqrt(rank)" if rslora else "alpha/rank"
        attn = (f"attention rank {e['rank']} alpha {e['alpha']:g} (scale {rule} = {e['scale']:g})"
                if "rank" in e else "no attention LoRA")
        mlp = f"mlp rank {e['mlp_rank']} unscaled" if e["mlp_rank"] else "no mlp LoRA"
        parts.append(f"{stack} {attn}, {mlp}")
    return "merged: " + "; ".join(parts)


def print_summary(s):
    d = s["dims"]
    lines = [
        f"converted {s['source']} -> {s['output']}",
        f"{'model':<10} {'Pi0.5' if s['model'] == 'pi05' else 'Pi0'} ({s['paligemma_variant']} + "
        f"{s['action_expert_variant']} expert), action_dim {d['action_dim']}, vocab {d['vocab']}",
        format_stack("vision", d["vision"]) + f"  patch {d['vision']['patch']}",
        format_stack("llm", d["llm"]),
        format_stack("expert", d["expert"]),
        f"{'tensors':<10} {s['tensors']} in {s['dtype']} ({size_text(s['bytes'])}) from {s['source_dtype']} params; "
        "read back and equal to the source",
        f"{'lora':<10} {format_lora(s['lora'], s['rslora'])}",
        f"{'config':<10} " + ", ".join(f"{k} {s[k]}" if s[k] else f"{k} left out (not in the checkpoint)"
                                       for k in ("action_horizon", "max_token_len")),
        f"{'assets':<10} {', '.join(s['assets']) or 'no norm_stats.json (pi0 infer and serve will need --norm-stats)'}",
        f"{'time':<10} convert {s['seconds']['convert']:.1f} s, verify {s['seconds']['verify']:.1f} s, "
        f"peak memory {size_text(s['peak_memory_bytes'])}",
    ]
    print("\n".join(lines))


# ---- command line -----------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def positive_int(limit):
    def parse(text):
        if not text.isdigit() or not 1 <= int(text) <= limit:
            raise argparse.ArgumentTypeError(f"takes an integer in 1..{limit}")
        return int(text)
    return parse


def lora_alphas(text):
    """'llm=8,expert=2' -> {'llm': 8.0, 'expert': 2.0}."""
    alphas = {}
    for item in text.split(","):
        stack, _, value = item.partition("=")
        try:
            alpha = float(value)
        except ValueError:
            alpha = 0.0
        if stack not in ("llm", "expert") or stack in alphas or not alpha > 0:
            raise argparse.ArgumentTypeError("takes llm=ALPHA and/or expert=ALPHA, comma-separated, alphas > 0")
        alphas[stack] = alpha
    return alphas


def parse_args(argv):
    """The options, or None after printing --help."""
    if "-h" in argv or "--help" in argv:
        print(HELP, end="")
        return None
    p = Parser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--lora-alpha", type=lora_alphas, default={})
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--action-horizon", type=positive_int(4096))
    p.add_argument("--max-token-len", type=positive_int(65536))
    p.add_argument("--force", action="store_true")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv):
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: {e} (see {PROG} --help)", file=sys.stderr)
        return 2
    if args is None:
        return 0
    if MISSING_MODULE:
        print(f"{PROG} needs {MISSING_MODULE}: python3 -m pip install {INSTALL.get(MISSING_MODULE, MISSING_MODULE)}",
              file=sys.stderr)
        return 1
    try:
        summary = convert(args)
    except ConvertError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"{PROG}: error: {where}{e.strerror or first_line(e)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"{PROG}: error: out of memory", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a bug: still one line, with what to report
        print(f"{PROG}: internal error (please report): {type(e).__name__}: {first_line(e)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
