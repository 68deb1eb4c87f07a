#!/usr/bin/env python3
"""Checks the C wire codec against openpi's own: openpi_client.msgpack_numpy (pip install openpi-client).

    python3 tests/msgpack_vs_openpi.py build/tests/msgpack_tool [--cases N] [--seed S]

Build the tool first (`make` builds it next to the tests when msgpack-c and libwebsockets are present).
  * decode: observations packed by openpi's packb (LIBERO, DROID and ALOHA shaped ones, then random dicts of
    every dtype in every byte order, ranks 0..8, zero-size and non-contiguous arrays, numpy scalars, Python
    numbers, lists, unicode keys and strings, nested dicts) are decoded by the tool ("describe"), and its
    keys, dtypes, shapes and data CRCs must equal those of openpi's unpackb of the same frame;
  * pack: the tool packs what it decoded ("echo") and a reply-like frame using every pi0_pack_* function
    ("reply"); openpi's unpackb must read them back to exactly the expected values and dtypes;
  * refusals: frames openpi cannot decode either (truncated, short data, bad dtype string, invalid UTF-8)
    and frames the C decoder refuses on purpose (complex dtypes, extra data bytes, duplicate keys, NUL in
    a string) must fail with a message naming the key.
Prints one summary line; exits 1 on any mismatch.
"""

import argparse
import random
import subprocess
import sys
import zlib

import msgpack
import numpy as np
from openpi_client import msgpack_numpy

DTYPES = ["b1", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"]
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1


def run_tool(tool, mode, frame=b""):
    proc = subprocess.run([tool, mode], input=frame, capture_output=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr.decode("utf-8", "replace").strip()


def run_batch(tool, mode, frames):
    """One run of the tool over every frame: [(refused, output or error message)] in order."""
    blob = b"".join(len(f).to_bytes(8, "little") + f for f in frames)
    proc = subprocess.run([tool, mode, "--batch"], input=blob, capture_output=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} {mode} --batch failed: {proc.stderr.decode('utf-8', 'replace')}")
    out, results, pos = proc.stdout, [], 0
    while pos < len(out):
        size = int.from_bytes(out[pos + 1:pos + 9], "little")
        results.append((out[pos] != 0, out[pos + 9:pos + 9 + size]))
        pos += 9 + size
    if len(results) != len(frames):
        raise RuntimeError(f"{tool} {mode} --batch answered {len(results)} of {len(frames)} frames")
    return results


# --- what the C decoder must produce, computed from openpi's unpackb of the frame ---------------------------


def le_dtype(dtype: np.dtype) -> str:
    """numpy's dtype.str in little-endian form: what pi0_dtype_str prints."""
    return ("|" if dtype.itemsize == 1 else "<") + dtype.kind + str(dtype.itemsize)


def array_leaf(array: np.ndarray):
    array = np.asarray(array)
    little = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<")))
    data = little.tobytes()
    if array.dtype.kind == "b":
        data = bytes(b != 0 for b in data)
    return ("A", le_dtype(array.dtype), tuple(int(d) for d in array.shape), data)


def scalar_leaf(value):
    """Plain numbers and numpy scalars -> ndim 0: bool -> |b1, signed -> <i8, unsigned -> <u8, float -> <f8."""
    if isinstance(value, np.generic):
        kind = value.dtype.kind
        if kind == "b":
            return array_leaf(np.array(bool(value)))
        if kind == "i":
            return array_leaf(np.array(int(value), "<i8"))
        if kind == "u":
            return array_leaf(np.array(int(value), "<u8"))
        return array_leaf(np.array(float(value), "<f8"))
    if isinstance(value, bool):
        return array_leaf(np.array(value))
    if isinstance(value, int):
        return array_leaf(np.array(value, "<i8" if value <= INT64_MAX else "<u8"))
    return array_leaf(np.array(float(value), "<f8"))


def expected_fields(obj, prefix=""):
    """The flat (key, leaf) list the C decoder must give, in frame order; openpi's unpackb gives obj."""
    fields = []
    for key, value in obj.items():
        key = key.decode("utf-8") if isinstance(key, bytes) else key
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            fields += expected_fields(value, path)
        elif value is None:
            continue
        elif isinstance(value, np.ndarray):
            fields.append((path, array_leaf(value)))
        elif isinstance(value, (str, bytes)):
            fields.append((path, ("S", value.decode("utf-8") if isinstance(value, bytes) else value)))
        elif isinstance(value, list):
            fields.append((path, array_leaf(np.array([scalar_value(v) for v in value], "<f8").reshape(len(value)))))
        else:
            fields.append((path, scalar_leaf(value)))
    return fields


def scalar_value(value):
    """A list element as the C decoder reads it: a number, bool or numpy scalar as float64."""
    return float(bool(value)) if isinstance(value, (bool, np.bool_)) else float(value)


def describe_lines(fields):
    lines = []
    for key, leaf in fields:
        key_hex = key.encode("utf-8").hex() or "-"
        if leaf[0] == "S":
            lines.append(f"S {key_hex} {leaf[1].encode('utf-8').hex() or '-'}")
        else:
            shape = ",".join(str(d) for d in leaf[2]) or "-"
            lines.append(f"A {key_hex} {leaf[1]} {shape} {zlib.crc32(leaf[3]):08x}")
    return lines


# --- observations ------------------------------------------------------------------------------------------


def robot_observations(rng: np.random.Generator):
    def image(chw=False):
        shape = (3, 224, 224) if chw else (224, 224, 3)
        return rng.integers(0, 256, shape, dtype=np.uint8)

    libero = {
        "observation/image": image(),
        "observation/wrist_image": image(),
        "observation/state": rng.standard_normal(8),
        "prompt": "put both the alphabet soup and the tomato sauce in the basket",
    }
    droid = {
        "observation/exterior_image_1_left": image(),
        "observation/wrist_image_left": image(),
        "observation/joint_position": rng.standard_normal(7),
        "observation/gripper_position": rng.random(1),
        "prompt": "put the marker in the cup",
    }
    aloha = {
        "images": {cam: image(chw=True) for cam in ("cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist")},
        "state": rng.standard_normal(14).astype(np.float32),
        "prompt": "fold the towel",
    }
    return [("libero", libero), ("droid", droid), ("aloha", aloha)]


def random_text(r: random.Random, max_len=12, allow_empty=True):
    ranges = [(0x20, 0x7E), (0x20, 0x7E), (0x01, 0x1F), (0xA0, 0x2FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]
    n = r.randint(0 if allow_empty else 1, max_len)
    return "".join(chr(r.randint(*r.choice(ranges))) for _ in range(n))


def random_array(r: random.Random, rng: np.random.Generator):
    code = r.choice(DTYPES)
    order = r.choice("<>=|") if code[1] != "1" else r.choice("|<>=")
    dtype = np.dtype(order + code) if order != "|" or code[1] == "1" else np.dtype(code)
    ndim = r.randint(0, 8)
    shape = tuple(r.choice([0, 1, 1, 2, 3]) if r.random() < 0.1 else r.randint(1, 3) for _ in range(ndim))
    if ndim and np.prod(shape) > 0 and r.random() < 0.3 and ndim <= 3:
        shape = tuple(r.randint(1, 40) for _ in range(ndim))
    # np.asarray throughout: arithmetic on 0-d arrays gives numpy scalars, which pack differently.
    if dtype.kind == "b":
        array = np.asarray(rng.random(shape) < 0.5)
    elif dtype.kind == "f":
        with np.errstate(over="ignore"):
            array = np.asarray(np.asarray(rng.standard_normal(shape) * 10 ** r.randint(-3, 3)).astype(dtype))
        if array.size and r.random() < 0.2:
            array.flat[0] = r.choice([np.inf, -np.inf, np.nan, -0.0])
    else:
        info = np.iinfo(dtype)
        array = np.asarray(rng.integers(info.min, info.max, shape, dtype=dtype.newbyteorder("="), endpoint=True))
    array = np.asarray(array.astype(dtype))
    if ndim >= 2 and r.random() < 0.2:
        array = array.T  # packb's tobytes() writes C order; the shape says how to read it
    elif ndim >= 1 and shape[0] > 2 and r.random() < 0.2:
        array = array[::2]
    return array


def random_value(r: random.Random, rng: np.random.Generator, depth: int):
    kind = r.random()
    if kind < 0.4:
        return random_array(r, rng)
    if kind < 0.5:
        code = r.choice(DTYPES)
        dtype = np.dtype(code)
        if dtype.kind == "b":
            return np.bool_(r.random() < 0.5)
        if dtype.kind == "f":
            return dtype.type(r.uniform(-1e3, 1e3))
        info = np.iinfo(dtype)
        return dtype.type(r.randint(int(info.min), int(info.max)))
    if kind < 0.6:
        return r.choice([r.uniform(-1e6, 1e6), r.randint(INT64_MIN, INT64_MAX), r.randint(INT64_MAX + 1, UINT64_MAX),
                         r.random() < 0.5, None, 0, -1, 1e-300, float("inf")])
    if kind < 0.7:
        return [r.choice([r.uniform(-10, 10), r.randint(-1000, 1000), r.random() < 0.5,
                          np.float32(r.uniform(-1, 1)), np.int16(r.randint(-5, 5))])
                for _ in range(r.randint(0, 20))]
    if kind < 0.85:
        return random_text(r, 40)
    if depth < 3:
        return random_dict(r, rng, depth + 1)
    return random_text(r)


def random_dict(r: random.Random, rng: np.random.Generator, depth: int):
    out = {}
    for _ in range(r.randint(0, 6 if depth else 10)):
        key = r.choice(["observation/image", "state", "prompt", "images", "cam_high", "actions", "x"])
        if r.random() < 0.5:
            key = random_text(r, 10, allow_empty=False)
        out[key] = random_value(r, rng, depth)
    return out


def flat_keys_unique(obj, prefix="", seen=None):
    seen = set() if seen is None else seen
    for key, value in obj.items():
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            if not flat_keys_unique(value, path, seen):
                return False
        elif value is not None:
            if path in seen:
                return False
            seen.add(path)
    return True


# --- checks ------------------------------------------------------------------------------------------------


def check_decodes(tool, cases, failures):
    """cases: [(name, observation)]. Each is packed by openpi, then described and echoed by the tool."""
    frames = [msgpack_numpy.packb(obs) for _, obs in cases]
    described = run_batch(tool, "describe", frames)
    echoed = run_batch(tool, "echo", frames)
    for (name, _), frame, description, echo in zip(cases, frames, described, echoed):
        check_decode(name, frame, description, echo, failures)


def check_decode(name, frame, description, echo, failures):
    expected = expected_fields(msgpack_numpy.unpackb(frame))
    refused, out = description
    if refused:
        failures.append(f"{name}: describe failed: {out.decode('utf-8', 'replace')}")
        return
    got = out.decode().splitlines()
    want = describe_lines(expected)
    if got != want:
        diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        failures.append(f"{name}: describe differs at line {diff}: got {got[diff:diff + 1]}, want {want[diff:diff + 1]}")
        return
    refused, out = echo
    if refused:
        failures.append(f"{name}: echo failed: {out.decode('utf-8', 'replace')}")
        return
    echoed = msgpack_numpy.unpackb(out)
    if list(echoed) != [key for key, _ in expected]:
        failures.append(f"{name}: echo keys differ")
        return
    for key, leaf in expected:
        value = echoed[key]
        if leaf[0] == "S":
            ok = value == leaf[1]
        else:
            ok = (isinstance(value, np.ndarray) and value.dtype.str == leaf[1] and value.shape == leaf[2]
                  and value.tobytes() == leaf[3])
        if not ok:
            failures.append(f"{name}: echo of {key!r} differs: {value!r}")
            return


def expected_reply():
    halves = np.array([0x3C00, 0xC000, 0x7C00, 0x0001], "<u2").view("<f2").reshape(2, 2)
    return {
        "actions": (np.arange(70, dtype="<f8") * 0.25 - 3).reshape(10, 7),
        "policy_timing": {"infer_ms": 12.5},
        "server_timing": {"infer_ms": 13.25, "prev_total_ms": 20.0},
        "ints": [0, 1, 127, 128, 255, 256, 65535, 65536, 4294967295, 4294967296, INT64_MAX,
                 -1, -32, -33, -128, -129, -32768, -32769, -(2**31), INT64_MIN],
        "doubles": [0.0, -0.0, 1.5, -1e-300, 1.7976931348623157e308, 5e-324, float("inf"), float("-inf")],
        "flags": [True, False, None],
        "text": "café ✓ 🤖",
        "mask": np.array([True, False, True]),
        "halves": halves,
        "scalar": np.array(-7, "<i4"),
        "empty": np.zeros(0, "<f4"),
    }


def same(a, b):
    if isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and a.dtype.str == b.dtype.str and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(b, float):
        return isinstance(a, float) and np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


def check_reply(tool, failures):
    rc, out, err = run_tool(tool, "reply")
    if rc != 0:
        failures.append(f"reply failed: {err}")
        return
    got = msgpack_numpy.unpackb(out)
    want = expected_reply()
    for key in want:
        if not same(got.get(key), want[key]):
            failures.append(f"reply: {key!r} is {got.get(key)!r}, expected {want[key]!r}")
    if list(got) != list(want):
        failures.append(f"reply keys {list(got)}")
    # openpi's own packb of the same dict gives the same bytes: the layout is exactly openpi's.
    if msgpack_numpy.packb(want) != out:
        failures.append("reply: bytes differ from openpi's packb of the same dict")


def raw_ndarray(data, dtype, shape):
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def check_refusals(tool, failures):
    """(name, frame, openpi_refuses, needle): the tool must refuse each; openpi must too where marked."""
    good = msgpack_numpy.packb({"state": np.arange(4, dtype=np.float32), "prompt": "hi"})
    cases = [
        ("truncated", good[:-3], True, "truncated"),
        ("short data", msgpack.packb({"img": raw_ndarray(b"\0" * 5, "<f4", [2])}), True, "key 'img'"),
        ("bad dtype string", msgpack.packb({"img": raw_ndarray(b"\0" * 4, "<q9", [1])}), True, "key 'img'"),
        ("invalid UTF-8", b"\x81\xa1a\xa2\xc3\x28", True, "key 'a'"),
        ("complex", msgpack.packb({"z": raw_ndarray(b"\0" * 8, "<c8", [1])}), False, "complex"),
        ("extra data", msgpack.packb({"img": raw_ndarray(b"\0" * 12, "<f4", [2])}), False, "key 'img'"),
        ("duplicate key", b"\x82\xa1k\x01\xa1k\x02", False, "appears twice"),
        ("NUL in a string", msgpack.packb({"prompt": "a\0b"}), False, "key 'prompt'"),
        ("timestamp ext", msgpack.packb({"t": msgpack.Timestamp(1, 0)}, datetime=False), False, "key 't'"),
    ]
    results = run_batch(tool, "describe", [frame for _, frame, _, _ in cases])
    for (name, frame, openpi_refuses, needle), (refused, message) in zip(cases, results):
        message = message.decode("utf-8", "replace")
        if not refused or needle not in message:
            failures.append(f"refusal {name}: refused {refused}, message {message!r} lacks {needle!r}")
        if openpi_refuses:
            try:
                msgpack_numpy.unpackb(frame)
                failures.append(f"refusal {name}: openpi accepts it")
            except Exception:  # noqa: BLE001 - any error is a refusal
                pass
    return len(cases)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tool")
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    r = random.Random(args.seed)
    rng = np.random.default_rng(args.seed)
    failures = []

    cases = robot_observations(rng)
    for case in range(args.cases):
        obs = random_dict(r, rng, 0)
        if flat_keys_unique(obs):  # {"a/b": x, "a": {"b": y}} is refused on purpose
            cases.append((f"case {case}", obs))
    check_decodes(args.tool, cases, failures)
    decoded = len(cases)
    check_reply(args.tool, failures)
    refusals = check_refusals(args.tool, failures)

    for failure in failures[:20]:
        print(failure)
    print(f"{decoded} observations decoded and echoed, 1 reply, {refusals} refusals: "
          f"{len(failures)} mismatches")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
