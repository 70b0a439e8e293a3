#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian 12 machine, idempotently:
#   1. Debian packages (apt-get, only when something is missing),
#   2. the virtualenv .venv from the system Python 3 with --system-site-packages,
#      so Debian's python3-pyverbs (built against the installed rdma-core) imports,
#   3. the project itself, editable, with the pinned dev tools.
# A stamp file skips step 3 while pyproject.toml and constraints.txt are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

mapfile -t PKGS < <(cat deploy/apt-packages.txt deploy/testvm/apt-packages.txt 2>/dev/null \
    | sed 's/#.*//' | tr -s ' \t' '\n' | sed '/^$/d' | sort -u)
missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "bootstrap: Debian packages present (${#PKGS[@]})"
fi

PY=/usr/bin/python3
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV from $PY (--system-site-packages, for pyverbs)"
    "$PY" -m venv --system-site-packages "$VENV"
fi
stamp="$VENV/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    echo "bootstrap: installing the project and its pinned tools into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt --config-settings editable_mode=compat -e '.[dev]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
else
    echo "bootstrap: $VENV up to date"
fi
"$VENV/bin/python" - <<'PY'
import grpc, google.protobuf, pyverbs
print(f"bootstrap: grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, pyverbs from {pyverbs.__path__[0]}")
PY
