#!/usr/bin/env bash
# Build the shuffledp:latest image without any container registry:
#   1. wheels of the project and all its dependencies on the host (pip, PyPI) -> deploy/.build/wheels, and of the
#      Prio3 binding native/ (shuffledp_prio, a Rust build, not on PyPI) where the host has cargo: the image then has
#      the prio3 extra; without cargo it is built without it, and one line says so
#   2. the base image shuffledp-base:bookworm with debootstrap (deploy/build_base.sh; skipped if present)
#   3. docker build from a context holding only the wheels (pip install --no-index inside the build)
#
# Usage: deploy/build_image.sh [--tag NAME:TAG] [--base IMAGE] [--force-base] [--no-cache] [--python PYTHON]
#                              [--extras LIST]
#   --extras LIST  the project's optional dependencies too, e.g. mf (jax_privacy, for privacy.protocol = "mf");
#                  prio3 is added by itself where cargo exists, and naming it makes a host without cargo an error
#   --base IMAGE   use another base (e.g. python:3.11-slim where a registry is reachable); skips step 2
#   --force-base   rebuild the debootstrap base even if it exists; --no-cache: no docker build cache either
#                  (both together = a build from scratch, what the deployment tests do)
# The host python must be CPython of the same minor version as the base's python3 (3.11 for bookworm). The binding's
# wheel (abi3, CPython >= 3.11) links the host's glibc: the base's must be as new (bookworm: 2.36; the check below
# imports it in the image).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG="shuffledp:latest"
BASE="shuffledp-base:bookworm"
BASE_GIVEN=0
FORCE_BASE=()
NO_CACHE=()
PYTHON="${PYTHON:-}"
EXTRAS=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) TAG="${2:?--tag needs NAME:TAG}"; shift 2 ;;
    --base) BASE="${2:?--base needs an image}"; BASE_GIVEN=1; shift 2 ;;
    --force-base) FORCE_BASE=(--force); shift ;;
    --no-cache) NO_CACHE=(--no-cache); shift ;;
    --python) PYTHON="${2:?--python needs a path}"; shift 2 ;;
    --extras)
      [[ ${2:-} =~ ^[a-z0-9_-]+(,[a-z0-9_-]+)*$ ]] || { echo "build_image.sh: --extras takes NAME[,NAME...], got '${2:-}'" >&2; exit 2; }
      EXTRAS="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build_image.sh: unknown argument '$1' (allowed: --tag, --base, --force-base, --no-cache, --python, --extras)" >&2; exit 2 ;;
  esac
done

log() { echo "[build_image] $*" >&2; }

if [[ -z $PYTHON ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi

# Compose: the v2 plugin (`docker compose`) or the standalone v1 binary (`docker-compose`); reported here so
# the deployment scripts and docs can use the same detection.
if docker compose version >/dev/null 2>&1; then
  COMPOSE="docker compose"
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE="docker-compose"
else
  COMPOSE=""
fi
log "compose command: ${COMPOSE:-none found (install docker-compose or the compose plugin)}"

START=$(date +%s)
BUILD="$ROOT/deploy/.build"
WHEELS="$BUILD/wheels"
mkdir -p "$WHEELS"
# the build context is $BUILD; only wheels/ is sent (logs and anything else stay out)
printf '*\n!wheels\n' >"$BUILD/.dockerignore"
# a fresh context every time: stale wheels of an older project build must not be picked up
rm -f "$WHEELS"/shuffledp-*.whl "$WHEELS"/shuffledp_prio-*.whl

# The Prio3 binding: the extra prio3 (pyproject.toml) resolves to its wheel, built here (never looked up on an index)
PRIO3=0
HOST_EXTRAS=""  # the extras pip wheel resolves (on PyPI): all but prio3
for e in ${EXTRAS//,/ }; do [[ $e == prio3 ]] || HOST_EXTRAS="${HOST_EXTRAS:+$HOST_EXTRAS,}$e"; done
if [[ -d $ROOT/native ]] && command -v cargo >/dev/null 2>&1; then
  PRIO3=1
elif [[ ,$EXTRAS, == *,prio3,* ]]; then
  echo "build_image.sh: --extras prio3 needs a Rust toolchain (cargo) on this host to build native/ (shuffledp_prio); install rustup (https://rustup.rs)" >&2
  exit 2
else
  log "no Rust toolchain (cargo) on this host: the image is built without shuffledp_prio (no prio3 transport in it)"
fi

PYVER="$("$PYTHON" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')"
log "building wheels with $PYTHON (Python $PYVER) into $WHEELS"
T0=$(date +%s)
# Build from a clean copy of the tree: setuptools reuses ./build/lib, so an in-tree build could ship modules
# that were deleted since, and would leave build/ and *.egg-info behind in the work tree.
SRC="$(mktemp -d /tmp/shuffledp-src.XXXXXX)"
trap 'rm -rf "$SRC"' EXIT
tar -C "$ROOT" --exclude=./.git --exclude='./.venv*' --exclude=./deploy/.build --exclude=./build \
  --exclude='*.egg-info' --exclude='__pycache__' --exclude='*.so' --exclude=./results --exclude=./.pytest_cache \
  --exclude=./.ruff_cache --exclude=./native/target -c . | tar -C "$SRC" -x
"$PYTHON" -m pip wheel --disable-pip-version-check "$SRC${HOST_EXTRAS:+[$HOST_EXTRAS]}" -w "$WHEELS" \
  >"$BUILD/pip-wheel.log" 2>&1 || {
  tail -n 40 "$BUILD/pip-wheel.log" >&2
  echo "build_image.sh: pip wheel failed (full log: $BUILD/pip-wheel.log)" >&2
  exit 1
}
IMAGE_EXTRAS="$HOST_EXTRAS"
if [[ $PRIO3 -eq 1 ]]; then
  # maturin (native/pyproject.toml's build backend, from PyPI) in native/ itself: cargo's native/target caches the
  # release build (~1-2 min the first time, seconds after), as scripts/_venv.sh's `pip install ./native` does
  log "building the wheel of native/ (shuffledp_prio, Rust)"
  "$PYTHON" -m pip wheel --disable-pip-version-check --no-deps "$ROOT/native" -w "$WHEELS" \
    >"$BUILD/pip-wheel-native.log" 2>&1 || {
    tail -n 40 "$BUILD/pip-wheel-native.log" >&2
    echo "build_image.sh: the wheel of native/ failed (full log: $BUILD/pip-wheel-native.log)" >&2
    exit 1
  }
  IMAGE_EXTRAS="${IMAGE_EXTRAS:+$IMAGE_EXTRAS,}prio3"
fi
T1=$(date +%s)
log "wheels ready in $((T1 - T0)) s: $(ls "$WHEELS" | wc -l) files, $(du -sh "$WHEELS" | cut -f1)"

if [[ $BASE_GIVEN -eq 0 ]]; then
  bash "$ROOT/deploy/build_base.sh" "${FORCE_BASE[@]}" --tag "$BASE" >/dev/null
fi
BASE_PY="$(docker run --rm --entrypoint python3 "$BASE" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')"
if [[ $BASE_PY != "$PYVER" ]]; then
  echo "build_image.sh: base $BASE has Python $BASE_PY but the wheels were built for $PYVER; use --python" >&2
  exit 1
fi

OLD_ID="$(docker image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)"
T2=$(date +%s)
log "docker build $TAG from $BASE"
# Legacy builder and BuildKit both accept a Dockerfile outside the context; the context is only wheels/.
# --network=none: the build installs from the context's wheels only, and this proves it needs nothing else.
docker build --network=none "${NO_CACHE[@]}" --build-arg BASE="$BASE" --build-arg EXTRAS="${IMAGE_EXTRAS:+[$IMAGE_EXTRAS]}" -t "$TAG" -f "$ROOT/deploy/Dockerfile" "$BUILD" >"$BUILD/docker-build.log" 2>&1 || {
  tail -n 40 "$BUILD/docker-build.log" >&2
  echo "build_image.sh: docker build failed (full log: $BUILD/docker-build.log)" >&2
  exit 1
}
T3=$(date +%s)
# Remove only our own leftovers: the install stage, and the previous $TAG if this build replaced it.
docker image prune -f --filter label=org.shuffledp.stage=install >/dev/null || true
NEW_ID="$(docker image inspect --format '{{.Id}}' "$TAG")"
if [[ -n $OLD_ID && $OLD_ID != "$NEW_ID" ]]; then
  docker rmi "$OLD_ID" >/dev/null 2>&1 || log "previous image ${OLD_ID:7:12} still in use; left in place"
fi
# old untagged bases that nothing builds on any more (build_base.sh --force replaced them)
docker image prune -f --filter label=org.shuffledp.base >/dev/null || true

CHECK="import shuffledp, grpc, numpy"
[[ ,$IMAGE_EXTRAS, == *,mf,* ]] && CHECK="$CHECK, jax_privacy"
docker run --rm --entrypoint python "$TAG" -c "$CHECK" || {
  echo "build_image.sh: the image does not import shuffledp" >&2
  exit 1
}
if [[ $PRIO3 -eq 1 ]]; then
  docker run --rm --network none --entrypoint python "$TAG" -c "import shuffledp_prio" || {
    echo "build_image.sh: the image does not import shuffledp_prio (the host's glibc newer than the base's?)" >&2
    exit 1
  }
fi
SIZE="$(docker image inspect --format '{{.Size}}' "$TAG")"
END=$(date +%s)
log "docker build $((T3 - T2)) s; total $((END - START)) s; $TAG size $(awk -v s="$SIZE" 'BEGIN{printf "%.1f MB", s/1e6}')"
echo "image_build_seconds=$((T3 - T2))"
echo "total_seconds=$((END - START))"
echo "image_size_bytes=$SIZE"
echo "prio3_binding=$PRIO3"
