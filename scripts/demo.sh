#!/usr/bin/env bash
# `make demo`: make a lab PKI, start the agent with mTLS, call it through the SDK, dpuctl
# and grpcurl as tenant "demo", show what another tenant sees, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
DEMO=.demo
mkdir -p "$DEMO"
rm -f "$DEMO/ready"

step() { printf '\n== %s\n' "$*"; }

PKI="$DEMO/pki"
step "a lab PKI in $PKI: dpuctl certs ca / agent --san 127.0.0.1 / client demo / client other"
rm -rf "$PKI" "$DEMO/volumes"
"$BIN/dpuctl" certs ca "$PKI" | sed 's/^/   /'
"$BIN/dpuctl" certs agent "$PKI" --san 127.0.0.1 --san localhost | sed 's/^/   /'
"$BIN/dpuctl" certs client "$PKI" demo | sed 's/^/   /'
"$BIN/dpuctl" certs client "$PKI" other | sed 's/^/   /'

step "starting dpu-agent with mTLS on a free loopback port (logs: $DEMO/agent.log)"
DPU_AGENT_TLS_CERT="$PKI/agent.pem" DPU_AGENT_TLS_KEY="$PKI/agent.key" \
DPU_AGENT_TLS_CLIENT_CA="$PKI/ca.pem" \
DPU_AGENT_STORAGE_DIR="$DEMO/volumes" DPU_AGENT_METRICS_LISTEN=127.0.0.1:0 \
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
# the agent logs its Prometheus endpoint: "metrics serving address=... url=http://..."
METRICS_URL=$(sed -n 's/.*metrics serving.* url=\([^ ]*\).*/\1/p' "$DEMO/agent.log" | head -n 1)
echo "   Prometheus metrics: ${METRICS_URL:-none (see $DEMO/agent.log)}"
# the SDK and dpuctl read these; the certificate's CN ("demo") is the tenant
export DPU_TLS_CA="$PKI/ca.pem" DPU_TLS_CERT="$PKI/client-demo.pem" DPU_TLS_KEY="$PKI/client-demo.key"
GRPCURL_TLS=(-cacert "$PKI/ca.pem" -cert "$PKI/client-demo.pem" -key "$PKI/client-demo.key")

step "host SDK (scripts/demo_sdk.py: async with host_client.Client(...))"
"$BIN/python" scripts/demo_sdk.py "$TARGET"

if [ -n "$METRICS_URL" ]; then
    step "Prometheus metrics after those jobs: $METRICS_URL"
    "$BIN/python" scripts/show_metrics.py "$METRICS_URL" dpu_agent_jobs_total \
        dpu_agent_job_duration_seconds_count dpu_agent_dataplane_bytes_total \
        dpu_agent_sessions_opened_total dpu_agent_sessions_closed_total dpu_agent_sessions_open
fi

step "dpuctl --target $TARGET health"
"$BIN/dpuctl" --target "$TARGET" health

step "dpuctl --target $TARGET info"
"$BIN/dpuctl" --target "$TARGET" info

step "grpcurl -cacert ca.pem -cert client-demo.pem -key client-demo.key $TARGET list   (server reflection)"
"$BIN/grpcurl" "${GRPCURL_TLS[@]}" "$TARGET" list

step "grpcurl (mTLS) $TARGET grpc.health.v1.Health/Check"
"$BIN/grpcurl" "${GRPCURL_TLS[@]}" "$TARGET" grpc.health.v1.Health/Check

step "bad input gets a clear status: GetVolume with an empty name"
"$BIN/grpcurl" "${GRPCURL_TLS[@]}" -d '{"name": ""}' "$TARGET" dpu.v1.StorageService/GetVolume 2>&1 || true

step "plaintext to the mTLS agent is refused: grpcurl -plaintext $TARGET list"
"$BIN/grpcurl" -plaintext "$TARGET" list 2>&1 | sed 's/^/   /' || true

step "tenants: demo makes a volume; tenant other does not see it"
"$BIN/dpuctl" --target "$TARGET" volume create demo-vol --size 1M
OTHER=(--cert "$PKI/client-other.pem" --key "$PKI/client-other.key")
echo "   as other: dpuctl volume list"
"$BIN/dpuctl" --target "$TARGET" "${OTHER[@]}" volume list | sed 's/^/   /'
echo "   as other: dpuctl volume get demo-vol"
"$BIN/dpuctl" --target "$TARGET" "${OTHER[@]}" volume get demo-vol 2>&1 | sed 's/^/   /' || true

step "SIGTERM: the agent drains and exits"
kill -TERM $AGENT
wait $AGENT && echo "   agent exited with status 0"
trap - EXIT
echo "   last agent log lines:"
tail -n 4 "$DEMO/agent.log" | sed 's/^/   | /'
