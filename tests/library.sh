#!/usr/bin/env bash
# The library as a C program consumes it: libpi0.so exports the public API (pi0_*) and nothing else;
# `make install PREFIX=DIR` installs headers, libraries, a pkg-config file and the pi0 command; a program
# built with `pkg-config --cflags --libs pi0` against that prefix (examples/embed.c: Policy.infer on camera
# frames, nothing but libpi0) runs and prints actions. Run by `make test` with $BUILD and $PI0_BIN set (and
# $SANITIZE, the sanitizer flags of that build, which the program must be built with too).
set -u
cd "$(dirname "$0")/.."
build=${BUILD:-build}
passed=0; failed=0
check() {
    local name=$1; shift
    if out=$("$@" 2>&1); then passed=$((passed + 1)); echo "ok   $name${out:+: $(printf '%s\n' "$out" | tail -n 1)}"
    else failed=$((failed + 1)); echo "FAIL $name"; printf '%s\n' "$out" | tail -n 20; fi
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

exports_only_api() {
    local others
    others=$(nm -D --defined-only "$build/libpi0.so" | awk '{print $3}' | grep -v '^pi0_')
    [ -z "$others" ] || { echo "libpi0.so exports non-API symbols:"; echo "$others" | head -20; return 1; }
    echo "$(nm -D --defined-only "$build/libpi0.so" | wc -l) symbols, all pi0_*"
}
install_and_consume() {
    make --no-print-directory BUILD="$build" install PREFIX="$tmp/prefix" >"$tmp/install.log" 2>&1 || { tail "$tmp/install.log"; return 1; }
    export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
    # shellcheck disable=SC2046
    cc -std=c11 -Wall -Werror ${SANITIZE:-} examples/embed.c $(pkg-config --cflags --libs pi0) -o "$tmp/embed" || return 1
    PI0_BIN="$tmp/prefix/bin/pi0" tests/make_policy_checkpoint.sh "$tmp/ckpt" || return 1
    LD_LIBRARY_PATH="$tmp/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/embed" "$tmp/ckpt"
}
check "libpi0.so exports only the public API" exports_only_api
check "make install + a program built with pkg-config --cflags --libs pi0 runs Policy.infer" install_and_consume
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
