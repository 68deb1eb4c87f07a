#!/usr/bin/env python3
"""server_test.py - `pi0 serve` end to end, with openpi's own client (openpi_client) and hostile ones.

Starts `pi0 serve` (from $PI0_BIN, default build/pi0) on the CPU backend on a tiny random checkpoint
(tests/make_policy_checkpoint.sh) and checks:
  - the metadata frame, openpi's reply fields, GET /healthz;
  - LIBERO and DROID observations give exactly the actions of `pi0 infer` on the same msgpack file (same seed);
  - fragmented and pipelined requests;
  - hostile clients: garbage instead of a handshake, garbage frames, garbage/truncated msgpack, wrong dtypes,
    shapes and missing keys, a text frame, a 200 MB frame (refused without buffering it: the server's peak RSS),
    clients vanishing mid-frame and mid-request -- each gets a text frame + close 1011 or is dropped, while
    another client keeps getting correct answers throughout;
  - 64 clients at once; 16 clients x 200 requests with zero failures, flat server RSS and batches > 1;
  - SIGTERM with clients connected: close 1001, exit 0 promptly, and nothing from the sanitizers.
Prints one line per check and a final "N passed, N failed".
"""
import base64
import faulthandler
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings

import numpy as np
import websockets.sync.client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

BIN = os.environ.get("PI0_BIN", "build/pi0")
SEED = 1234
STEPS = 3
LOAD_CLIENTS = int(os.environ.get("PI0_SERVER_TEST_CLIENTS", "16"))
LOAD_REQUESTS = int(os.environ.get("PI0_SERVER_TEST_REQUESTS", "200"))
SANITIZED = bool(re.search(r"asan", BIN))  # the ASan build is slower: looser time limits only
# A request that ran alone must match `pi0 infer` bit for bit. One batched with others gets the same noise
# (the policy draws it from the request's seed), but the CPU GEMMs of a larger batch may round differently.
BATCHED_TOLERANCE = 1e-5
ASAN_QUARANTINE_MB = 8
RSS_GROWTH_MB = 10 + (ASAN_QUARANTINE_MB + 8 if SANITIZED else 0)  # allowed after warm-up

warnings.filterwarnings("ignore", category=DeprecationWarning)  # websockets: connect() outside a `with`

passed = 0
failed = 0


def check(name, fn):
    global passed, failed
    t0 = time.monotonic()
    try:
        note = fn()
        passed += 1
        print(f"ok   {name} ({time.monotonic() - t0:.1f} s){': ' + note if note else ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
        failed += 1
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)


# ---- observations -----------------------------------------------------------------------------------------


def libero_obs(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.normal(size=8).astype(np.float32) * 0.1,
        "prompt": "put the black bowl on the plate",
    }


def droid_obs(seed=0):
    rng = np.random.default_rng(100 + seed)
    return {
        "observation/exterior_image_1_left": rng.integers(0, 256, (180, 320, 3), dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, (180, 320, 3), dtype=np.uint8),
        "observation/joint_position": rng.normal(size=7).astype(np.float32) * 0.1,
        "observation/gripper_position": np.array([0.5], dtype=np.float32),
        "prompt": "open the drawer",
    }


# ---- the server -------------------------------------------------------------------------------------------


def proc_status_kb(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


class Server:
    def __init__(self, workdir, checkpoint, adapter, *extra, name="server"):
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.log = open(self.log_path, "w+b")
        args = [BIN, "serve", "--checkpoint", checkpoint, "--adapter", adapter, "--port", "0", "--backend", "cpu",
                "--steps", str(STEPS), *extra]
        env = dict(os.environ)
        if SANITIZED:
            # ASan holds freed memory in a quarantine (256 MB by default), which would read as RSS growth in the
            # load check; a small one still catches a use right after a free. Leaks are LeakSanitizer's, at exit.
            env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), f"quarantine_size_mb={ASAN_QUARANTINE_MB}"]))
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, env=env)
        line = b""
        deadline = time.monotonic() + 120
        while not line.endswith(b"\n"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise RuntimeError(f"pi0 serve did not start: {self.stderr()[-2000:]}")
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                c = self.proc.stdout.read1(1)
                if not c:
                    continue
                line += c
        m = re.match(rb"listening on ws://([^:]+):(\d+)\n", line)
        if not m:
            raise RuntimeError(f"unexpected first line {line!r}")
        self.port = int(m.group(2))
        self.uri = f"ws://127.0.0.1:{self.port}"

    def pid(self):
        return self.proc.pid

    def rss_kb(self):
        return proc_status_kb(self.proc.pid, "VmRSS")

    def hwm_kb(self):
        return proc_status_kb(self.proc.pid, "VmHWM")

    def alive(self):
        return self.proc.poll() is None

    def stderr(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout=30):
        """SIGTERM; returns (exit code, seconds to exit)."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        return rc, time.monotonic() - t0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def sanitizer_report(text):
    m = re.search(r"(ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|SUMMARY: \w+Sanitizer).*", text)
    return m.group(0) if m else None


# ---- a raw websocket client, for what the websockets package will not send -------------------------------


class RawWs:
    def __init__(self, port, timeout=20, version="13", http="HTTP/1.1"):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /any/path {http}\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: {version}\r\n"
                           f"Authorization: Api-Key test\r\n\r\n").encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("connection closed during the handshake")
            self.buf += chunk
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError(f"handshake refused: {head[:200]!r}")

    @staticmethod
    def frame_header(opcode, length, fin=True, mask=b"\x11\x22\x33\x44"):
        b0 = (0x80 if fin else 0) | opcode
        if length < 126:
            head = struct.pack("!BB", b0, 0x80 | length)
        elif length < 65536:
            head = struct.pack("!BBH", b0, 0x80 | 126, length)
        else:
            head = struct.pack("!BBQ", b0, 0x80 | 127, length)
        return head + mask

    @staticmethod
    def mask(payload, key=b"\x11\x22\x33\x44"):
        a = np.frombuffer(payload, dtype=np.uint8)
        k = np.resize(np.frombuffer(key, dtype=np.uint8), a.size)
        return (a ^ k).tobytes()

    def send_frame(self, opcode, payload, fin=True):
        self.sock.sendall(self.frame_header(opcode, len(payload), fin) + self.mask(payload))

    def _read(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed by the server")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv_frame(self):
        b0, b1 = self._read(2)
        length = b1 & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self._read(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self._read(8))
        if b1 & 0x80:
            raise RuntimeError("the server sent a masked frame")
        return bool(b0 & 0x80), b0 & 0x0F, self._read(length)

    def recv_message(self):
        """(kind, payload): kind 'binary', 'text' or 'close' (payload = (code, reason))."""
        data, kind = b"", None
        while True:
            fin, opcode, payload = self.recv_frame()
            if opcode == 8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                return "close", (code, payload[2:].decode(errors="replace"))
            if opcode in (9, 10):
                continue
            if opcode in (1, 2):
                kind = "text" if opcode == 1 else "binary"
            data += payload
            if fin:
                return kind, data

    def close(self):
        self.sock.close()


# ---- helpers -----------------------------------------------------------------------------------------------

max_batched_diff = [0.0]


def check_actions(reply, want, what="answer"):
    """Exact when the request ran alone (server_timing.batch_size 1), within BATCHED_TOLERANCE otherwise."""
    a = reply["actions"]
    batch = reply["server_timing"]["batch_size"]
    if a.shape != want.shape or a.dtype != want.dtype:
        raise AssertionError(f"{what}: actions {a.dtype} {a.shape}, expected {want.dtype} {want.shape}")
    diff = float(np.abs(a - want).max())
    if batch == 1 and diff != 0:
        raise AssertionError(f"{what}: ran alone but differs from pi0 infer by {diff:g}")
    if diff > BATCHED_TOLERANCE * max(1.0, float(np.abs(want).max())):
        raise AssertionError(f"{what}: in a batch of {batch}, differs from pi0 infer by {diff:g}")
    max_batched_diff[0] = max(max_batched_diff[0], diff)
    return batch


def reference_actions(workdir, checkpoint, adapter, obs, name):
    path = os.path.join(workdir, f"{name}.msgpack")
    out = os.path.join(workdir, f"{name}.reply.msgpack")
    with open(path, "wb") as f:
        f.write(msgpack_numpy.packb(obs))
    r = subprocess.run([BIN, "infer", "--checkpoint", checkpoint, "--adapter", adapter, "--obs", path, "--output", out,
                        "--seed", str(SEED), "--steps", str(STEPS), "--backend", "cpu", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise RuntimeError(f"pi0 infer failed: {r.stderr.strip()}")
    with open(out, "rb") as f:
        return msgpack_numpy.unpackb(f.read())["actions"]


def expect_refused(ws, what):
    """The websockets client `ws` must get a text frame (the error) and then a close with code 1011."""
    msg = ws.recv(timeout=60)
    if not isinstance(msg, str):
        raise AssertionError(f"{what}: expected a text frame (the error), got {type(msg).__name__}")
    try:
        extra = ws.recv(timeout=60)
        raise AssertionError(f"{what}: expected the close after the error, got {extra!r:.80}")
    except websockets.exceptions.ConnectionClosed as e:
        code = e.rcvd.code if e.rcvd else None
        if code != 1011:
            raise AssertionError(f"{what}: close code {code}, expected 1011")
    return msg


class GoodClient(threading.Thread):
    """Sends the same observation over and over while the hostile checks run, comparing each answer."""

    def __init__(self, uri, obs, expected):
        super().__init__(daemon=True)
        self.uri, self.obs, self.expected = uri, obs, expected
        self.ok = 0
        self.errors = []
        self.halt = threading.Event()
        self.max_ms = 0.0  # its slowest answer since the last reset

    def run(self):
        try:
            client = WebsocketClientPolicy(self.uri)
            while not self.halt.is_set():
                t = time.monotonic()
                check_actions(client.infer(self.obs), self.expected, f"answer {self.ok}")
                self.max_ms = max(self.max_ms, (time.monotonic() - t) * 1e3)
                self.ok += 1
            client._ws.close()
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"{type(e).__name__}: {e}")

    def finish(self):
        self.halt.set()
        self.join(120)
        if self.is_alive():
            raise AssertionError("the good client hung")
        if self.errors:
            raise AssertionError(f"the good client failed: {self.errors[:3]}")
        if self.ok < 3:
            raise AssertionError(f"the good client got only {self.ok} answers")
        return self.ok


# ---- the checks --------------------------------------------------------------------------------------------


def main():
    # a hung check fails the run (with every thread's stack) instead of hanging it
    faulthandler.dump_traceback_later(float(os.environ.get("PI0_SERVER_TEST_TIMEOUT_S", "1800")), exit=True)
    if not os.path.exists(BIN):
        print(f"server_test: no {BIN} (set PI0_BIN)")
        print("0 passed, 1 failed")
        return 1
    workdir = tempfile.mkdtemp(prefix="pi0_server_test_")
    servers = []
    try:
        return run(workdir, servers)
    finally:
        for s in servers:
            s.kill()
        if failed == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"(server logs kept in {workdir})")


def run(workdir, servers):
    # The tiny checkpoint (224x224 cameras) serves DROID; the main server runs the same weights' dims with
    # 56x56 cameras (16 patches), ~10x cheaper on the CPU, so that thousands of requests fit the time budget.
    tiny = os.path.join(workdir, "tiny")
    checkpoint = os.path.join(workdir, "fast")
    r = subprocess.run(["tests/make_policy_checkpoint.sh", tiny], capture_output=True, text=True,
                       env={**os.environ, "PI0_BIN": BIN})
    if not r.returncode:
        with open(os.path.join(tiny, "config.json")) as f:
            config = json.load(f)
        config["dims"]["image_size"] = 56
        with open(os.path.join(workdir, "fast_dims.json"), "w") as f:
            json.dump(config, f)
        r = subprocess.run([BIN, "init", "--dims", os.path.join(workdir, "fast_dims.json"), "--output", checkpoint,
                            "--seed", "7"], capture_output=True, text=True)
    if r.returncode:
        print(f"server_test: making the test checkpoints failed: {r.stderr.strip()[-2000:]}")
        print("0 passed, 1 failed")
        return 1
    shutil.copy(os.path.join(tiny, "paligemma_tokenizer.model"), checkpoint)
    shutil.copytree(os.path.join(tiny, "assets"), os.path.join(checkpoint, "assets"))

    # max batch 8, wait 5 ms; the default 64 MiB frame limit
    srv = Server(workdir, checkpoint, "libero", "--seed", str(SEED), "--max-batch", "8", "--batch-wait-ms", "5")
    servers.append(srv)
    obs = libero_obs()
    ref = {}

    def t_reference():
        ref["libero"] = reference_actions(workdir, checkpoint, "libero", obs, "libero")
        ref["libero2"] = reference_actions(workdir, checkpoint, "libero", libero_obs(1), "libero2")
        a = ref["libero"]
        assert a.dtype == np.float64 and a.ndim == 2 and a.shape[1] == 7, f"infer gave {a.dtype} {a.shape}"
        assert not np.array_equal(a, ref["libero2"]), "two observations gave the same actions"
        return f"pi0 infer: actions {a.shape}"

    check("pi0 infer reference (LIBERO)", t_reference)
    if "libero" not in ref:
        return 1
    horizon = ref["libero"].shape[0]

    def t_metadata():
        client = WebsocketClientPolicy(srv.uri)
        md = client.get_server_metadata()
        client._ws.close()
        assert md["engine"] == "pi0" and md["model"] == "pi0" and md["adapter"] == "libero", md
        assert md["action_horizon"] == horizon and md["action_dims"] == 7, md
        assert md["max_batch"] == 8 and md["backend"] == "cpu", md
        return f"{md}"

    check("metadata frame", t_metadata)

    def t_libero_exact():
        client = WebsocketClientPolicy(srv.uri, api_key="test-key")  # openpi's optional Authorization header
        first = client.infer(obs)
        second = client.infer(libero_obs(1))
        third = client.infer(obs)
        client._ws.close()
        for reply, want in ((first, ref["libero"]), (second, ref["libero2"]), (third, ref["libero"])):
            a = reply["actions"]
            assert a.dtype == np.float64 and a.shape == want.shape, f"{a.dtype} {a.shape}"
            assert np.array_equal(a, want), f"differs from pi0 infer by {np.abs(a - want).max():g}"
        assert set(first) == {"actions", "policy_timing", "server_timing"}, set(first)
        assert first["policy_timing"]["infer_ms"] > 0
        st = first["server_timing"]
        assert st["infer_ms"] > 0 and "prev_total_ms" not in st and st["batch_size"] == 1, st
        assert second["server_timing"]["prev_total_ms"] > 0, second["server_timing"]
        assert second["server_timing"]["prev_send_ms"] >= 0, second["server_timing"]
        parts = ("receive_ms", "prep_queue_ms", "decode_ms", "prepare_ms", "queue_ms", "model_ms", "encode_ms")
        assert all(st[k] >= 0 for k in parts) and st["prepare_ms"] > 0 and st["model_ms"] > 0, st
        assert st["model_ms"] == first["policy_timing"]["infer_ms"], (st, first["policy_timing"])
        return f"server_timing {third['server_timing']}"

    check("LIBERO: actions equal pi0 infer's exactly, openpi's reply fields", t_libero_exact)

    def t_droid_exact():
        d_obs = droid_obs()
        want = reference_actions(workdir, tiny, "droid", d_obs, "droid")
        dsrv = Server(workdir, tiny, "droid", "--seed", str(SEED), "--quiet", name="droid")
        servers.append(dsrv)
        client = WebsocketClientPolicy(dsrv.uri)
        md = client.get_server_metadata()
        a = client.infer(d_obs)["actions"]
        client._ws.close()
        rc, _ = dsrv.stop()
        assert md["adapter"] == "droid" and md["action_dims"] == 8, md
        assert a.shape == (horizon, 8) and want.shape == (horizon, 8), f"{a.shape} {want.shape}"
        assert np.array_equal(a, want), f"differs from pi0 infer by {np.abs(a - want).max():g}"
        assert rc == 0, f"droid server exit {rc}: {dsrv.stderr()[-1500:]}"
        return f"actions {a.shape}"

    check("DROID (180x320 frames, 224x224 model): actions equal pi0 infer's exactly", t_droid_exact)

    def t_pi05():
        pi05 = os.path.join(workdir, "pi05")
        r = subprocess.run(["tests/make_policy_checkpoint.sh", pi05, "pi05"], capture_output=True, text=True,
                           env={**os.environ, "PI0_BIN": BIN})
        assert r.returncode == 0, r.stderr[-2000:]
        notes = []
        for adapter, make_obs, dims in (("libero", libero_obs, 7), ("droid", droid_obs, 8)):
            o = make_obs(3)
            want = reference_actions(workdir, pi05, adapter, o, f"pi05_{adapter}")
            psrv = Server(workdir, pi05, adapter, "--seed", str(SEED), "--quiet", name=f"pi05_{adapter}")
            servers.append(psrv)
            client = WebsocketClientPolicy(psrv.uri)
            md = client.get_server_metadata()
            a = client.infer(o)["actions"]
            client._ws.close()
            rc, _ = psrv.stop()
            assert md["model"] == "pi05" and md["adapter"] == adapter and md["action_dims"] == dims, md
            assert a.shape == want.shape == (md["action_horizon"], dims), f"{a.shape} {want.shape}"
            assert np.array_equal(a, want), f"{adapter}: differs from pi0 infer by {np.abs(a - want).max():g}"
            assert rc == 0, f"pi05 {adapter} server exit {rc}: {psrv.stderr()[-1500:]}"
            notes.append(f"{adapter} {a.shape}")
        return ", ".join(notes)

    check("Pi0.5 (LIBERO without, DROID with the discrete state): actions equal pi0 infer's exactly", t_pi05)

    def t_healthz():
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/healthz", timeout=10) as r:
            body = r.read()
            assert r.status == 200 and body == b"OK\n", (r.status, body)
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/", timeout=10)
            raise AssertionError("GET / without an upgrade was answered 200")
        except urllib.error.HTTPError as e:
            assert e.code == 426, e.code

    check("GET /healthz -> 200 OK; GET / -> 426", t_healthz)

    def t_fragmented_pipelined():
        data = msgpack_numpy.packb(obs)
        ws = RawWs(srv.port)
        kind, _ = ws.recv_message()
        assert kind == "binary", kind
        # one request in five frames of uneven sizes, with a ping in between
        cuts = [0, 1, 1000, 70000, len(data) // 2, len(data)]
        for i in range(5):
            ws.send_frame(2 if i == 0 else 0, data[cuts[i]:cuts[i + 1]], fin=i == 4)
            if i == 2:
                ws.send_frame(9, b"ping")
        kind, payload = ws.recv_message()
        assert kind == "binary", (kind, payload[:200])
        assert check_actions(msgpack_numpy.unpackb(payload), ref["libero"]) == 1
        # three requests back to back, answered in order
        other = msgpack_numpy.packb(libero_obs(1))
        for d in (data, other, data):
            ws.send_frame(2, d)
        batches = []
        for want in (ref["libero"], ref["libero2"], ref["libero"]):
            kind, payload = ws.recv_message()
            assert kind == "binary", (kind, payload[:200])
            batches.append(check_actions(msgpack_numpy.unpackb(payload), want))
        ws.close()
        return f"pipelined batch sizes {batches}"

    check("fragmented request (5 frames + ping), 3 pipelined requests in order", t_fragmented_pipelined)

    def t_slow_parts_logged():
        # a request whose second half comes 120 ms after its first: answered, and the pause is in the log (where a
        # slow receive_ms went), with its size so far
        data = msgpack_numpy.packb(obs)
        ws = RawWs(srv.port)
        ws.recv_message()
        half = len(data) // 2
        for _ in range(2):  # the second pause, on the same connection within 10 s, is counted, not logged
            ws.send_frame(2, data[:half], fin=False)
            time.sleep(0.12)
            ws.send_frame(0, data[half:])
            kind, payload = ws.recv_message()
            assert kind == "binary", (kind, payload[:200])
            assert check_actions(msgpack_numpy.unpackb(payload), ref["libero"]) == 1
        ws.close()
        lines = [l for l in srv.stderr().splitlines() if "between two parts of a request" in l]
        assert sum(f"({half} bytes in so far" in l for l in lines) == 1, lines[-3:]
        # the event loop held up (here: the whole process stopped for 150 ms) is logged too
        os.kill(srv.proc.pid, signal.SIGSTOP)
        time.sleep(0.15)
        os.kill(srv.proc.pid, signal.SIGCONT)
        deadline = time.time() + 5
        while time.time() < deadline and "event loop held up" not in srv.stderr():
            time.sleep(0.05)
        held = [l for l in srv.stderr().splitlines() if "event loop held up" in l]
        assert held, srv.stderr()[-500:]
        return lines[-1].split(": ", 1)[1] + "; " + held[-1].split(": ", 1)[1]

    check("a request's pause between two parts and a held-up event loop are logged", t_slow_parts_logged)

    # -- hostile clients, with a good client running throughout
    good = GoodClient(srv.uri, obs, ref["libero"])
    good.start()
    hwm_before = srv.hwm_kb()

    def t_garbage_handshake():
        for n in (1, 100, 5000):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(os.urandom(n))
            s.settimeout(10)
            try:
                while s.recv(65536):
                    pass  # an HTTP error, then the close
            except (ConnectionResetError, socket.timeout):
                pass
            s.close()
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.close()  # connect and leave at once

    check("random bytes instead of a handshake: dropped", t_garbage_handshake)

    def t_garbage_frames():
        closed = 0
        for i in range(20):
            ws = RawWs(srv.port)
            ws.recv_message()
            ws.sock.sendall(os.urandom(64 + 97 * i))
            ws.sock.settimeout(1.5)
            try:
                while ws.recv_message()[0] != "close":
                    pass
                closed += 1
            except (ConnectionError, socket.timeout, RuntimeError, struct.error):
                pass
            ws.close()
        return (f"{closed}/20 closed by the server" +
                (", the others dropped by us while the server waited for the rest of a frame" if closed < 20 else ""))

    check("random bytes as websocket frames", t_garbage_frames)

    bad_obs = {
        "random bytes as the message": os.urandom(5000),
        "msgpack that is not a map": msgpack_numpy.packb([1, 2, 3]),
        "truncated msgpack": msgpack_numpy.packb(obs)[:100000],
        "truncated msgpack (header only)": msgpack_numpy.packb(obs)[:7],
        "missing key": msgpack_numpy.packb({k: v for k, v in obs.items() if k != "observation/wrist_image"}),
        "image of dtype int16": msgpack_numpy.packb({**obs, "observation/image": obs["observation/image"].astype(np.int16)}),
        "image of shape (224, 224)": msgpack_numpy.packb({**obs, "observation/image": obs["observation/image"][:, :, 0].copy()}),
        "image of shape (224, 224, 4)": msgpack_numpy.packb(
            {**obs, "observation/image": np.zeros((224, 224, 4), np.uint8)}),
        "image whose data is shorter than its shape": None,  # built below
        "state longer than action_dim": msgpack_numpy.packb({**obs, "observation/state": np.zeros(40, np.float32)}),
        "state as a string": msgpack_numpy.packb({**obs, "observation/state": "eight numbers"}),
        "prompt as an array": msgpack_numpy.packb({**obs, "prompt": np.zeros(3)}),
        "state with a NaN": msgpack_numpy.packb({**obs, "observation/state": np.full(8, np.nan, np.float32)}),
        "empty message": b"",
    }
    short = msgpack_numpy.packb(obs)
    marker = obs["observation/image"].tobytes()
    i = short.index(marker)
    # bin 32 header (0xc6 + 4-byte length) precedes the raw bytes; claim 1 byte fewer and drop one
    assert short[i - 5] == 0xC6
    bad_obs["image whose data is shorter than its shape"] = (
        short[:i - 4] + struct.pack(">I", len(marker) - 1) + short[i:i + len(marker) - 1] + short[i + len(marker):])

    def t_bad_requests():
        notes = []
        for what, data in bad_obs.items():
            ws = websockets.sync.client.connect(srv.uri, compression=None, max_size=None)
            ws.recv(timeout=30)
            ws.send(data)
            msg = expect_refused(ws, what)
            notes.append(msg)
        return f"{len(bad_obs)} cases, e.g. {notes[4]!r}"

    check("bad requests (garbage, truncated, wrong dtype/shape, missing key...): text + 1011", t_bad_requests)

    def t_text_frame():
        ws = websockets.sync.client.connect(srv.uri, compression=None, max_size=None)
        ws.recv(timeout=30)
        ws.send("hello")
        return repr(expect_refused(ws, "text frame"))

    check("a text frame: text + 1011", t_text_frame)

    def t_huge_frame():
        total = 200_000_000
        ws = RawWs(srv.port)
        ws.recv_message()
        hwm0 = srv.hwm_kb()
        chunk = RawWs.mask(bytes(1 << 20))
        ws.sock.sendall(RawWs.frame_header(2, total))
        sent = 0
        try:
            while sent < total:
                n = min(len(chunk), total - sent)
                ws.sock.sendall(chunk[:n])
                sent += n
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        outcome = "dropped"
        try:
            ws.sock.settimeout(10)
            kind, payload = ws.recv_message()
            if kind == "text":
                kind2, (code, _) = ws.recv_message()
                assert kind2 == "close" and code == 1011, (kind2, code)
                outcome = f"text {payload.decode()!r} + close 1011"
        except (ConnectionError, socket.timeout):
            pass
        ws.close()
        grew = (srv.hwm_kb() - hwm0) / 1024
        assert grew < 40, f"the server's peak RSS grew by {grew:.0f} MB"
        # the same in 1 MB fragments: each is small, the message is not (refused once past 64 MiB)
        ws = RawWs(srv.port)
        ws.recv_message()
        masked = RawWs.mask(bytes(1 << 20))
        fragments = 0
        try:
            for fragments in range(1, 81):
                ws.sock.sendall(RawWs.frame_header(2 if fragments == 1 else 0, len(masked), fin=fragments == 80) + masked)
        except (BrokenPipeError, ConnectionResetError):
            pass
        ws.sock.settimeout(10)
        kind, payload = ws.recv_message()
        assert kind == "text" and b"too large" in payload, (kind, payload[:200])
        kind, (code, _) = ws.recv_message()
        assert kind == "close" and code == 1011, (kind, code)
        ws.close()
        return (f"{sent / 1e6:.0f} MB sent before the server stopped reading; {outcome}; peak RSS +{grew:.1f} MB; "
                f"in 1 MB fragments: refused after {fragments}")

    check("a 200 MB frame: refused, not buffered; 80 MB in 1 MB fragments: refused", t_huge_frame)

    def t_vanishing():
        data = msgpack_numpy.packb(obs)
        for i in range(10):
            ws = RawWs(srv.port)
            ws.recv_message()
            if i % 3 == 0:
                ws.sock.sendall(RawWs.frame_header(2, len(data)) + RawWs.mask(data)[: len(data) // 2])  # mid-frame
            elif i % 3 == 1:
                ws.send_frame(2, data)  # a whole request, then gone before the answer
            else:
                ws.send_frame(2, data)
                ws.send_frame(2, data)  # two queued
            ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
            ws.close()
        c = WebsocketClientPolicy(srv.uri)  # the server still answers a newcomer
        check_actions(c.infer(obs), ref["libero"])
        c._ws.close()

    check("clients vanishing mid-frame and mid-request", t_vanishing)

    def t_huge_prompt():
        # a 16 MiB prompt: only max_token_len tokens are kept, so only about that much is tokenized, and not
        # on the model's thread: the request is answered quickly and the good client does not stall
        big = dict(obs)
        big["prompt"] = ("pick up the bowl " * 1000000)[:(16 << 20) - 1]  # just under the tokenizer's 16 MiB limit
        good.max_ms = 0.0
        t = time.monotonic()
        c = WebsocketClientPolicy(srv.uri)
        reply = c.infer(big)
        took = time.monotonic() - t
        c._ws.close()
        limit = 10 if SANITIZED else 2
        assert reply["actions"].shape == ref["libero"].shape, reply["actions"].shape
        assert took < limit, f"a 16 MiB prompt took {took:.1f} s"
        assert good.max_ms < limit * 1e3, f"the good client waited {good.max_ms:.0f} ms meanwhile"
        return f"answered in {took:.2f} s (prepare {reply['server_timing']['prepare_ms']:.0f} ms); the good client's " \
               f"slowest answer meanwhile {good.max_ms:.0f} ms"

    check("a 16 MiB prompt: bounded work, off the model's thread", t_huge_prompt)

    def t_good_client():
        n = good.finish()
        assert srv.alive(), "the server died"
        grew = (srv.hwm_kb() - hwm_before) / 1024
        return f"{n} correct answers during the hostile checks; server peak RSS +{grew:.1f} MB"

    check("a good client kept getting correct answers throughout", t_good_client)

    def t_many_clients():
        n = 64
        results, errors = [0] * n, []
        barrier = threading.Barrier(n)

        def one(i):
            try:
                c = WebsocketClientPolicy(srv.uri)
                barrier.wait(60)
                for _ in range(2):
                    check_actions(c.infer(obs), ref["libero"])
                    results[i] += 1
                c._ws.close()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert sum(results) == 2 * n, results

    check("64 clients at once", t_many_clients)

    def t_load():
        n, per = LOAD_CLIENTS, LOAD_REQUESTS
        warm = min(20, per // 4)
        obs_list = [obs, libero_obs(1)]
        expected = [ref["libero"], ref["libero2"]]
        errors, batch_sizes, counts = [], [], [0] * n
        warm_barrier = threading.Barrier(n + 1)
        lock = threading.Lock()
        rss = []

        def one(i):
            try:
                c = WebsocketClientPolicy(srv.uri)
                for k in range(per):
                    if k == warm:
                        warm_barrier.wait(300)
                    j = (i + k) % 2
                    reply = c.infer(obs_list[j])
                    check_actions(reply, expected[j], f"client {i} request {k}")
                    with lock:
                        batch_sizes.append(reply["server_timing"]["batch_size"])
                    counts[i] += 1
                c._ws.close()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                try:
                    warm_barrier.abort()
                except Exception:  # noqa: BLE001
                    pass

        t0 = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        warm_barrier.wait(300)
        t_warm = time.monotonic()
        while any(t.is_alive() for t in threads):
            rss.append(srv.rss_kb())
            time.sleep(0.1)
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        assert not errors, errors[:3]
        total = sum(counts)
        assert total == n * per, f"{total} of {n * per} answered"
        growth = (max(rss) - rss[0]) / 1024 if rss else 0
        assert growth < RSS_GROWTH_MB, f"server RSS grew by {growth:.1f} MB after warm-up ({rss[0] // 1024} -> {max(rss) // 1024} MB)"
        big = sum(b > 1 for b in batch_sizes)
        assert max(batch_sizes) > 1, "no batch larger than 1"
        return (f"{total} requests in {elapsed:.1f} s ({total / elapsed:.0f}/s), batches up to {max(batch_sizes)} "
                f"(mean {np.mean(batch_sizes):.2f}, {big} answers batched), RSS {rss[0] // 1024} MB -> max "
                f"{max(rss) // 1024} MB over {time.monotonic() - t_warm:.1f} s after warm-up; batched answers within "
                f"{max_batched_diff[0]:.2g} of pi0 infer's")

    check(f"{LOAD_CLIENTS} clients x {LOAD_REQUESTS} requests: no failures, flat RSS, batching", t_load)

    def t_websocket_edges():
        refused = []
        for version, http in (("8", "HTTP/1.1"), ("garbage", "HTTP/1.1"), ("13", "HTTP/1.0")):
            try:
                RawWs(srv.port, timeout=10, version=version, http=http).close()
            except (RuntimeError, ConnectionError, socket.timeout) as e:
                refused.append(f"{http} v{version}: {str(e)[:40]}")
                continue
            raise AssertionError(f"upgraded a {http} handshake with Sec-WebSocket-Version {version}")
        # a close code RFC 6455 does not allow on the wire: not echoed (the connection is just dropped)
        echoed = []
        for code in (5000, 65535, 1005, 999):
            ws = RawWs(srv.port)
            ws.recv_message()
            ws.send_frame(8, struct.pack("!H", code))
            ws.sock.settimeout(10)
            try:
                kind, payload = ws.recv_message()
                echoed.append((code, kind, payload))
            except (ConnectionError, socket.timeout):
                pass
            ws.close()
        assert not [e for e in echoed if e[0] == e[2][0]], f"invalid close codes echoed: {echoed}"
        ws = RawWs(srv.port)  # a valid one is echoed
        ws.recv_message()
        ws.send_frame(8, struct.pack("!H", 1000))
        kind, (code, _) = ws.recv_message()
        ws.close()
        assert (kind, code) == ("close", 1000), (kind, code)
        return f"refused: {'; '.join(refused)}; invalid close codes dropped, 1000 echoed"

    check("websocket edge cases: version 8/garbage and HTTP/1.0 refused, invalid close codes not echoed",
          t_websocket_edges)

    def t_shutdown():
        # clients connected: one idle, one in a request; SIGTERM -> they get 1001 and the server exits 0 at once
        idle = websockets.sync.client.connect(srv.uri, compression=None, max_size=None)
        idle.recv(timeout=30)
        busy = websockets.sync.client.connect(srv.uri, compression=None, max_size=None)
        busy.recv(timeout=30)
        raw = RawWs(srv.port)  # never answers the close handshake
        raw.recv_message()
        busy.send(msgpack_numpy.packb(obs))
        time.sleep(0.05)
        rc, took = srv.stop()
        codes = []
        for ws in (idle, busy):
            try:
                while True:
                    ws.recv(timeout=10)
            except websockets.exceptions.ConnectionClosed as e:
                codes.append(e.rcvd.code if e.rcvd else None)
        raw.close()
        err = srv.stderr()
        report = sanitizer_report(err)
        assert report is None, report
        assert rc == 0, f"exit {rc}: {err[-1500:]}"
        assert took < (15 if SANITIZED else 5), f"took {took:.1f} s"
        assert codes == [1001, 1001], codes
        summary = [line for line in err.splitlines() if "served" in line]
        return f"exit 0 in {took:.2f} s; {summary[-1] if summary else ''}"

    check("SIGTERM with clients connected: close 1001, exit 0, no sanitizer report", t_shutdown)

    def t_port_in_use():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([BIN, "serve", "--checkpoint", checkpoint, "--adapter", "libero", "--port", str(port),
                            "--backend", "cpu", "--quiet"], capture_output=True, text=True, timeout=120)
        s.close()
        assert r.returncode == 1 and "could not listen" in r.stderr, (r.returncode, r.stderr)
        r = subprocess.run([BIN, "serve", "--checkpoint", checkpoint], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.returncode
        r = subprocess.run([BIN, "serve", "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "--max-batch" in r.stdout, r.returncode

    check("port in use -> exit 1; bad command line -> exit 2; --help", t_port_in_use)

    def t_stalled_requests():
        # 16 clients announce 63 MB frames, send 8 MB and go silent: the transit budget (64 MB) refuses some at
        # once, the request timeout (2 s) ends the others, RSS stays within the budget, and a good client (its
        # request below 1 MB) is served meanwhile
        lim = Server(workdir, checkpoint, "libero", "--seed", str(SEED), "--max-transit-mb", "64",
                     "--request-timeout-s", "2", "--idle-timeout-s", "1", "--quiet", name="limits")
        servers.append(lim)
        rss0 = lim.rss_kb()
        stalled, outcomes = [], {}
        chunk = RawWs.mask(bytes(8 << 20))
        for _ in range(16):
            ws = RawWs(lim.port)
            ws.recv_message()
            try:
                ws.sock.sendall(RawWs.frame_header(2, 63 << 20) + chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            stalled.append(ws)
        peak = lim.rss_kb()
        c = WebsocketClientPolicy(lim.uri)
        reply = c.infer(obs)
        for ws in stalled:
            ws.sock.settimeout(10)
            try:
                kind, payload = ws.recv_message()
                key = "arriving" if b"arriving" in payload else "not complete" if b"not complete" in payload else payload[:60]
                outcomes[key] = outcomes.get(key, 0) + 1
            except (ConnectionError, socket.timeout):
                outcomes["dropped"] = outcomes.get("dropped", 0) + 1
            ws.close()
        c2 = WebsocketClientPolicy(lim.uri)
        second = c2.infer(obs)
        c2._ws.close()
        grew = (peak - rss0) / 1024
        assert outcomes.get("arriving", 0) > 0 and outcomes.get("not complete", 0) > 0, outcomes
        assert grew < 64 + 40, f"RSS grew by {grew:.0f} MB with 16 stalled 63 MB requests (budget 64 MB)"
        assert np.array_equal(reply["actions"], ref["libero"]) and np.array_equal(second["actions"], ref["libero"])
        # the first client has been idle for more than a second since its answer: closed with 1001
        time.sleep(1.5)
        try:
            c.infer(obs)
            raise AssertionError("an idle connection was not closed after --idle-timeout-s")
        except websockets.exceptions.ConnectionClosed as e:
            assert e.rcvd and e.rcvd.code == 1001, e
        return f"RSS +{grew:.0f} MB; outcomes {outcomes}; idle connection closed with 1001"

    check("16 stalled 63 MB requests: transit budget and request timeout bound RSS; idle timeout", t_stalled_requests)

    def t_vanished_requests():
        # 24 clients connect, each sends a 6 MB observation, then all hang up before their answers: the queue
        # budget (64 MB) refuses those past it, and the accepted ones, which wait for their batch to fill (a 1 s
        # window, as long as an idle client is connected: two are), are dropped before they run
        vsrv = Server(workdir, checkpoint, "libero", "--seed", str(SEED), "--max-queue-mb", "64", "--prep-threads", "1",
                      "--max-batch", "64", "--batch-wait-ms", "1000", name="vanish")
        servers.append(vsrv)
        rng = np.random.default_rng(3)
        big = dict(obs)
        big["observation/image"] = rng.integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
        big["observation/wrist_image"] = rng.integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
        data = msgpack_numpy.packb(big)
        clients, idle = [], [RawWs(vsrv.port), RawWs(vsrv.port)]
        for _ in range(24):
            ws = RawWs(vsrv.port)
            ws.recv_message()
            clients.append(ws)
        hwm0 = vsrv.hwm_kb()
        frame = RawWs.frame_header(2, len(data)) + RawWs.mask(data)
        for ws in clients:
            ws.sock.sendall(frame)
        time.sleep(0.05)  # the server has read them (a reset would discard what it has not), not answered them
        for ws in clients:
            ws.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            ws.close()
        time.sleep(0.2)  # the server sees them go before the idle clients leave and the batch stops waiting
        for ws in idle:
            ws.close()
        c = WebsocketClientPolicy(vsrv.uri)
        check_actions(c.infer(obs), ref["libero"])
        c._ws.close()
        grew = (vsrv.hwm_kb() - hwm0) / 1024
        rc, _ = vsrv.stop()
        log = vsrv.stderr()
        m = re.search(r"served (\d+) requests.* (\d+) dropped \(client gone\)", log)
        served, dropped = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        busy = log.count("server busy")
        assert rc == 0 and dropped > 0 and busy > 0, (rc, dropped, busy, log[-1500:])
        bound = 64 + 8 + 2 * 8 + 60  # queue budget, one arriving, one being prepared (bytes + decoded), slack
        assert grew < bound, f"peak RSS grew by {grew:.0f} MB (bound {bound})"
        return f"{busy} refused (queue full), {dropped} dropped unrun, {served - 1} run; peak RSS +{grew:.0f} MB"

    check("24 clients send 6 MB and vanish: queue budget, requests dropped unrun, RSS bounded", t_vanished_requests)

    def t_descriptor_limit():
        # with 96 descriptors, 120 idle websockets: those past the limit are closed on accept; the server does
        # not spin, and serves again once clients leave
        import resource

        def low_limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

        args = [BIN, "serve", "--checkpoint", checkpoint, "--adapter", "libero", "--port", "0", "--backend", "cpu",
                "--steps", str(STEPS), "--seed", str(SEED), "--quiet"]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=low_limit)
        try:
            line = proc.stdout.readline()
            port = int(re.match(rb"listening on ws://[^:]+:(\d+)", line).group(1))
            socks, refused = [], 0
            for _ in range(120):
                try:
                    socks.append(RawWs(port, timeout=5))
                except (RuntimeError, ConnectionError, socket.timeout, OSError):
                    refused += 1
            def cpu_s():
                with open(f"/proc/{proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            c0 = cpu_s()
            time.sleep(2)
            busy = cpu_s() - c0
            for ws in socks[:40]:
                ws.close()
            time.sleep(0.3)
            c = WebsocketClientPolicy(f"ws://127.0.0.1:{port}")
            check_actions(c.infer(obs), ref["libero"])
            c._ws.close()
            assert refused > 0, "no connection was refused at 96 descriptors"
            assert busy < 0.5, f"the server used {busy:.2f} s of CPU in 2 s with {len(socks)} idle connections"
            for ws in socks[40:]:
                ws.close()
            return f"{len(socks)} accepted, {refused} refused; {busy:.2f} s CPU in 2 s idle; serves after clients leave"
        finally:
            proc.kill()
            proc.wait()

    check("at the descriptor limit: refused on accept, no spin, serving again after", t_descriptor_limit)

    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
