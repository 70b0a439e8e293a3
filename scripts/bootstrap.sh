#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian 12 machine, idempotently:
#   1. Debian packages (apt-get, only when something is missing),
#   2. the virtualenv .venv from the system Python 3 with --system-site-packages,
#      so Debian's python3-pyverbs (built against the installed rdma-core) imports,
#   3. the project itself, editable, with the pinned dev tools; the editable install
#      also compiles setup.py's optional C extension (the verbs transport's native core)
#      in place: dpu_wire/transport/_vcore.<python and machine tag>.so.
# A stamp file skips step 3 while pyproject.toml, constraints.txt, setup.py and the C
# source are unchanged; a missing .so alone is rebuilt with `setup.py build_ext --inplace`.
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
# The native core: optional (the package runs its pure-Python path without it), but with
# the inputs this script installs it must build, and tests/unit/test_native_build.py says so.
VCORE_SRC=dpu_wire/transport/_vcore.c
VCORE_SO=dpu_wire/transport/_vcore$("$VENV/bin/python" -c 'import sysconfig
print(sysconfig.get_config_var("EXT_SUFFIX"))')
stamp="$VENV/.installed-$(cat pyproject.toml constraints.txt setup.py "$VCORE_SRC" | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    echo "bootstrap: installing the project and its pinned tools into $VENV"
    rm -f "$VCORE_SO"  # a failed compile must not leave the previous build in place
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt --config-settings editable_mode=compat -e '.[dev]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
else
    echo "bootstrap: $VENV up to date"
fi
if [ ! -e "$VCORE_SO" ]; then
    # pip -q hides an optional extension's failure: build it again where its errors show
    # (also after the .so was deleted, or when the inputs were installed later).
    # A fresh build directory: build_ext --inplace copies whatever its build directory
    # holds, an earlier build too when this compile fails. -W ignore: setuptools'
    # deprecation notes about pyproject.toml, not about the build.
    echo "bootstrap: building the native core $VCORE_SO (setup.py build_ext --inplace)"
    tmp=$(mktemp -d)
    "$VENV/bin/python" -W ignore setup.py -q build_ext --inplace --build-lib "$tmp/lib" \
        --build-temp "$tmp/temp" || true
    rm -rf "$tmp"
fi
if [ -e "$VCORE_SO" ]; then
    echo "bootstrap: native core $VCORE_SO built"
else
    echo "bootstrap: WARNING: the native core did not build (errors above): the verbs" \
        "transport runs its pure-Python path, and tests/unit/test_native_build.py fails" >&2
fi
"$VENV/bin/python" - <<'PY'
import grpc, google.protobuf, pyverbs
print(f"bootstrap: grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, pyverbs from {pyverbs.__path__[0]}")
PY
