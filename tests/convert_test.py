#!/usr/bin/env python3
"""convert_test.py - `pi0 convert` (tools/convert_openpi.py) on openpi's own JAX checkpoints.

The fixtures in ../shared/fixtures/openpi_jax are params/ directories written by orbax from openpi's JAX
model (PI0_SPEC.md; fixtures/README.md). Checks:
  - pi0_tiny (float32, plain tree) converts to exactly pi0_tiny/model.safetensors, byte for byte, and
    pi05_tiny_h50 (bfloat16, nnx.State tree) to exactly pi05_tiny_h50/model.safetensors; float32 params
    stored as bf16 are the round-to-nearest-even of the fixture's; config.json carries the fixture's dims;
  - the converted checkpoints run: `pi0 sample` reproduces openpi's actions at 10, 3 and 1 steps within
    1e-4 (Pi0 and Pi0.5); the LoRA fine-tune, merged, reproduces its own io.safetensors;
  - the tree, not the path, says what the model is; Pi0-FAST, unknown and unpaired LoRA params are refused;
    LoRA of a rank that is no openpi variant needs --lora-alpha (openpi's variants imply alpha = rank);
    --rslora scales by alpha/sqrt(rank);
  - corrupt or truncated params/ (a chunk file, the manifest, a B-tree node, _METADATA) exit 1 with one line,
    leaving no model.safetensors; a missing tensorstore gives the pip command; bad command lines exit 2;
  - `pi0` finds the script beside it when installed (PREFIX/share/pi0) or in $PI0_TOOLS_DIR.
Prints one line per check and a final "N passed, N failed".
Needs numpy and tensorstore (make deps) and build/pi0 ($PI0_BIN).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.abspath(os.environ.get("PI0_BIN", os.path.join(REPO, "build", "pi0")))
FIXTURES = os.path.abspath(os.environ.get("PI0_FIXTURES", os.path.join(REPO, "..", "shared", "fixtures")))
JAX = os.path.join(FIXTURES, "openpi_jax")
TOLERANCE = 1e-4  # fp32 engine vs openpi's fp32 actions (fixtures/README.md)

counts = {"passed": 0, "failed": 0}


def check(name, fn):
    t0 = time.monotonic()
    try:
        note = fn()
        counts["passed"] += 1
        print(f"ok   {name} ({time.monotonic() - t0:.1f} s){': ' + note if note else ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
        counts["failed"] += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)


# ---- helpers ----------------------------------------------------------------------------------------------


def pi0(*args, env=None):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, env=env)


def convert(src, dst, *flags):
    """`pi0 convert SRC DST --json FLAGS`, which must succeed; returns its summary."""
    run = pi0("convert", src, dst, "--json", *flags)
    if run.returncode:
        raise AssertionError(f"pi0 convert exited {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(run.stdout)


def expect_error(args, rc, pattern, env=None):
    """`pi0 ARGS` must exit `rc` with one line on stderr (besides progress) matching `pattern`, no traceback."""
    run = pi0(*args, env=env)
    lines = [line for line in run.stderr.splitlines() if not re.match(r"pi0 convert: (converting|verifying) ", line)]
    if run.returncode != rc or len(lines) != 1 or not re.search(pattern, lines[0]):
        raise AssertionError(f"exit {run.returncode} (want {rc}), stderr {lines!r} "
                             f"(want one line matching {pattern!r})")
    return lines[0]


def load_safetensors(path):
    """{name: array}; BF16 tensors as their uint16 bit patterns."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    dtypes = {"F32": np.float32, "BF16": np.uint16, "I32": np.int32, "BOOL": np.bool_}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + begin:8 + n + end], dtypes[entry["dtype"]]).reshape(entry["shape"])
    return out


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        if fa.read() != fb.read():
            raise AssertionError(f"{a} differs from {b}")


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def sample_error(checkpoint, io, steps, reference):
    """||pi0 sample - openpi|| / ||openpi|| for the inputs of `io` at `steps` Euler steps."""
    out = os.path.join(WORK, "actions.safetensors")
    run = pi0("sample", "--checkpoint", checkpoint, "--inputs", io, "--output", out, "--steps", steps,
              "--backend", "cpu", "--quiet")
    if run.returncode:
        raise AssertionError(f"pi0 sample exited {run.returncode}: {run.stderr.strip()}")
    err = rel_err(load_safetensors(out)["actions"], load_safetensors(io)[reference])
    if not err <= TOLERANCE:
        raise AssertionError(f"relative error {err:.3e} > {TOLERANCE:g} vs {reference}")
    return f"{reference}: relative error {err:.2e}"


def writable_copy(fixture, name=None):
    dst = os.path.join(WORK, name or fixture)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(os.path.join(JAX, fixture), dst, copy_function=shutil.copyfile)
    for root, dirs, files in os.walk(dst):
        for entry in dirs + files:
            os.chmod(os.path.join(root, entry), 0o755 if entry in dirs else 0o644)
    return dst


def edit_metadata(params_dir, edit):
    path = os.path.join(params_dir, "_METADATA")
    with open(path) as f:
        meta = json.load(f)
    edit(meta["tree_metadata"])
    with open(path, "w") as f:
        json.dump(meta, f)


def drop_leaves(params_dir, pattern):
    """Removes the leaves whose dotted name matches `pattern` from the tree (their data stays, unreferenced)."""
    def edit(tree):
        for key in [k for k, v in tree.items() if re.search(pattern, ".".join(x["key"] for x in v["key_metadata"]))]:
            del tree[key]
    edit_metadata(params_dir, edit)


def add_leaf(params_dir, path, array):
    """Writes one more array into the checkpoint's OCDBT store, as orbax would, and lists it in _METADATA."""
    import tensorstore as ts
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": "file://" + params_dir + "/"},
                     "path": ".".join(path), "metadata": {"compressor": {"id": "zstd", "level": 1}}},
                    create=True, dtype=ts.float32, shape=array.shape).result()
    store.write(array).result()

    def edit(tree):
        tree[str(tuple(path))] = {"key_metadata": [{"key": k, "key_type": 2} for k in path],
                                  "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                                                     "write_shape": list(array.shape)}}
    edit_metadata(params_dir, edit)


def bf16_rne(x):
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    u = x.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


# ---- checks -----------------------------------------------------------------------------------------------


def main():
    global WORK
    WORK = tempfile.mkdtemp(prefix="pi0_convert_test.")
    out = lambda name: os.path.join(WORK, name)  # noqa: E731
    pi0_fixture, pi05_fixture = os.path.join(FIXTURES, "pi0_tiny"), os.path.join(FIXTURES, "pi05_tiny_h50")
    lora_src = os.path.join(JAX, "pi0_lora_tiny_openpi_jax")
    lora_io = os.path.join(lora_src, "io.safetensors")

    def t_pi0_exact():
        s = convert(os.path.join(JAX, "pi0_tiny_openpi_jax"), out("pi0"), "--dtype", "f32",
                    "--action-horizon", "10", "--max-token-len", "16")
        same_bytes(out("pi0/model.safetensors"), os.path.join(pi0_fixture, "model.safetensors"))
        assert s["model"] == "pi0" and s["tensors"] == 106 and s["lora"] == {}, s
        return "106 tensors, float32, identical file"

    def t_pi0_config():
        with open(out("pi0/config.json")) as f, open(os.path.join(pi0_fixture, "config.json")) as g:
            mine, fixture = json.load(f), json.load(g)
        assert mine == fixture, f"{mine} != {fixture}"
        same_bytes(out("pi0/assets/test_robot/norm_stats.json"),
                   os.path.join(JAX, "pi0_tiny_openpi_jax/assets/test_robot/norm_stats.json"))

    def t_pi05_exact():
        s = convert(os.path.join(JAX, "pi05_tiny_h50_openpi_jax"), out("pi05_bf16"))
        same_bytes(out("pi05_bf16/model.safetensors"), os.path.join(pi05_fixture, "model.safetensors"))
        assert s["model"] == "pi05" and s["dtype"] == "bfloat16", s
        with open(out("pi05_bf16/config.json")) as f:
            config = json.load(f)
        # not stored in the params, so left to the engine's defaults rather than guessed
        assert "action_horizon" not in config and "max_token_len" not in config, config
        return "111 tensors, bfloat16 from the nnx.State tree, identical file"

    def t_bf16_rounding():
        convert(os.path.join(JAX, "pi0_tiny_openpi_jax"), out("pi0_bf16"))
        mine, fixture = load_safetensors(out("pi0_bf16/model.safetensors")), load_safetensors(
            os.path.join(pi0_fixture, "model.safetensors"))
        bad = [name for name in fixture if not np.array_equal(mine[name], bf16_rne(fixture[name]))]
        assert not bad and set(mine) == set(fixture), f"{len(bad)} tensors differ, e.g. {bad[:3]}"

    def t_pi0_sample(steps, reference):
        return lambda: sample_error(out("pi0"), os.path.join(pi0_fixture, "io.safetensors"), steps, reference)

    def t_pi05_convert():
        s = convert(os.path.join(JAX, "pi05_tiny_h50_openpi_jax"), out("pi05"), "--dtype", "f32")
        inspect = pi0("inspect", "--checkpoint", out("pi05"), "--json")
        assert inspect.returncode == 0, inspect.stderr
        engine = json.loads(inspect.stdout)["model"]
        assert s["model"] == engine == "pi05", (s["model"], engine)

    def t_pi05_sample(steps, reference):
        return lambda: sample_error(out("pi05"), os.path.join(pi05_fixture, "io.safetensors"), steps, reference)

    def t_lora_needs_alpha():
        expect_error(("convert", lora_src, out("lora_noalpha")), 1, r"LoRA of rank 4\b.*--lora-alpha llm=ALPHA")
        assert not os.path.exists(out("lora_noalpha/model.safetensors"))

    def t_lora_convert():
        s = convert(lora_src, out("lora"), "--dtype", "f32", "--lora-alpha", "llm=8,expert=2")
        want = {"llm": {"mlp_rank": 4, "rank": 4, "alpha": 8.0, "scale": 2.0},
                "expert": {"mlp_rank": 2, "rank": 2, "alpha": 2.0, "scale": 1.0}}
        assert s["lora"] == want, s["lora"]
        return "llm rank 4 alpha 8, expert rank 2 alpha 2, MLP LoRA unscaled"

    def t_rslora():
        # alpha/sqrt(rank) with these alphas gives the scales 2 and 1 of the fixture's alpha/rank: the same file
        s = convert(lora_src, out("rslora"), "--dtype", "f32", "--rslora", "--lora-alpha", f"llm=4,expert={2 ** 0.5!r}")
        assert s["rslora"] and (s["lora"]["llm"]["scale"], s["lora"]["expert"]["scale"]) == (2.0, 1.0), s["lora"]
        same_bytes(out("rslora/model.safetensors"), out("lora/model.safetensors"))

    def t_variant_alphas():
        # at the real dims, which the tiny fixtures cannot have: the script's own function, imported
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import convert_openpi as c
        g2b = dict(width=2048, depth=18, mlp_dim=16384, num_heads=8, num_kv_heads=1, head_dim=256)
        g300m = dict(g2b, width=1024, mlp_dim=4096)
        assert c.default_alpha("llm", g2b, 16) == 16.0 and c.default_alpha("expert", g300m, 32) == 32.0
        for stack, dims, rank in (("llm", g2b, 32), ("expert", g300m, 16), ("llm", dict(g2b, depth=17), 16)):
            try:
                c.default_alpha(stack, dims, rank)
            except c.ConvertError:
                continue
            raise AssertionError(f"default alpha for {stack} rank {rank} {dims}")

    def t_lora_sample(steps, reference):
        return lambda: sample_error(out("lora"), lora_io, steps, reference)

    def t_params_dir_as_src():
        convert(os.path.join(JAX, "pi0_tiny_openpi_jax", "params"), out("from_params"), "--dtype", "f32")
        same_bytes(out("from_params/model.safetensors"), os.path.join(pi0_fixture, "model.safetensors"))
        assert os.path.isfile(out("from_params/assets/test_robot/norm_stats.json"))

    def t_path_name_trick():
        src = writable_copy("pi0_tiny_openpi_jax", "pi05_x")
        s = convert(src, out("pi05_x_converted"), "--dtype", "f32")
        assert s["model"] == "pi0", s["model"]
        same_bytes(out("pi05_x_converted/model.safetensors"), os.path.join(pi0_fixture, "model.safetensors"))

    def t_pi0_fast_refused():
        src = writable_copy("pi0_tiny_openpi_jax", "fast")
        expert = r"^params\.PaliGemma\.llm\.(layers\.(attn\.)?)?\w+_1\."
        drop_leaves(os.path.join(src, "params"), expert + r"|^params\.(state_proj|action_)")
        expect_error(("convert", src, out("fast_out")), 1, r"Pi0-FAST checkpoint")

    def t_unknown_lora_param():
        src = writable_copy("pi0_lora_tiny_openpi_jax", "lora_c")
        add_leaf(os.path.join(src, "params"), ("params", "PaliGemma", "llm", "layers", "attn", "q_einsum", "lora_c"),
                 np.ones((3, 4, 64, 4), np.float32))
        expect_error(("convert", src, out("lora_c_out"), "--lora-alpha", "llm=8,expert=2"), 1,
                     r"unknown param PaliGemma/llm/layers/attn/q_einsum/lora_c: .*refusing to drop it")

    def t_unpaired_lora_param():
        src = writable_copy("pi0_lora_tiny_openpi_jax", "lora_unpaired")
        drop_leaves(os.path.join(src, "params"), r"mlp_1\.linear_lora_b$")
        expect_error(("convert", src, out("lora_unpaired_out"), "--lora-alpha", "llm=8,expert=2"), 1,
                     r"mlp_1/linear_lora_a has no partner PaliGemma/llm/layers/mlp_1/linear_lora_b")

    def t_unknown_param():
        src = writable_copy("pi0_tiny_openpi_jax", "extra")
        add_leaf(os.path.join(src, "params"), ("params", "PaliGemma", "img", "extra_head", "kernel"),
                 np.ones((64, 8), np.float32))
        expect_error(("convert", src, out("extra_out")), 1, r"unknown param PaliGemma/img/extra_head/kernel")

    def corrupted(name, damage, pattern):
        def run():
            src = writable_copy("pi0_tiny_openpi_jax", "corrupt_" + name)
            damage(os.path.join(src, "params"))
            line = expect_error(("convert", src, out("corrupt_out")), 1, r"^pi0 convert: error: " + pattern)
            assert not os.path.exists(out("corrupt_out/model.safetensors"))
            return line[:150]
        return run

    def largest_chunk_file(params_dir):
        data = os.path.join(params_dir, "ocdbt.process_0", "d")
        return max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)

    def btree_node(params_dir):
        return os.path.join(params_dir, "d", os.listdir(os.path.join(params_dir, "d"))[0])

    def overwrite(path, offset, data):
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    def t_missing_tensorstore():
        fake = os.path.join(WORK, "no_tensorstore")
        os.makedirs(fake, exist_ok=True)
        with open(os.path.join(fake, "tensorstore.py"), "w") as f:
            f.write('raise ModuleNotFoundError("No module named \'tensorstore\'", name="tensorstore")\n')
        env = dict(os.environ, PYTHONPATH=fake)
        return expect_error(("convert", os.path.join(JAX, "pi0_tiny_openpi_jax"), out("nots")), 1,
                            r"^pi0 convert needs tensorstore: python3 -m pip install tensorstore==[0-9.]+$", env=env)

    def t_usage():
        expect_error(("convert",), 2, r"^pi0 convert: .*required.*\(see pi0 convert --help\)$")
        expect_error(("convert", "a", "b", "--dtype", "f16"), 2, r"--dtype")
        expect_error(("convert", "a", "b", "--lora-alpha", "vision=2"), 2, r"--lora-alpha")
        expect_error(("convert", "a", "b", "--action-horizon", "0"), 2, r"--action-horizon")
        run = pi0("convert", "--help")
        assert run.returncode == 0 and run.stdout.startswith("usage: pi0 convert SRC DST"), run

    def t_script_lookup():
        prefix = os.path.join(WORK, "prefix")  # what `make install` lays out: PREFIX/bin/pi0, PREFIX/share/pi0/
        os.makedirs(os.path.join(prefix, "bin"))
        os.makedirs(os.path.join(prefix, "share", "pi0"))
        shutil.copy(BIN, os.path.join(prefix, "bin", "pi0"))
        shutil.copy(os.path.join(REPO, "tools", "convert_openpi.py"), os.path.join(prefix, "share", "pi0"))
        installed = subprocess.run([os.path.join(prefix, "bin", "pi0"), "convert", "--help"], capture_output=True,
                                   text=True)
        assert installed.returncode == 0 and installed.stdout.startswith("usage: pi0 convert"), installed
        env = dict(os.environ, PI0_TOOLS_DIR=os.path.join(WORK, "nowhere"))
        missing = r"^pi0 convert: error: no .*/nowhere/convert_openpi.py \(PI0_TOOLS_DIR\)$"
        expect_error(("convert", "--help"), 1, missing, env=env)

    def t_existing_output():
        expect_error(("convert", os.path.join(JAX, "pi0_tiny_openpi_jax"), out("pi0")), 1,
                     r"exists \(--force replaces it\)")
        convert(os.path.join(JAX, "pi0_tiny_openpi_jax"), out("pi0"), "--dtype", "f32", "--force",
                "--action-horizon", "10", "--max-token-len", "16")
        same_bytes(out("pi0/model.safetensors"), os.path.join(pi0_fixture, "model.safetensors"))

    check("convert pi0_tiny (f32, plain tree): identical to the fixture", t_pi0_exact)
    check("convert pi0_tiny: config.json and assets", t_pi0_config)
    check("convert pi05_tiny_h50 (bf16, nnx.State tree): identical to the fixture", t_pi05_exact)
    check("convert pi0_tiny to bf16: round-to-nearest-even of the fixture", t_bf16_rounding)
    for steps, ref in ((10, "actions"), (3, "actions_3step"), (1, "actions_1step")):
        check(f"pi0 sample on converted pi0_tiny, {steps} steps", t_pi0_sample(steps, ref))
    check("convert pi05_tiny_h50 to f32: pi0 loads it as Pi0.5", t_pi05_convert)
    for steps, ref in ((10, "actions"), (3, "actions_3step"), (1, "actions_1step")):
        check(f"pi0 sample on converted pi05_tiny_h50, {steps} steps", t_pi05_sample(steps, ref))
    check("LoRA of no openpi variant's rank needs --lora-alpha", t_lora_needs_alpha)
    check("convert the LoRA fine-tune, merged", t_lora_convert)
    for steps, ref in ((10, "actions"), (1, "actions_1step")):
        check(f"pi0 sample on the merged LoRA fine-tune, {steps} steps", t_lora_sample(steps, ref))
    check("--rslora scales by alpha/sqrt(rank)", t_rslora)
    check("gemma_2b_lora (rank 16) and gemma_300m_lora (rank 32) imply alpha = rank, nothing else", t_variant_alphas)
    check("SRC may be params/ itself", t_params_dir_as_src)
    check("a Pi0 tree in a directory named pi05_x is Pi0", t_path_name_trick)
    check("Pi0-FAST refused", t_pi0_fast_refused)
    check("unknown LoRA param refused by name", t_unknown_lora_param)
    check("LoRA param without its partner refused", t_unpaired_lora_param)
    check("unknown param refused by name", t_unknown_param)
    check("truncated chunk file", corrupted("chunk", lambda p: os.truncate(largest_chunk_file(p), 1000),
                                            r"cannot read param .*OUT_OF_RANGE"))
    check("truncated manifest", corrupted("manifest", lambda p: os.truncate(os.path.join(p, "manifest.ocdbt"), 50),
                                          r"cannot open param .*manifest"))
    check("corrupt B-tree node", corrupted("btree", lambda p: overwrite(btree_node(p), 400, b"XXXX"),
                                           r"cannot open param .*checksum"))
    check("truncated _METADATA", corrupted("metadata", lambda p: os.truncate(os.path.join(p, "_METADATA"), 5000),
                                           r".*/_METADATA is not an orbax PyTree metadata file"))
    check("no params/ at all", corrupted("no_params", lambda p: shutil.rmtree(p), r".*: no params/_METADATA"))
    check("missing tensorstore: the pip command", t_missing_tensorstore)
    check("command-line errors exit 2, --help", t_usage)
    check("an existing model.safetensors needs --force", t_existing_output)
    check("the script is found beside an installed pi0, or in $PI0_TOOLS_DIR", t_script_lookup)

    shutil.rmtree(WORK, ignore_errors=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
