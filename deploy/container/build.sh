#!/usr/bin/env bash
# Builds the dpu-agent image with podman and no network in the build, as an air-gapped
# DPU would: a Debian base made locally with mmdebstrap and `podman import`, every
# dependency's wheel from a wheelhouse fetched beforehand on this machine (pip download),
# installed in the image with --no-index, and the project's wheel built in the image's
# build stage from its sdist (a second local base with the compiler and headers), so that
# its C extension is compiled for the image's architecture.
#
#   deploy/container/build.sh                 the image for this machine (amd64 here)
#   deploy/container/build.sh --arch arm64    the arm64 image (qemu-user binfmt, as
#                                             deploy/aarch64/run-tests.sh registers it)
#   deploy/container/build.sh --bases [--arch arm64]   only what the image is built from
#                                             (bases, wheelhouse), cached for a later build
#
# Prints the image name on its last line: localhost/dpu-agent:<version> for this
# machine's architecture, localhost/dpu-agent:<version>-<arch> for another. For arm64 the
# build stage runs on the arm64 suite's root filesystem (deploy/aarch64/run-tests.sh
# --rootfs, which has the compiler and headers), made alongside the base. Needs root
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
# What the Containerfile expects of its BASE (its comment says the same), and of its
# BUILD_BASE: that and what setup.py's optional C extension (the verbs transport's native
# core, dpu_wire/transport/_vcore.c) is compiled with.
BASE_PKGS=(python3 python3-venv python3-pyverbs ibverbs-providers iproute2 passwd
    ca-certificates)
BUILD_PKGS=("${BASE_PKGS[@]}" gcc libc6-dev python3-dev libibverbs-dev)
# The project's build backend (pyproject.toml [build-system]), for the offline build stage.
BUILD_REQS=("setuptools>=68" wheel)
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
BASES_ONLY=0
while [ $# -gt 0 ]; do
    case $1 in
        --arch) ARCH=${2:?--arch needs amd64 or arm64}; shift ;;
        --bases) BASES_ONLY=1 ;;
        -h|--help) sed -n '2,21s/^# \{0,1\}//p' "$0"; exit 0 ;;
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

# A base: mmdebstrap's tarball ($CACHE/<name without dpu->-<arch>-<key>.tar), imported as
# localhost/<name>:<suite>-<arch>-<key>. base_image NAME PACKAGES...: sets IMPORTED to the tag.
base_image() {
    local name=$1 key tar tag include t
    shift
    key=$(printf '%s\n' "$SUITE" "$ARCH" "${MIRRORS[@]}" "$@" | sha256sum | cut -c1-12)
    tar=$CACHE/${name#dpu-}-$ARCH-$key.tar
    tag=localhost/$name:$SUITE-$ARCH-$key
    if [ ! -e "$tar" ]; then
        mkdir -p "$CACHE"
        include=$(IFS=,; echo "$*")
        log "making $name for $ARCH with mmdebstrap (minbase + $include)"
        t=$(now)
        mmdebstrap --quiet --variant=minbase --arch="$ARCH" --include="$include" \
            "$SUITE" "$CACHE/partial-$name-$ARCH.tar" "${MIRRORS[@]}"
        mv "$CACHE/partial-$name-$ARCH.tar" "$tar"
        log "$name tarball in $(($(now) - t)) s ($(du -h "$tar" | cut -f1))"
        find "$CACHE" -maxdepth 1 -name "${name#dpu-}-$ARCH-*.tar" ! -name "${tar##*/}" -delete
    fi
    if ! "${PODMAN[@]}" image exists "$tag"; then
        log "podman import $tar as $tag"
        "${PODMAN[@]}" import --arch "$ARCH" "$tar" "$tag" >/dev/null
    fi
    IMPORTED=$tag
}

# rootfs_image NAME DIR: the arm64 suite's root filesystem DIR (rootfs-<key>) imported as
# localhost/<name>:<suite>-arm64-rootfs-<key>, without what the suite adds to it (/src,
# /opt's virtualenv and native core, the wheels' mount point, pip's cache); sets IMPORTED.
rootfs_image() {
    local name=$1 dir=$2 tag
    [ -e "$dir/.complete" ] || die "$dir is not a complete root filesystem"
    tag=localhost/$name:$SUITE-$ARCH-${dir##*/}
    if ! "${PODMAN[@]}" image exists "$tag"; then
        log "podman import $dir (the arm64 suite's root filesystem) as $tag"
        tar -C "$dir" --numeric-owner --exclude=./src --exclude='./opt/*' --exclude=./wheels \
            --exclude=./root/.cache --exclude='./tmp/*' -cf - . \
            | "${PODMAN[@]}" import --arch "$ARCH" - "$tag" >/dev/null
    fi
    IMPORTED=$tag
}

project_requirements() {
    /usr/bin/python3 -c 'import tomllib, sys
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        pyproject.toml
}

# Every dependency's wheel for the image's platform (Debian 12: CPython 3.11, glibc 2.36),
# and the build backend's.
wheelhouse() {
    local key reqs=() plat=() v t
    key=$(cat pyproject.toml constraints.txt <(echo "$ARCH") <(printf '%s\n' "${BUILD_REQS[@]}") \
        | sha256sum | cut -c1-12)
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
        --abi cp311 --abi abi3 --abi none -c constraints.txt "${reqs[@]}" "${BUILD_REQS[@]}"
    touch "$WHEELS/.complete"
    log "wheels in $(($(now) - t)) s ($(find "$WHEELS" -name '*.whl' | wc -l) files)"
    find "$CACHE" -maxdepth 1 -name "wheels-$ARCH-*" ! -name "wheels-$ARCH-$key" \
        -exec rm -rf {} +
}

T0=$(now)
install_host_packages
# arm64 on this machine: qemu-user registered with binfmt_misc, as the arm64 suite does
[ "$ARCH" = "$NATIVE" ] || deploy/aarch64/run-tests.sh --binfmt
if [ "$ARCH" = arm64 ]; then
    # The build base is the arm64 suite's root filesystem (a superset of BUILD_PKGS; the
    # suite reuses it), made by a second emulated mmdebstrap while the first makes the
    # base: each is one emulated process for minutes, and the machine has cores for both.
    ROOTFS_OUT=$(mktemp)
    deploy/aarch64/run-tests.sh --rootfs >"$ROOTFS_OUT" &
    ROOTFS_PID=$!
    base_image dpu-base "${BASE_PKGS[@]}"
    BASE=$IMPORTED
    wait "$ROOTFS_PID" \
        || die "the arm64 root filesystem (deploy/aarch64/run-tests.sh --rootfs) failed"
    rootfs_image dpu-build-base "$(tail -n 1 "$ROOTFS_OUT")"
    rm -f "$ROOTFS_OUT"
else
    base_image dpu-base "${BASE_PKGS[@]}"
    BASE=$IMPORTED
    base_image dpu-build-base "${BUILD_PKGS[@]}"
fi
BUILD_BASE=$IMPORTED
wheelhouse
if [ "$BASES_ONLY" = 1 ]; then
    log "bases and wheelhouse for $ARCH ready in $(($(now) - T0)) s"
    exit 0
fi
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/wheels" "$STAGE/sdist" "$STAGE/deploy/container"
cp constraints.txt "$STAGE/"
cp deploy/container/agent.toml "$STAGE/deploy/container/"
cp "$WHEELS"/*.whl "$STAGE/wheels/"
# The project's sdist, made from this checkout every time (in a copy: no build/ or
# egg-info left here); the build stage makes the wheel from it, C extension included.
# -W ignore: setuptools' deprecation notes about pyproject.toml.
mkdir "$STAGE/src"
git ls-files -z --cached --others --exclude-standard \
    | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$STAGE/src"
PY=$PWD/.venv/bin/python
(cd "$STAGE/src" && "$PY" -W ignore setup.py -q sdist -d "$STAGE/sdist" >&2)
rm -rf "$STAGE/src"
log "building $IMAGE from $BASE, its wheel in $BUILD_BASE (podman build --network none)"
t=$(now)
"${PODMAN[@]}" build --quiet --network none --arch "$ARCH" "${LIMITS[@]}" \
    --build-arg BASE="$BASE" --build-arg BUILD_BASE="$BUILD_BASE" \
    -f deploy/container/Containerfile \
    --ignorefile deploy/container/Containerfile.dockerignore -t "$IMAGE" "$STAGE" >/dev/null
log "image built in $(($(now) - t)) s; total $(($(now) - T0)) s"
echo "$IMAGE"
