#!/usr/bin/env bash
# `make demo`: the product's story on this machine. A lab PKI; a real mosquitto broker;
# the agent with mTLS publishing events to it; then, through the SDK
# (scripts/demo_sdk.py): a session, a volume with CRC32C + zstd + AES-XTS written from a
# host file and read back byte for byte, a compute job checked against the library, the
# completion events on MQTT and on the gRPC stream, the metrics, a second tenant
# refused; then dpuctl and grpcurl, the one-line error of a plaintext call, SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
DEMO=${DPU_DEMO_DIR:-.demo}  # where the PKI, logs, volumes and files go
# DPU_DEMO_TRANSPORT: the session's transport, auto (verbs where both ends have RDMA) by
# default; `make demo-rdma` sets verbs and runs this in the soft-RoCE test VM
START=$(date +%s.%N)
mkdir -p "$DEMO"
rm -f "$DEMO/ready"

step() { printf '\n== %s\n' "$*"; }
free_port() { "$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

PKI="$DEMO/pki"
step "a lab PKI in $PKI: dpuctl certs ca / agent --san 127.0.0.1 / client demo / client other"
echo "   proves: the agent and each tenant get certificates from one CA; the CN names the tenant"
rm -rf "$PKI" "$DEMO/volumes"
"$BIN/dpuctl" certs ca "$PKI" | sed 's/^/   /'
"$BIN/dpuctl" certs agent "$PKI" --san 127.0.0.1 --san localhost | sed 's/^/   /'
"$BIN/dpuctl" certs client "$PKI" demo | sed 's/^/   /'
"$BIN/dpuctl" certs client "$PKI" other | sed 's/^/   /'

BROKER_PORT=$(free_port)
step "a mosquitto broker on 127.0.0.1:$BROKER_PORT (log: $DEMO/mosquitto.log)"
echo "   proves: events go to a real MQTT broker, where any subscriber can read them"
MOSQUITTO=$(command -v mosquitto || echo /usr/sbin/mosquitto)
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\n' "$BROKER_PORT" \
    >"$DEMO/mosquitto.conf"
"$MOSQUITTO" -c "$DEMO/mosquitto.conf" >"$DEMO/mosquitto.log" 2>&1 &
BROKER=$!
AGENT=
cleanup() {
    if [ -n "$AGENT" ]; then kill -TERM "$AGENT" 2>/dev/null || true; fi
    kill -TERM "$BROKER" 2>/dev/null || true
}
trap cleanup EXIT
echo "   mosquitto pid $BROKER"

step "dpu-agent with mTLS on a free loopback port, events to the broker (log: $DEMO/agent.log)"
echo "   proves: the agent starts from environment settings alone and serves only mTLS"
DPU_AGENT_TLS_CERT="$PKI/agent.pem" DPU_AGENT_TLS_KEY="$PKI/agent.key" \
DPU_AGENT_TLS_CLIENT_CA="$PKI/ca.pem" \
DPU_AGENT_STORAGE_DIR="$DEMO/volumes" DPU_AGENT_METRICS_LISTEN=127.0.0.1:0 \
DPU_AGENT_MQTT_ENABLED=true DPU_AGENT_MQTT_PORT="$BROKER_PORT" DPU_AGENT_ID=demo-agent \
"$BIN/dpu-agent" serve --listen 127.0.0.1:0 --ready-file "$DEMO/ready" --log-format text \
    >"$DEMO/agent.log" 2>&1 &
AGENT=$!
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

# the story through the SDK (scripts/demo_sdk.py: async with host_client.Client(...))
"$BIN/python" scripts/demo_sdk.py "$TARGET" --broker-port "$BROKER_PORT" \
    --metrics-url "$METRICS_URL" --workdir "$DEMO" \
    --other-cert "$PKI/client-other.pem" --other-key "$PKI/client-other.key" \
    --transport "${DPU_DEMO_TRANSPORT:-auto}"

step "dpuctl --target $TARGET volume list   (the same agent from the command line)"
"$BIN/dpuctl" --target "$TARGET" volume list | sed 's/^/   /'

step "grpcurl (mTLS) $TARGET list   (server reflection: any gRPC tool works)"
"$BIN/grpcurl" "${GRPCURL_TLS[@]}" "$TARGET" list | sed 's/^/   /'

step "a plaintext call to the mTLS agent: dpuctl --plaintext --target $TARGET info"
echo "   proves: a first-contact mistake gets one line that says what to change"
"$BIN/dpuctl" --plaintext --target "$TARGET" info 2>&1 | sed 's/^/   /' || true
echo "   the agent's log says it too:"
sleep 0.2
grep 'TLS handshake failed' "$DEMO/agent.log" | tail -n 1 | cut -c1-200 | sed 's/^/   | /'

step "SIGTERM: the agent drains and exits"
kill -TERM $AGENT
wait $AGENT && echo "   agent exited with status 0"
AGENT=
kill -TERM "$BROKER" 2>/dev/null || true
wait "$BROKER" 2>/dev/null || true
trap - EXIT
printf '\ndemo: every step passed in %.1f s\n' "$(echo "$(date +%s.%N) - $START" | bc)"
