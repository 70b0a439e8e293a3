#!/usr/bin/env bash
# `make demo`: start the agent, call it through the SDK, dpuctl and grpcurl, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
DEMO=.demo
mkdir -p "$DEMO"
rm -f "$DEMO/ready"

step() { printf '\n== %s\n' "$*"; }

step "starting dpu-agent on a free loopback port (logs: $DEMO/agent.log)"
DPU_AGENT_STORAGE_DIR="$DEMO/volumes" \
"$BIN/dpu-agent" serve --listen 127.0.0.1:0 --ready-file "$DEMO/ready" --log-format text \
    >"$DEMO/agent.log" 2>&1 &
AGENT=$!
trap 'kill -TERM $AGENT 2>/dev/null || true' EXIT
for _ in $(seq 200); do
    [ -s "$DEMO/ready" ] && break
    kill -0 $AGENT 2>/dev/null || { cat "$DEMO/agent.log"; echo "demo: agent exited" >&2; exit 1; }
    sleep 0.05
done
[ -s "$DEMO/ready" ] || { echo "demo: agent did not start in 10 s" >&2; exit 1; }
TARGET=$(cat "$DEMO/ready")
echo "   agent pid $AGENT serving on $TARGET"

step "host SDK (scripts/demo_sdk.py: async with host_client.Client(...))"
"$BIN/python" scripts/demo_sdk.py "$TARGET"

step "dpuctl --target $TARGET health"
"$BIN/dpuctl" --target "$TARGET" health

step "dpuctl --target $TARGET info"
"$BIN/dpuctl" --target "$TARGET" info

step "grpcurl -plaintext $TARGET list   (server reflection)"
"$BIN/grpcurl" -plaintext "$TARGET" list

step "grpcurl -plaintext $TARGET grpc.health.v1.Health/Check"
"$BIN/grpcurl" -plaintext "$TARGET" grpc.health.v1.Health/Check

step "bad input gets a clear status: GetVolume with an empty name"
"$BIN/grpcurl" -plaintext -d '{"name": ""}' "$TARGET" dpu.v1.StorageService/GetVolume 2>&1 || true

step "SIGTERM: the agent drains and exits"
kill -TERM $AGENT
wait $AGENT && echo "   agent exited with status 0"
trap - EXIT
echo "   last agent log lines:"
tail -n 4 "$DEMO/agent.log" | sed 's/^/   | /'
