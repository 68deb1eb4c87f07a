#!/usr/bin/env bash
# `pi0 serve` end to end (tests/server_test.py) with openpi's own client; run by `make test` through
# tests/run.sh. Needs the PyPI packages `make deps` installs (openpi-client, websockets, msgpack, numpy).
set -u
cd "$(dirname "$0")/.."
if ! python3 -c "import openpi_client.websocket_client_policy, websockets.sync.client, numpy" 2>/dev/null; then
    echo "server.sh: openpi_client, websockets or numpy is missing (run make deps)"
    echo "0 passed, 1 failed"
    exit 1
fi
exec python3 tests/server_test.py
