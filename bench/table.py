#!/usr/bin/env python3
"""Prints bench/device.sh's JSON lines as a short table: one row per `pi0 bench` run."""
import json
import sys

rows = []
command = None
for line in open(sys.argv[1]):
    if line.startswith("## "):
        command = line[3:].strip()
        continue
    try:
        r = json.loads(line)
    except json.JSONDecodeError:
        continue
    lat, st = r["latency_ms"], r["stages_ms"]
    rows.append((command, r["batch"], r["cameras"] - r["masked_cameras"], r["horizon"], lat["p50"], lat["p95"], lat["min"],
                 r["samples_per_s"], st["vision"], st["prefix"], st["denoise"], r["peak_gpu_memory_gb"]))
print(f"{'command':<58} {'B':>3} {'cam':>3} {'H':>3} {'p50 ms':>8} {'p95 ms':>8} {'min ms':>8} {'samples/s':>9} "
      f"{'vis':>6} {'pre':>6} {'den':>6} {'GB':>5}")
for c, b, cam, h, p50, p95, mn, sps, v, p, d, gb in rows:
    print(f"{c:<58} {b:>3} {cam:>3} {h:>3} {p50:>8.2f} {p95:>8.2f} {mn:>8.2f} {sps:>9.1f} {v:>6.2f} {p:>6.2f} {d:>6.2f} {gb:>5.1f}")
