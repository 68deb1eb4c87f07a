#!/usr/bin/env bash
# `pi0 serve` end to end (tests/server_test.py) with openpi's own client; run by `make test` through
# tests/run.sh. Needs the PyPI packages `make deps` installs (openpi-client, websockets, msgpack, numpy).
set -u
cd "$(dirname "$0")/.."
if ! "${PI0_BIN:-build/pi0}" serve --help >/dev/null 2>&1; then
    echo "skip server_vs_openpi_client: this build of pi0 has no server (msgpack-c and libwebsockets were not found: make deps)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
if ! missing=$(python3 -c "import openpi_client.websocket_client_policy, websockets.sync.client, numpy" 2>&1); then
    echo "FAIL server_vs_openpi_client: ${missing##*$'\n'} (run make deps, or python3 -m pip install -r tests/requirements.txt)"
    echo "0 passed, 1 failed"
    exit 1
fi
exec python3 tests/server_test.py
