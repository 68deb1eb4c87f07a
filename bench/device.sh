#!/usr/bin/env bash
# Everything a GPU session needs, in one call of the device machine: unpack the carried Debian
# packages (OpenBLAS, jansson, msgpack-c, libwebsockets), build for sm_90a, run the GPU tests, then the
# benchmarks. Usage (on the device): bench/device.sh MODE... with MODE one of build, tests, lab, quick, ab,
# bench, pi05, convert, serve, sweep, soak, all (several run in that order); logs go to $OUT (or ./device-out).
# `convert` times pi0 convert on a real-size openpi checkpoint; `soak` adds a 5-minute (SOAK_MINUTES) run to
# `serve` (with a .before/ tree, also one client against its server first); `sweep` times 16 clients at --max-batch 8, 16 and 32. `pi05` times
# Pi0.5 against Pi0 at the same 60-token prompt (H 10 and 15) and a Pi0.5 batch sweep. `ab` times the seed workload and H=50 alternately with this tree and with an older one
# unpacked in .before/ (here: `rm -rf .before && mkdir .before && git archive COMMIT | tar -x -C .before`,
# then carry .before): the same-run before/after for changes that have no A/B switch. `serve` times
# `pi0 serve` on a real-size random checkpoint with openpi's client, whose
# wheels are carried in .deps/wheels (the device has no package registry).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}; mkdir -p "$OUT"
modes=" ${*:-all} "
want() { [[ $modes == *" $1 "* || $modes == *" all "* ]]; }

# Carried packages (.deps/*.deb, see README "GPU") unpack into a local prefix.
export PATH=/usr/local/cuda/bin:$PATH
root=$PWD/.deps/root
unpack() { # a .deb is an ar archive holding data.tar.*; dpkg -x when there is a dpkg
    if command -v dpkg >/dev/null; then dpkg -x "$1" "$root"; return; fi
    local tmp; tmp=$(mktemp -d); (cd "$tmp" && ar x "$OLDPWD/$1" && tar -xf data.tar.* -C "$root"); rm -rf "$tmp"
}
mkdir -p "$root"
for deb in .deps/*.deb; do   # each once per machine (a marker per package)
    [ -f "$root/.unpacked-${deb##*/}" ] || { unpack "$deb" && touch "$root/.unpacked-${deb##*/}"; }
done
lib=$root/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib/openblas-openmp:$lib:$root/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PI0_FIXTURES=${PI0_FIXTURES:-$PWD/.fixtures}   # carried copy of ../shared/fixtures
make_args=(BLAS_CFLAGS="-I$root/usr/include/x86_64-linux-gnu/openblas-openmp" BLAS_LIBS="-L$lib/openblas-openmp -lopenblas"
           JSON_CFLAGS="-I$root/usr/include" JSON_LIBS="-L$lib -ljansson"
           WITH_SERVER=1 SERVER_CFLAGS="-I$root/usr/include" SERVER_LIBS="-L$lib -L$root/lib/x86_64-linux-gnu -lmsgpackc -lwebsockets -l:libcap.so.2"
           CUDA_ARCHS="-gencode arch=compute_90a,code=sm_90a")

nvidia-smi --query-gpu=name,driver_version,vbios_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,pstate --format=csv | tee "$OUT/gpu.txt"
make -j16 "${make_args[@]}" all > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
gpu_tests=$(ls tests/gpu/test_*.c | sed 's#tests/gpu/\(.*\)\.c#build/tests/gpu/\1#')
make -j16 "${make_args[@]}" build/bench/layer_lab build/bench/gate_up_lab build/bench/clock_lab $gpu_tests >> "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
# The clock a multiprocessor runs at under tensor work, which nvidia-smi does not show and lent machines may differ in
build/bench/clock_lab --brief | tee -a "$OUT/gpu.txt"

if want tests; then
    PI0_BIN=build/pi0 PI0_LOG_DIR=build/logs tests/run.sh $gpu_tests tests/gpu/footprint.sh 2>&1 | tee "$OUT/test-gpu.log" | grep -E '^(ok|FAIL|broken|[0-9]+ passed)'
    cat build/logs/test_*.log build/logs/footprint.sh.log > "$OUT/test-gpu-stderr.log"   # what each check measured
fi
# BEFORE="VAR=value" adds a same-run "before" row for the seed workload and H=50 (an A/B knob).
run() { echo "## ${AB:+$AB }build/pi0 bench $*"; env ${AB:-} build/pi0 bench "$@" --json; }
if [[ $modes == *" lab "* ]]; then    # per-kernel cost of one denoise layer in a graph (bench/layer_lab.c), the
    build/bench/layer_lab | tee "$OUT/lab.txt"       # prefix's gate|up two ways (bench/gate_up_lab.c), and the clock
    build/bench/gate_up_lab | tee "$OUT/gate_up_lab.txt"    # under each kind of work (bench/clock_lab.c)
    build/bench/clock_lab | tee "$OUT/clock_lab.txt"
fi
if [[ $modes == *" quick "* ]]; then   # the seed workload and H=50 only (with BEFORE rows): a fast A/B
    {
        if [ -n "${BEFORE:-}" ]; then AB=$BEFORE run; AB=$BEFORE run --horizon 50; fi
        run; run --horizon 50
    } > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
    python3 bench/table.py "$OUT/bench.jsonl"
fi
if [[ $modes == *" ab "* ]]; then
    [ -d .before/src ] || { echo "ab: no .before/ tree (see the usage above)"; exit 1; }
    make -C .before -j16 "${make_args[@]}" build/pi0 > "$OUT/build-before.log" 2>&1 || { tail -30 "$OUT/build-before.log"; exit 1; }
    before() { echo "## before: build/pi0 bench $*"; .before/build/pi0 bench "$@" --json; }
    {
        for round in 1 2; do before; run; done
        before --horizon 50; run --horizon 50
    } > "$OUT/ab.jsonl" 2> "$OUT/ab.err"
    python3 bench/table.py "$OUT/ab.jsonl"
fi
if want bench; then
    {
        if [ -n "${BEFORE:-}" ]; then AB=$BEFORE run; AB=$BEFORE run --horizon 50; fi
        run                                              # seed workload: B=1, 3 cameras (1 masked), H=10
        run --masked-cameras 0                           # 3 valid cameras
        run --horizon 50
        for b in 1 2 4 8 16 32 64; do run --batch $b --iters 30 --warmup 5; done
    } > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
    python3 bench/table.py "$OUT/bench.jsonl"
fi
if want pi05; then   # Pi0.5 against Pi0 at a realistic discrete-state prompt, then Pi0.5 at batch sizes
    {
        for h in 10 15; do run --prompt-len 60 --horizon $h; run --model pi05 --prompt-len 60 --horizon $h; done
        for b in 1 4 16 64; do run --model pi05 --prompt-len 60 --horizon 15 --batch $b --iters 30 --warmup 5; done
    } > "$OUT/pi05.jsonl" 2> "$OUT/pi05.err"
    python3 bench/table.py "$OUT/pi05.jsonl"
fi
if [[ $modes == *" convert "* ]]; then   # pi0 convert on a real-size orbax checkpoint (needs JAX and orbax)
    python3 bench/convert_bench.py --pi0 build/pi0 --out /tmp/pi0_convert_bench 2>&1 | tee "$OUT/convert.txt"
fi
if want serve || want sweep || [[ $modes == *" soak "* ]]; then   # pi0 serve on a real-size bf16 checkpoint with openpi's client (bench/serve_load.py)
    python3 -m pip install -q --no-index --find-links .deps/wheels --target .deps/py --no-deps \
        msgpack websockets typing_extensions openpi-client > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
    export PYTHONPATH=$PWD/.deps/py
    ckpt=/tmp/pi0_serve_ckpt
    if [ ! -f $ckpt/model.safetensors ]; then   # real size, random bf16 weights + the test tokenizer and norm stats
        PI0_BIN=build/pi0 tests/make_policy_checkpoint.sh /tmp/pi0_tiny_policy
        if [ -f /tmp/pi0_footprint_bf16/model.safetensors ]; then   # the same checkpoint, made by the footprint test
            mkdir -p $ckpt && ln -sf /tmp/pi0_footprint_bf16/model.safetensors /tmp/pi0_footprint_bf16/config.json $ckpt/
        else
            build/pi0 init --output $ckpt --bf16 > "$OUT/init.log" 2>&1 || { tail "$OUT/init.log"; exit 1; }
        fi
        cp -r /tmp/pi0_tiny_policy/paligemma_tokenizer.model /tmp/pi0_tiny_policy/assets $ckpt/
        droid=/tmp/pi0_serve_droid; mkdir -p $droid/assets/droid   # the same weights, DROID's 8 + 8 dims of stats
        ln -sf $ckpt/model.safetensors $ckpt/config.json $ckpt/paligemma_tokenizer.model $droid/
        python3 -c 'import json; print(json.dumps({"norm_stats": {k: {"mean": [0.1] * 8, "std": [0.5] * 8,
            "q01": [-1.0] * 8, "q99": [1.0] * 8} for k in ("state", "actions")}}))' > $droid/assets/droid/norm_stats.json
    fi
    # LIBERO with the wrist camera optional (so that --drop-camera can leave it out), openpi's pi0_libero otherwise
    echo '{"name": "libero", "cameras": ["observation/image", "observation/wrist_image", null],
           "optional_cameras": ["observation/wrist_image"], "state": ["observation/state"], "action_dims": 7}' > /tmp/libero_opt.json
    serve() { # CHECKPOINT ADAPTER ARGS...: starts pi0 serve on port 8765 and waits for "listening"
        ${SERVER:-build/pi0} serve --checkpoint "$1" --adapter "$2" --port 8765 --horizon 10 "${@:3}" > "$OUT/serve.out" 2>> "$OUT/serve.err" &
        server=$!
        for _ in $(seq 300); do grep -q listening "$OUT/serve.out" 2>/dev/null && break; sleep 1; done
        grep "ready in" "$OUT/serve.err" | tail -1
    }
    stop() { kill -TERM $server; wait $server; echo "## server exit $?"; }
    load() { echo "## serve_load $*"; python3 bench/serve_load.py --port 8765 --json "$@"; }
    {
      if want serve && [ -d .before/src ]; then   # the same run's before: one client against the older tree's server
        make -C .before -j16 "${make_args[@]}" build/pi0 > "$OUT/build-before.log" 2>&1 || { tail -30 "$OUT/build-before.log"; exit 1; }
        SERVER=.before/build/pi0 serve $ckpt /tmp/libero_opt.json
        load --clients 1 --requests 300 --obs libero | sed "s/^/before: /"
        stop
      fi
      if want serve; then
        echo "## engine: 2 cameras, 32 prompt tokens, H 10 (what the server runs for one LIBERO request)"
        build/pi0 bench --cameras 2 --masked-cameras 0 --prompt-len 32 --horizon 10 --json
        echo "## engine: the same with 256x256 frames resized on the GPU (what the server does with them)"
        build/pi0 bench --cameras 2 --masked-cameras 0 --prompt-len 32 --horizon 10 --frame 256x256 --json
        echo "## engine: DROID's 180x320 frames"
        build/pi0 bench --cameras 2 --masked-cameras 0 --prompt-len 32 --horizon 10 --frame 180x320 --json
        serve $ckpt /tmp/libero_opt.json
        load --clients 1 --requests 300 --obs libero
        load --clients 1 --requests 200 --obs libero --vary --drop-camera 0.2
        load --clients 4 --requests 150 --obs libero --vary --drop-camera 0.2 --processes 4
        load --clients 16 --requests 60 --obs libero --vary --drop-camera 0.2 --processes 4
        stop
        serve /tmp/pi0_serve_droid droid
        load --clients 1 --requests 300 --obs droid
        stop
      fi
      if want sweep; then   # 16 clients at --max-batch 8, 16, 32: the curve the default comes from
        for mb in 8 16 32; do
            serve $ckpt /tmp/libero_opt.json --max-batch $mb
            load --clients 16 --requests 60 --obs libero --processes 4 | sed "s/^/max-batch $mb: /"
            stop
        done
      fi
      if [[ $modes == *" soak "* ]]; then   # the 5-minute run, varied prompts and cameras: no request over 2 x p50?
        serve $ckpt /tmp/libero_opt.json
        load --clients 4 --duration $((${SOAK_MINUTES:-5} * 60)) --obs libero --vary --drop-camera 0.2 --processes 4
        stop
      fi
    } 2>&1 | tee -a "$OUT/serve.jsonl"
fi
