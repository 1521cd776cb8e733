#!/usr/bin/env bash
# Build the image shuffledp-prometheus:latest from Debian's `prometheus` package, without any container registry:
#   1. the base image shuffledp-base:bookworm (deploy/build_base.sh; skipped if present)
#   2. `apt-get download prometheus` on the host (Debian's archive, as for the base image), unpacked with dpkg-deb
#   3. docker build from a context holding only its two binaries, the Dockerfile and prometheus.yml
#
# Usage: deploy/monitoring/build_prometheus.sh [--tag NAME:TAG] [--force]
#   --force   rebuild even if the image exists
# Needs root (apt-get, and debootstrap for the base) and a running Docker engine; the host must be Debian bookworm
# (the package's binaries link against the base image's libc).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEPLOY="$(cd "$HERE/.." && pwd)"
TAG="shuffledp-prometheus:latest"
BASE="shuffledp-base:bookworm"
FORCE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) TAG="${2:?--tag needs NAME:TAG}"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "build_prometheus.sh: unknown argument '$1' (allowed: --tag NAME:TAG, --force)" >&2; exit 2 ;;
  esac
done
log() { echo "[build_prometheus] $*" >&2; }

if [[ $FORCE -eq 0 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "image $TAG exists, skipping (use --force to rebuild)"
  exit 0
fi
"$DEPLOY/build_base.sh" --tag "$BASE"

CTX="$DEPLOY/.build/prometheus"
rm -rf "$CTX"
mkdir -p "$CTX/deb"
# apt's sandbox user must be able to write where the .deb goes
chmod 777 "$CTX/deb"
if ! (cd "$CTX/deb" && apt-get download -q prometheus >/dev/null 2>&1); then
  apt-get update -qq
  (cd "$CTX/deb" && apt-get download -q prometheus)
fi
DEB="$(ls "$CTX"/deb/prometheus_*.deb)"
log "unpacking $(basename "$DEB")"
dpkg-deb -x "$DEB" "$CTX/rootfs"
# the build context: the two binaries, the Dockerfile and the scrape configuration, nothing else
mkdir -p "$CTX/context"
cp "$CTX/rootfs/usr/bin/prometheus" "$CTX/rootfs/usr/bin/promtool" "$HERE/Dockerfile" "$HERE/prometheus.yml" \
  "$CTX/context/"
docker build -q -t "$TAG" --build-arg "BASE=$BASE" "$CTX/context" >/dev/null
rm -rf "$CTX"
log "built $TAG ($(docker image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
