#!/usr/bin/env bash
# Cross-checks against the reference libraries from PyPI: the C tokenizer against sentencepiece on
# thousands of random strings (and Pi0.5's state prompt against numpy.digitize and openpi's own
# formatting code), image resizing against Pillow bit for bit, and (in builds with the server
# libraries) the msgpack wire codec against openpi-client's msgpack_numpy. Needs the tools built
# by `make test` ($PI0_TOOLS, default build/tests) and `make deps` for the Python packages.
set -u
tools=${PI0_TOOLS:-build/tests}
fixtures=${PI0_FIXTURES:-../shared/fixtures}
passed=0; failed=0; skipped=0
check() {
    local name=$1; shift
    if out=$("$@" 2>&1); then passed=$((passed + 1)); echo "ok   $name: $(printf '%s\n' "$out" | tail -n 1)"
    else failed=$((failed + 1)); echo "FAIL $name"; printf '%s\n' "$out" | tail -n 20
         [[ $out == *ModuleNotFoundError* ]] && echo "  (a Python package is missing: run make deps)"; fi
}
check tokenizer_vs_sentencepiece python3 tests/tokenizer_vs_sentencepiece.py "$tools/tokenize_tool" "$fixtures/tokenizer/tok.model"
check image_vs_pillow python3 tests/image_vs_pillow.py "$tools/image_tool"
# Only in builds with the server libraries (msgpack-c, libwebsockets), which build msgpack_tool.
if [ -x "$tools/msgpack_tool" ]; then
    check msgpack_vs_openpi python3 tests/msgpack_vs_openpi.py "$tools/msgpack_tool"
else
    skipped=$((skipped + 1))
    echo "skip msgpack_vs_openpi: this build has no msgpack codec (msgpack-c and libwebsockets were not found: make deps)"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
