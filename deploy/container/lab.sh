#!/usr/bin/env bash
# The soft-RoCE container lab on one Linux host whose kernel has rdma_rxe (`make lab`):
# the agent's image (deploy/container/build.sh), the agent in it with the host's rxe0,
# and mosquitto beside it, all on the host network and on loopback only.
#
#   deploy/container/lab.sh up NETDEV    rxe0 on NETDEV (an Ethernet netdev), the image,
#                                        mosquitto on 127.0.0.1:1883, the agent on
#                                        127.0.0.1:50051 (plaintext on loopback)
#   deploy/container/lab.sh status       what runs
#   deploy/container/lab.sh down         remove the agent's container, stop mosquitto
#                                        (rxe0 and the state volume stay)
#
# Then, from the checkout: .venv/bin/dpuctl --target 127.0.0.1:50051 info
# Needs root (rdma link, podman with runc), podman, mosquitto and the checkout's .venv.
set -euo pipefail
cd "$(dirname "$0")/../.."

PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)
LIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --ulimit memlock=-1:-1)
AGENT=dpu-lab-agent
STATE_VOLUME=dpu-lab-state
RUN_DIR=${XDG_RUNTIME_DIR:-/run}/dpu-lab
TARGET=127.0.0.1:50051

log() { printf 'lab: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

rxe_on() {  # the rxe device on a netdev, if any
    rdma link show 2>/dev/null | awk -v nd="$1" '$0 ~ ("netdev " nd "( |$)") {split($2, a, "/"); print a[1]}'
}

uverbs_of() {  # /dev/infiniband/uverbsN of an RDMA device
    local node
    for node in /sys/class/infiniband_verbs/uverbs*; do
        [ "$(cat "$node/ibdev")" = "$1" ] && { echo "/dev/infiniband/${node##*/}"; return; }
    done
    die "no uverbs node for $1"
}

up() {
    local netdev=${1:?usage: lab.sh up NETDEV}
    [ "$(id -u)" -eq 0 ] || die "needs root (rdma link, podman)"
    ip link show "$netdev" >/dev/null 2>&1 || die "no netdev $netdev"
    modprobe rdma_rxe 2>/dev/null || die "this kernel has no rdma_rxe (CONFIG_RDMA_RXE)"
    local dev
    dev=$(rxe_on "$netdev")
    if [ -z "$dev" ]; then
        log "rdma link add rxe0 type rxe netdev $netdev"
        rdma link add rxe0 type rxe netdev "$netdev"
        dev=rxe0
    fi
    log "RDMA device $dev on $netdev"
    command -v mosquitto >/dev/null || die "no mosquitto: apt-get install mosquitto"
    local image
    image=$(deploy/container/build.sh | tail -n 1)
    mkdir -p "$RUN_DIR"
    if [ ! -e "$RUN_DIR/mosquitto.pid" ] || ! kill -0 "$(cat "$RUN_DIR/mosquitto.pid")" 2>/dev/null; then
        log "mosquitto on 127.0.0.1:1883 (deploy/mosquitto/mosquitto.conf)"
        mosquitto -c deploy/mosquitto/mosquitto.conf >"$RUN_DIR/mosquitto.log" 2>&1 &
        echo $! >"$RUN_DIR/mosquitto.pid"
    fi
    "${PODMAN[@]}" rm --force "$AGENT" >/dev/null 2>&1 || true
    log "the agent: $image with $dev ($(uverbs_of "$dev")), state in volume $STATE_VOLUME"
    "${PODMAN[@]}" run --detach --name "$AGENT" --network host "${LIMITS[@]}" \
        --device "$(uverbs_of "$dev")" --cap-drop ALL \
        -v "$PWD/deploy/compose/agent.toml:/etc/dpu-agent/agent.toml:ro" \
        -v "$STATE_VOLUME:/var/lib/dpu-agent" \
        -e DPU_AGENT_RDMA_DEVICE="$dev" "$image" >/dev/null
    local i
    for i in $(seq 60); do
        .venv/bin/dpuctl --target "$TARGET" health >/dev/null 2>&1 && break
        [ "$i" = 60 ] && { "${PODMAN[@]}" logs "$AGENT" >&2; die "the agent did not become healthy"; }
        sleep 1
    done
    .venv/bin/dpuctl --target "$TARGET" info
    log "up: dpuctl --target $TARGET ...; events: dpuctl events --broker 127.0.0.1:1883 --follow"
}

status() {
    "${PODMAN[@]}" ps --all --filter "name=$AGENT"
    if [ -e "$RUN_DIR/mosquitto.pid" ] && kill -0 "$(cat "$RUN_DIR/mosquitto.pid")" 2>/dev/null; then
        log "mosquitto runs (pid $(cat "$RUN_DIR/mosquitto.pid"))"
    else
        log "mosquitto does not run"
    fi
    rdma link show 2>/dev/null | grep rxe || log "no rxe device"
}

down() {
    "${PODMAN[@]}" stop --time 20 "$AGENT" >/dev/null 2>&1 || true
    "${PODMAN[@]}" rm --force "$AGENT" >/dev/null 2>&1 || true
    if [ -e "$RUN_DIR/mosquitto.pid" ]; then
        kill "$(cat "$RUN_DIR/mosquitto.pid")" 2>/dev/null || true
        rm -f "$RUN_DIR/mosquitto.pid"
    fi
    log "down (rxe devices and the $STATE_VOLUME volume stay)"
}

case ${1:-} in
    up) shift; up "$@" ;;
    status) status ;;
    down) down ;;
    -h|--help|"") sed -n '2,14s/^# \{0,1\}//p' "$0" ;;
    *) die "unknown command $1 (see --help)" ;;
esac
