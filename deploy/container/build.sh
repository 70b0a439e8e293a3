#!/usr/bin/env bash
# Builds the dpu-agent image with podman and no network in the build, as an air-gapped
# DPU would: a Debian base made locally with mmdebstrap and `podman import`, and the
# project's wheel with every dependency's from a wheelhouse fetched beforehand on this
# machine (pip download), installed in the image with --no-index.
#
#   deploy/container/build.sh                 the image for this machine (amd64 here)
#   deploy/container/build.sh --arch arm64    the arm64 image (qemu-user binfmt, as
#                                             deploy/aarch64/run-tests.sh registers it)
#
# Prints the image name on its last line: localhost/dpu-agent:<version> for this
# machine's architecture, localhost/dpu-agent:<version>-<arch> for another. Needs root
# (podman with runc and cgroupfs, as these machines need) and the checkout's .venv
# (`make venv`: its pip fetches and builds the wheels). Caches the base tarball and the
# wheelhouse in ${DPU_CONTAINER_CACHE:-~/.cache/dpu-container}, keyed by their inputs.
set -euo pipefail
cd "$(dirname "$0")/../.."

SUITE=bookworm
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)
# What the Containerfile expects of its BASE (its comment says the same).
BASE_PKGS=(python3 python3-venv python3-pyverbs ibverbs-providers iproute2 passwd
    ca-certificates)
HOST_PKGS=(podman runc mmdebstrap)
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)
# The default rlimits cannot be raised on these machines ("setrlimit ... not permitted").
LIMITS=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
CACHE=${DPU_CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dpu-container}

log() { printf 'container: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }
now() { date +%s; }

NATIVE=$(dpkg --print-architecture)
ARCH=$NATIVE
while [ $# -gt 0 ]; do
    case $1 in
        --arch) ARCH=${2:?--arch needs amd64 or arm64}; shift ;;
        -h|--help) sed -n '2,15s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
    shift
done
case $ARCH in amd64|arm64) ;; *) die "--arch must be amd64 or arm64, not $ARCH" ;; esac
[ "$(id -u)" -eq 0 ] || die "needs root (podman with runc, mmdebstrap)"
[ -x .venv/bin/python ] || die "no .venv: run 'make venv' first (its pip fetches the wheels)"

VERSION=$(/usr/bin/python3 -c 'import tomllib
print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
IMAGE=localhost/dpu-agent:$VERSION
[ "$ARCH" = "$NATIVE" ] || IMAGE=$IMAGE-$ARCH

install_host_packages() {
    local missing=() p
    local wanted=("${HOST_PKGS[@]}")
    for p in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing host packages: ${missing[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            "${missing[@]}" >/dev/null
    fi
}

# The base: mmdebstrap's tarball, imported as localhost/dpu-base:<suite>-<arch>-<key>.
base_image() {
    local key tar tag include t
    key=$(printf '%s\n' "$SUITE" "$ARCH" "${MIRRORS[@]}" "${BASE_PKGS[@]}" | sha256sum | cut -c1-12)
    tar=$CACHE/base-$ARCH-$key.tar
    tag=localhost/dpu-base:$SUITE-$ARCH-$key
    if [ ! -e "$tar" ]; then
        mkdir -p "$CACHE"
        include=$(IFS=,; echo "${BASE_PKGS[*]}")
        log "making the $ARCH base with mmdebstrap (minbase + $include)"
        t=$(now)
        mmdebstrap --quiet --variant=minbase --arch="$ARCH" --include="$include" \
            "$SUITE" "$CACHE/partial-$ARCH.tar" "${MIRRORS[@]}"
        mv "$CACHE/partial-$ARCH.tar" "$tar"
        log "base tarball in $(($(now) - t)) s ($(du -h "$tar" | cut -f1))"
        find "$CACHE" -maxdepth 1 -name "base-$ARCH-*.tar" ! -name "base-$ARCH-$key.tar" -delete
    fi
    if ! "${PODMAN[@]}" image exists "$tag"; then
        log "podman import $tar as $tag"
        "${PODMAN[@]}" import --arch "$ARCH" "$tar" "$tag" >/dev/null
    fi
    BASE=$tag
}

project_requirements() {
    /usr/bin/python3 -c 'import tomllib, sys
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        pyproject.toml
}

# Every dependency's wheel for the image's platform (Debian 12: CPython 3.11, glibc 2.36).
wheelhouse() {
    local key reqs=() plat=() v t
    key=$(cat pyproject.toml constraints.txt <(echo "$ARCH") | sha256sum | cut -c1-12)
    WHEELS=$CACHE/wheels-$ARCH-$key
    [ -e "$WHEELS/.complete" ] && return 0
    local machine=x86_64
    [ "$ARCH" = arm64 ] && machine=aarch64
    plat=(--platform "manylinux2014_$machine" --platform "linux_$machine")
    for v in 17 24 26 27 28 31 34 35 36; do plat+=(--platform "manylinux_2_${v}_$machine"); done
    mapfile -t reqs < <(project_requirements)
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    log "downloading the $ARCH wheels of the dependencies into $WHEELS"
    t=$(now)
    .venv/bin/python -m pip download -qq --disable-pip-version-check -d "$WHEELS" \
        --only-binary=:all: "${plat[@]}" --python-version 3.11 --implementation cp \
        --abi cp311 --abi abi3 --abi none -c constraints.txt "${reqs[@]}"
    touch "$WHEELS/.complete"
    log "wheels in $(($(now) - t)) s ($(find "$WHEELS" -name '*.whl' | wc -l) files)"
    find "$CACHE" -maxdepth 1 -name "wheels-$ARCH-*" ! -name "wheels-$ARCH-$key" \
        -exec rm -rf {} +
}

T0=$(now)
install_host_packages
# arm64 on this machine: qemu-user registered with binfmt_misc, as the arm64 suite does
[ "$ARCH" = "$NATIVE" ] || deploy/aarch64/run-tests.sh --binfmt
base_image
wheelhouse
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/wheels" "$STAGE/deploy/container"
cp constraints.txt "$STAGE/"
cp deploy/container/agent.toml "$STAGE/deploy/container/"
cp "$WHEELS"/*.whl "$STAGE/wheels/"
# The project's own wheel: pure Python, built from this checkout every time.
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$STAGE/wheels" . >&2
log "building $IMAGE from $BASE (podman build --network none)"
t=$(now)
"${PODMAN[@]}" build --quiet --network none --arch "$ARCH" "${LIMITS[@]}" \
    --build-arg BASE="$BASE" -f deploy/container/Containerfile \
    --ignorefile deploy/container/Containerfile.dockerignore -t "$IMAGE" "$STAGE" >/dev/null
log "image built in $(($(now) - t)) s; total $(($(now) - T0)) s"
echo "$IMAGE"
