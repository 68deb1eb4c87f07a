#!/usr/bin/env python3
"""serve_load.py - load generator for `pi0 serve` (or any openpi websocket policy server).

N clients (openpi_client's WebsocketClientPolicy, one connection each) send R requests each (or for
--duration seconds), every client waiting for its answer before its next request, as a robot does. All
clients connect and warm up first, then start together; the figures cover the timed requests only:

    requests/s   timed requests / (last answer - common start)
    latency      per request, client side: pack, send, server, receive, unpack (p50, p99, mean, max, how many
                 took over 2 x p50)
    batch size   the server's server_timing.batch_size (pi0 serve), mean and max, when the server sends it
    breakdown    pi0 serve's server_timing, mean per request: receive, prep_queue, decode, prepare, queue, model,
                 encode, and the previous reply's send; then the client's own steps, timed around openpi's
                 client's calls: client_pack (msgpack), client_send (masking and writing the frame: overlaps the
                 server's receive), client_unpack; `other` is the latency minus the server's parts, the pack and
                 the unpack (the wire, the wake-ups, and the client waiting on its reader thread)

Observations are robots' camera frames at their native sizes (LIBERO 256x256, DROID 180x320). --vary gives
every request a prompt of a different length (1 to ~40 tokens); --drop-camera P leaves the wrist camera out of
a request with probability P (the server's adapter must list it in "optional_cameras").

Needs only the standard library, numpy and openpi-client (pip install openpi-client). Clients run as
threads spread over --processes processes (use more than one when the client side, not the server, would
be the limit: Python packs and unpacks each request under the GIL).

    python3 bench/serve_load.py --port 8000 --clients 16 --requests 200
    python3 bench/serve_load.py --port 8000 --clients 4 --obs droid --vary --duration 300 --json
    python3 bench/serve_load.py --port 8000 --clients 4 --obs my_robot_obs.msgpack --json
"""
import argparse
import gc
import json
import multiprocessing as mp
import sys
import threading
import time

import numpy as np
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy


PROMPTS = ["go", "pick up the cup", "put the black bowl on the plate", "open the top drawer and put the bowl inside",
           "turn on the stove and put the moka pot on it", "pick up the alphabet soup and place it in the basket",
           "put both the cream cheese box and the butter in the basket, then close the lid of the basket carefully"]
BREAKDOWN = ["receive_ms", "prep_queue_ms", "decode_ms", "prepare_ms", "queue_ms", "model_ms", "encode_ms",
             "prev_send_ms"]
CLIENT = ["client_pack_ms", "client_send_ms", "client_unpack_ms"]


GC_PAUSES = []  # this process's longer garbage collections: (start, ms, generation), time.perf_counter seconds
GC_COUNT = [0, 0, 0]  # every collection, by generation
_gc_start = [0.0]


def track_gc(phase, info):
    """gc.callbacks hook: a collection stops every thread of the process, a client mid-send included."""
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        ms = (time.perf_counter() - _gc_start[0]) * 1e3
        GC_COUNT[info["generation"]] += 1
        if ms > 0.2 or info["generation"] == 2:
            GC_PAUSES.append((_gc_start[0], ms, info["generation"]))


def gc_ms_between(t0, t1):
    """Milliseconds of this process's garbage collection inside [t0, t1] (perf_counter seconds)."""
    return sum(max(0.0, min(t1, s + ms / 1e3) - max(t0, s)) * 1e3 for s, ms, _ in GC_PAUSES[-64:])


def infer_timed(policy, obs):
    """openpi's WebsocketClientPolicy.infer, step by step (the same calls), with each step's milliseconds."""
    t0 = time.perf_counter()
    data = policy._packer.pack(obs)
    t1 = time.perf_counter()
    policy._ws.send(data)
    t2 = time.perf_counter()
    response = policy._ws.recv()
    t3 = time.perf_counter()
    if isinstance(response, str):
        raise RuntimeError(f"Error in inference server:\n{response}")
    reply = msgpack_numpy.unpackb(response)
    t4 = time.perf_counter()
    return reply, (t4 - t0) * 1e3, {"client_pack_ms": (t1 - t0) * 1e3, "client_send_ms": (t2 - t1) * 1e3,
                                    "client_unpack_ms": (t4 - t3) * 1e3}, (t0, t4)
WRIST = {"libero": "observation/wrist_image", "droid": "observation/wrist_image_left"}


def make_obs(kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "libero":
        return {
            "observation/image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8),
            "observation/state": (rng.normal(size=8) * 0.1).astype(np.float32),
            "prompt": "put the black bowl on the plate",
        }
    if kind == "droid":
        return {
            "observation/exterior_image_1_left": rng.integers(0, 256, (180, 320, 3), dtype=np.uint8),
            "observation/wrist_image_left": rng.integers(0, 256, (180, 320, 3), dtype=np.uint8),
            "observation/joint_position": (rng.normal(size=7) * 0.1).astype(np.float32),
            "observation/gripper_position": np.array([0.5], dtype=np.float32),
            "prompt": "open the drawer",
        }
    with open(kind, "rb") as f:  # an observation saved as msgpack (what `pi0 infer --obs` reads)
        return msgpack_numpy.unpackb(f.read())


def request(args, obs, rng):
    """The observation of one request: another prompt (--vary), the wrist camera left out (--drop-camera)."""
    if not args.vary and not args.drop_camera:
        return obs
    obs = dict(obs)
    if args.vary:
        obs["prompt"] = PROMPTS[int(rng.integers(len(PROMPTS)))]
    if args.drop_camera and rng.random() < args.drop_camera:
        obs.pop(WRIST.get(args.obs, ""), None)
    return obs


def run_client(args, index, barrier, out):
    result = {"latencies": [], "batches": [], "timings": [], "error": None, "t0": None, "t1": None}
    rng = np.random.default_rng(1000 + index)
    try:
        obs = make_obs(args.obs, index)
        policy = WebsocketClientPolicy(args.host, args.port, api_key=args.api_key)
        for _ in range(args.warmup):
            policy.infer(obs)
    except Exception as e:  # noqa: BLE001 - reported in the summary
        result["error"] = f"client {index} setup: {type(e).__name__}: {e}"
        barrier.abort()
        out.append(result)
        return
    try:
        barrier.wait(args.timeout)
    except Exception:  # noqa: BLE001 - another client failed
        result["error"] = result["error"] or f"client {index}: aborted (another client failed)"
        out.append(result)
        return
    result["t0"] = time.monotonic()
    end = result["t0"] + args.duration if args.duration else None
    try:
        k = 0
        while (k < args.requests) if end is None else (time.monotonic() < end):
            one = request(args, obs, rng)
            reply, ms, client, (t_start, t_end) = infer_timed(policy, one)
            result["latencies"].append(ms)
            timing = reply.get("server_timing", {})
            steps = {k: round(float(v), 3) for k, v in {**timing, **client}.items()}
            steps["gc_ms"] = round(gc_ms_between(t_start, t_end), 3)
            # the start is perf_counter (CLOCK_MONOTONIC: the same clock in every process and in pi0 serve's log)
            entry = (round(ms, 2), steps, round(time.monotonic() - result["t0"], 2), round(t_start, 4), index)
            result["slowest"] = sorted(result.get("slowest", []) + [entry], key=lambda x: -x[0])[:8]
            if timing.get("batch_size") is not None:
                result["batches"].append(int(timing["batch_size"]))
            result["timings"].append({**{key: float(timing.get(key, 0.0)) for key in BREAKDOWN if key in timing},
                                      **client})
            k += 1
    except Exception as e:  # noqa: BLE001
        result["error"] = f"client {index} request {len(result['latencies'])}: {type(e).__name__}: {e}"
    result["t1"] = time.monotonic()
    try:
        policy._ws.close()
    except Exception:  # noqa: BLE001
        pass
    out.append(result)


def run_process(args, indices, barrier, queue):
    gc.callbacks.append(track_gc)
    out = []
    threads = [threading.Thread(target=run_client, args=(args, i, barrier, out)) for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if out:  # the process's collections travel with its first client's result
        out[0]["gc"] = {"count": GC_COUNT, "long": [(round(ms, 3), gen) for _, ms, gen in GC_PAUSES]}
    queue.put(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="host, or a ws:// URI (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--clients", type=int, default=1, help="concurrent clients (default 1)")
    p.add_argument("--requests", type=int, default=100, help="timed requests per client (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per client first (default 5)")
    p.add_argument("--obs", default="libero", help="libero, droid, or an observation .msgpack file (default libero)")
    p.add_argument("--duration", type=float, default=0, help="seconds each client sends for, instead of --requests")
    p.add_argument("--vary", action="store_true", help="a prompt of another length in every request")
    p.add_argument("--drop-camera", type=float, default=0, help="probability of leaving the wrist camera out")
    p.add_argument("--processes", type=int, default=1, help="client processes (default 1)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for every client to warm up")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if args.clients < 1 or args.requests < 1 or args.processes < 1 or args.warmup < 0 or args.duration < 0:
        p.error("--clients, --requests and --processes must be >= 1, --warmup and --duration >= 0")
    if not 0 <= args.drop_camera <= 1:
        p.error("--drop-camera is a probability")

    probe = WebsocketClientPolicy(args.host, args.port, api_key=args.api_key)
    metadata = probe.get_server_metadata()
    probe._ws.close()

    procs = min(args.processes, args.clients)
    barrier = mp.Barrier(args.clients)
    queue = mp.Queue()
    shares = [list(range(k, args.clients, procs)) for k in range(procs)]
    workers = [mp.Process(target=run_process, args=(args, share, barrier, queue)) for share in shares]
    for w in workers:
        w.start()
    results = []
    for _ in workers:
        results.extend(queue.get())
    for w in workers:
        w.join()

    errors = [r["error"] for r in results if r["error"]]
    lat = np.array([x for r in results for x in r["latencies"]])
    batches = np.array([x for r in results for x in r["batches"]])
    timings = [t for r in results for t in r["timings"]]
    breakdown = None
    if timings and any(timings):
        breakdown = {k: round(float(np.mean([t.get(k, 0.0) for t in timings])), 3) for k in BREAKDOWN + CLIENT}
        counted = [k for k in breakdown if k not in ("prev_send_ms", "client_send_ms")]
        breakdown["other_ms"] = round(float(lat.mean()) - sum(breakdown[k] for k in counted), 3)
    started = [r["t0"] for r in results if r["t0"] is not None]
    finished = [r["t1"] for r in results if r["t1"] is not None]
    wall = (max(finished) - min(started)) if started and finished else float("nan")
    gcs = [x for r in results if "gc" in r for x in r["gc"]["long"]]
    gc_counts = [sum(r["gc"]["count"][g] for r in results if "gc" in r) for g in range(3)]
    slowest = sorted([x for r in results for x in r.get("slowest", [])], key=lambda x: -x[0])
    summary = {
        "uri": probe._uri,
        "server": {k: metadata.get(k) for k in ("engine", "backend", "adapter", "max_batch", "batch_wait_ms")
                   if k in metadata},
        "clients": args.clients,
        "requests_per_client": args.requests,
        "warmup_per_client": args.warmup,
        "obs": args.obs,
        "processes": procs,
        "requests": int(lat.size),
        "errors": len(errors),
        "seconds": round(wall, 3),
        "requests_per_s": round(lat.size / wall, 2) if lat.size and wall > 0 else 0.0,
        "latency_ms": {
            "p50": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
            "p99": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
            "mean": round(float(lat.mean()), 2) if lat.size else None,
            "max": round(float(lat.max()), 2) if lat.size else None,
            "over_2x_p50": int((lat > 2 * np.percentile(lat, 50)).sum()) if lat.size else None,
        },
        "breakdown_ms": breakdown,
        # the slowest requests (up to 8 per client, the 12 slowest of them): latency, the server's and the client's
        # timing of it (gc_ms: the client process's garbage collection during it), seconds into the run, its start
        # (CLOCK_MONOTONIC seconds, comparable across clients and with the server's log), the client
        "slowest": slowest[:12],
        "client_gc": {"collections": gc_counts, "over_0.2ms": len(gcs),
                      "longest_ms": round(max((ms for ms, _ in gcs), default=0.0), 3)},
        "vary": args.vary,
        "drop_camera": args.drop_camera,
        "batch_size": {"mean": round(float(batches.mean()), 2), "max": int(batches.max())} if batches.size else None,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        s, l = summary, summary["latency_ms"]
        server = ", ".join(f"{k} {v}" for k, v in s["server"].items())
        each = f"for {args.duration:g} s" if args.duration else f"x {s['requests_per_client']} requests"
        print(f"serve_load: {s['clients']} clients {each} (after {s['warmup_per_client']} warm-up each), {s['obs']} "
              f"observations{', varied prompts' if args.vary else ''}"
              f"{f', wrist camera dropped at p={args.drop_camera:g}' if args.drop_camera else ''}, {s['uri']} ({server})")
        line = (f"requests/s {s['requests_per_s']:.1f}   latency ms p50 {l['p50']}  p99 {l['p99']}  mean {l['mean']}  "
                f"max {l['max']} ({l['over_2x_p50']} over 2 x p50)")
        if s["batch_size"]:
            line += f"   batch size mean {s['batch_size']['mean']} (max {s['batch_size']['max']})"
        print(line + f"   errors {s['errors']}")
        if breakdown:
            print("means (ms): " + "  ".join(f"{k[:-3]} {v}" for k, v in breakdown.items()))
    for e in errors[:5]:
        print(f"serve_load: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
