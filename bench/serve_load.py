#!/usr/bin/env python3
"""serve_load.py - load generator for `pi0 serve` (or any openpi websocket policy server).

N clients (openpi_client's WebsocketClientPolicy, one connection each) send R requests each, every client
waiting for its answer before its next request, as a robot does. All clients connect and warm up first,
then start together; the figures cover the timed requests only:

    requests/s   timed requests / (last answer - common start)
    latency      per request, client side: pack, send, server, receive, unpack (p50, p99, mean, max)
    batch size   the server's server_timing.batch_size (pi0 serve), mean and max, when the server sends it

Needs only the standard library, numpy and openpi-client (pip install openpi-client). Clients run as
threads spread over --processes processes (use more than one when the client side, not the server, would
be the limit: Python packs and unpacks each request under the GIL).

    python3 bench/serve_load.py --port 8000 --clients 16 --requests 200
    python3 bench/serve_load.py --port 8000 --clients 4 --obs my_robot_obs.msgpack --json
"""
import argparse
import json
import multiprocessing as mp
import sys
import threading
import time

import numpy as np
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy


def make_obs(kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "libero":
        return {
            "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
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


def run_client(args, index, barrier, out):
    result = {"latencies": [], "batches": [], "error": None, "t0": None, "t1": None}
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
    try:
        for _ in range(args.requests):
            t = time.monotonic()
            reply = policy.infer(obs)
            result["latencies"].append((time.monotonic() - t) * 1e3)
            batch = reply.get("server_timing", {}).get("batch_size")
            if batch is not None:
                result["batches"].append(int(batch))
    except Exception as e:  # noqa: BLE001
        result["error"] = f"client {index} request {len(result['latencies'])}: {type(e).__name__}: {e}"
    result["t1"] = time.monotonic()
    try:
        policy._ws.close()
    except Exception:  # noqa: BLE001
        pass
    out.append(result)


def run_process(args, indices, barrier, queue):
    out = []
    threads = [threading.Thread(target=run_client, args=(args, i, barrier, out)) for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="host, or a ws:// URI (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--clients", type=int, default=1, help="concurrent clients (default 1)")
    p.add_argument("--requests", type=int, default=100, help="timed requests per client (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests per client first (default 5)")
    p.add_argument("--obs", default="libero", help="libero, droid, or an observation .msgpack file (default libero)")
    p.add_argument("--processes", type=int, default=1, help="client processes (default 1)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for every client to warm up")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if args.clients < 1 or args.requests < 1 or args.processes < 1 or args.warmup < 0:
        p.error("--clients, --requests and --processes must be >= 1, --warmup >= 0")

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
    started = [r["t0"] for r in results if r["t0"] is not None]
    finished = [r["t1"] for r in results if r["t1"] is not None]
    wall = (max(finished) - min(started)) if started and finished else float("nan")
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
        },
        "batch_size": {"mean": round(float(batches.mean()), 2), "max": int(batches.max())} if batches.size else None,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        s, l = summary, summary["latency_ms"]
        server = ", ".join(f"{k} {v}" for k, v in s["server"].items())
        print(f"serve_load: {s['clients']} clients x {s['requests_per_client']} requests (after {s['warmup_per_client']} "
              f"warm-up each), {s['obs']} observations, {s['uri']} ({server})")
        line = (f"requests/s {s['requests_per_s']:.1f}   latency ms p50 {l['p50']}  p99 {l['p99']}  mean {l['mean']}  "
                f"max {l['max']}")
        if s["batch_size"]:
            line += f"   batch size mean {s['batch_size']['mean']} (max {s['batch_size']['max']})"
        print(line + f"   errors {s['errors']}")
    for e in errors[:5]:
        print(f"serve_load: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
