#!/usr/bin/env bash
# Install dpu-agent as a systemd service on a BlueField's Arm Linux (or any Debian/Ubuntu
# box with an RDMA device). Run as root from a checkout of this repository:
#
#   sudo deploy/bluefield/install.sh --tls-dir ./pki         # the usual case
#   sudo deploy/bluefield/install.sh --wheel dpu_offload-0.1.0-cp311-cp311-linux_aarch64.whl ...
#
# What it does, idempotently:
#   1. apt-get install rdma-core, ibverbs-providers, python3-pyverbs, python3-venv,
#      iproute2 and mosquitto-clients (on DOCA/BlueField images the RDMA packages come
#      from NVIDIA's repository and are kept as they are), and gcc, libc6-dev,
#      python3-dev and libibverbs-dev, which the wheel's optional C extension (the verbs
#      transport's native core) is compiled with;
#   2. a virtualenv /opt/dpu-agent/venv made from /usr/bin/python3 with
#      --system-site-packages (so the distribution's pyverbs, built against the
#      installed rdma-core, imports), with the project wheel (built here from the
#      checkout, its C extension included) and its pinned dependencies (constraints.txt);
#   3. the system user dpu-agent, /etc/dpu-agent/agent.toml (kept if present: the new
#      sample goes to agent.toml.dist), the mTLS files from --tls-dir;
#   4. /etc/systemd/system/dpu-agent.service (+ the netns drop-in with --with-netns),
#      enabled, and started if `dpu-agent check-config` accepts the configuration.
#
# Needs Python >= 3.11 as /usr/bin/python3 with a matching python3-pyverbs: Ubuntu
# 24.04 or Debian 12. Ubuntu 22.04 (the DOCA 2.x BlueField OS) has Python 3.10 and its
# pyverbs is built for 3.10: the script stops there and says what to do instead.
# Not run on BlueField hardware yet (see deploy/README.md).
set -euo pipefail

PREFIX=/opt/dpu-agent
VENV=$PREFIX/venv
CONF_DIR=/etc/dpu-agent
UNIT_DIR=/etc/systemd/system
USER_NAME=dpu-agent
APT_PACKAGES=(rdma-core ibverbs-providers python3-pyverbs python3-venv iproute2 mosquitto-clients
    gcc libc6-dev python3-dev libibverbs-dev)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

WHEEL=""
TLS_DIR=""
WITH_NETNS=0
START=1

usage() {
    cat <<EOF
usage: $0 [--wheel FILE] [--tls-dir DIR] [--with-netns] [--no-start]

  --wheel FILE   install this dpu-offload wheel (default: build one from $REPO)
  --tls-dir DIR  copy DIR/agent.pem, DIR/agent.key and DIR/ca.pem to $CONF_DIR/tls
                 (made with: dpuctl certs ca DIR; dpuctl certs agent DIR --san <address>)
  --with-netns   allow [network] netns (installs the drop-in granting CAP_SYS_ADMIN)
  --no-start     enable the service but do not start it
EOF
}

say() { printf 'install: %s\n' "$*"; }
die() {
    printf 'install: error: %s\n' "$*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
    --wheel)
        [ $# -ge 2 ] || die "--wheel needs a file"
        WHEEL=$(realpath "$2")
        shift 2
        ;;
    --tls-dir)
        [ $# -ge 2 ] || die "--tls-dir needs a directory"
        TLS_DIR=$(realpath "$2")
        shift 2
        ;;
    --with-netns)
        WITH_NETNS=1
        shift
        ;;
    --no-start)
        START=0
        shift
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        usage >&2
        exit 2
        ;;
    esac
done

[ "$(id -u)" -eq 0 ] || die "run as root (sudo $0 ...)"
command -v apt-get >/dev/null || die "apt-get not found: this script is for Debian and Ubuntu"
if [ -n "$WHEEL" ] && [ ! -f "$WHEEL" ]; then die "no wheel at $WHEEL"; fi
if [ -n "$TLS_DIR" ]; then
    for f in agent.pem agent.key ca.pem; do
        [ -f "$TLS_DIR/$f" ] || die "--tls-dir: $TLS_DIR/$f is missing"
    done
fi

# --- 1. Debian packages -----------------------------------------------------------
# shellcheck source=/dev/null
. /etc/os-release
say "system: ${PRETTY_NAME:-unknown}, $(uname -m)"
missing=()
for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PY=/usr/bin/python3
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    die "$("$PY" -V) is too old: the agent needs Python >= 3.11 (tomllib), and pyverbs
must come from the distribution's python3-pyverbs built for that same Python.
On Ubuntu 22.04 (DOCA 2.x BlueField OS) use the container image instead
(deploy/container, with the host's /dev/infiniband), or a BlueField OS based on
Ubuntu 24.04."
fi
"$PY" -c 'import pyverbs' 2>/dev/null || die "python3-pyverbs does not import with $PY"

# --- 2. the virtualenv and the wheel --------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV (--system-site-packages, for pyverbs)"
    install -d -m 0755 "$PREFIX"
    "$PY" -m venv --system-site-packages "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
if [ -z "$WHEEL" ]; then
    [ -f "$REPO/pyproject.toml" ] || die "no --wheel given and $REPO is not a checkout"
    say "building the wheel from $REPO"
    # A copy, so the build leaves no root-owned build/ or egg-info in the checkout.
    mkdir "$workdir/src"
    cp -r "$REPO/pyproject.toml" "$REPO/setup.py" "$REPO/README.md" "$REPO/dpu_agent" \
        "$REPO/dpu_wire" "$REPO/host_client" "$workdir/src/"
    find "$workdir/src" -name '*.so' -delete  # a checkout's in-place build, maybe another arch
    "${pip[@]}" wheel --no-deps -w "$workdir" "$workdir/src"
    WHEEL=$(find "$workdir" -maxdepth 1 -name 'dpu_offload-*.whl' -print -quit)
    [ -n "$WHEEL" ] || die "the wheel build produced no dpu_offload-*.whl"
fi
constraints=()
if [ -f "$REPO/constraints.txt" ]; then constraints=(-c "$REPO/constraints.txt"); fi
say "installing $(basename "$WHEEL") into $VENV"
"${pip[@]}" install "${constraints[@]}" --force-reinstall --no-deps "$WHEEL"
"${pip[@]}" install "${constraints[@]}" "$WHEEL"
"$VENV/bin/python" -c 'import pyverbs, dpu_agent; print("install: dpu-agent", dpu_agent.__version__)'
if "$VENV/bin/python" -c 'from dpu_wire.transport import _vcore' 2>/dev/null; then
    say "the verbs transport's native core is built"
else
    say "the verbs transport's native core is not built (the wheel has none): pure-Python path"
fi
install -m 0644 "$REPO/deploy/README.md" "$PREFIX/README.md"

# --- 3. user, configuration, TLS files --------------------------------------------
if ! getent passwd "$USER_NAME" >/dev/null; then
    say "creating the system user $USER_NAME"
    useradd --system --user-group --home-dir /var/lib/dpu-agent --no-create-home \
        --shell /usr/sbin/nologin "$USER_NAME"
fi
install -d -m 0750 -o root -g "$USER_NAME" "$CONF_DIR"
if [ -e "$CONF_DIR/agent.toml" ]; then
    install -m 0640 -o root -g "$USER_NAME" "$REPO/deploy/systemd/agent.toml" "$CONF_DIR/agent.toml.dist"
    say "kept $CONF_DIR/agent.toml; the current sample is $CONF_DIR/agent.toml.dist"
else
    install -m 0640 -o root -g "$USER_NAME" "$REPO/deploy/systemd/agent.toml" "$CONF_DIR/agent.toml"
    say "installed $CONF_DIR/agent.toml (edit listen, [tls], [mqtt] to fit)"
fi
if [ -n "$TLS_DIR" ]; then
    install -d -m 0750 -o root -g "$USER_NAME" "$CONF_DIR/tls"
    install -m 0644 "$TLS_DIR/agent.pem" "$TLS_DIR/ca.pem" "$CONF_DIR/tls/"
    install -m 0600 -o "$USER_NAME" -g "$USER_NAME" "$TLS_DIR/agent.key" "$CONF_DIR/tls/"
    say "installed the agent's certificate, key and client CA in $CONF_DIR/tls"
fi

# --- 4. the unit --------------------------------------------------------------
install -m 0644 "$REPO/deploy/systemd/dpu-agent.service" "$UNIT_DIR/dpu-agent.service"
if [ "$WITH_NETNS" -eq 1 ]; then
    install -d -m 0755 "$UNIT_DIR/dpu-agent.service.d"
    install -m 0644 "$REPO/deploy/systemd/netns.conf" "$UNIT_DIR/dpu-agent.service.d/netns.conf"
else
    rm -f "$UNIT_DIR/dpu-agent.service.d/netns.conf"
fi

config_ok=1
if ! runuser -u "$USER_NAME" -- "$VENV/bin/dpu-agent" check-config -c "$CONF_DIR/agent.toml" >/dev/null; then
    config_ok=0
fi

if [ ! -d /run/systemd/system ]; then
    systemctl enable dpu-agent.service
    say "systemd is not running here (a chroot or container): enabled, not started"
    if [ "$config_ok" -eq 0 ]; then
        say "and $CONF_DIR/agent.toml does not pass check-config yet (message above)"
        exit 1
    fi
    exit 0
fi
systemctl daemon-reload
systemctl enable dpu-agent.service
if [ "$config_ok" -eq 0 ]; then
    say "not started: fix $CONF_DIR/agent.toml (message above), then: systemctl start dpu-agent"
    exit 1
fi
if [ "$START" -eq 1 ]; then
    systemctl restart dpu-agent.service
    systemctl --no-pager --lines=5 status dpu-agent.service
    say "serving; from a host: dpuctl --target <address>:50051 --ca ca.pem --cert client-T.pem --key client-T.key info"
else
    say "enabled; start it with: systemctl start dpu-agent"
fi
