#!/usr/bin/env bash
# Build the local base image shuffledp-base:bookworm with debootstrap (no container registry is needed).
#
# Usage: deploy/build_base.sh [--force] [--mirror URL] [--tag NAME:TAG] [--packages LIST]
#   --force     rebuild even if the image already exists
#   --mirror    Debian mirror (default: first bookworm mirror in /etc/apt/sources.list[.d], else deb.debian.org)
#   --packages  more Debian packages, comma-separated (e.g. docker.io,iptables for deploy/engines.sh's engines)
# Needs root (debootstrap) and a running Docker engine. Prints elapsed time and image size.
set -euo pipefail

TAG="shuffledp-base:bookworm"
SUITE="bookworm"
FORCE=0
MIRROR="${MIRROR:-}"
# python3-venv gives the image `python3 -m venv`; ca-certificates for any TLS the operator adds later
PACKAGES="python3,python3-venv,ca-certificates"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --force) FORCE=1; shift ;;
    --mirror) MIRROR="${2:?--mirror needs a URL}"; shift 2 ;;
    --tag) TAG="${2:?--tag needs NAME:TAG}"; shift 2 ;;
    --packages)
      [[ ${2:-} =~ ^[a-z0-9][a-z0-9.+-]*(,[a-z0-9][a-z0-9.+-]*)*$ ]] ||
        { echo "build_base.sh: --packages takes NAME[,NAME...], got '${2:-}'" >&2; exit 2; }
      PACKAGES="$PACKAGES,$2"; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "build_base.sh: unknown argument '$1' (allowed: --force, --mirror URL, --tag NAME:TAG, --packages LIST)" >&2; exit 2 ;;
  esac
done

log() { echo "[build_base] $*" >&2; }

image_size() {
  docker image inspect --format '{{.Size}}' "$1" | awk '{printf "%.1f MB (%d bytes)", $1/1e6, $1}'
}

if [[ $FORCE -eq 0 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "image $TAG exists, skipping (use --force to rebuild); size $(image_size "$TAG")"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  echo "build_base.sh: debootstrap needs root (running as uid $(id -u))" >&2
  exit 1
fi

# First Debian mirror for the suite that apt on this host already uses (one-line and deb822 formats);
# security and updates suites are skipped because debootstrap needs the main archive.
detect_mirror() {
  local f
  shopt -s nullglob
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    awk -v s="$SUITE" '$1=="deb" { i=2; if ($2 ~ /^\[/) { while (i<=NF && $i !~ /\]$/) i++; i++ }
      if ($(i+1)==s) { print $i; exit } }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -r $f ]] || continue
    # deb822 stanzas are separated by blank lines; keep the URIs of a stanza whose Suites has the suite
    awk -v s="$SUITE" 'BEGIN { RS=""; FS="\n" }
      { uri=""; ok=0; deb=1
        for (k=1; k<=NF; k++) {
          if ($k ~ /^URIs:/) { split($k, a, /[ \t]+/); uri=a[2] }
          if ($k ~ /^Suites:/) { n=split($k, b, /[ \t]+/); for (j=2; j<=n; j++) if (b[j]==s) ok=1 }
          if ($k ~ /^Types:/ && $k !~ /(^|[ \t])deb([ \t]|$)/) deb=0
        }
        if (ok && deb && uri != "") { print uri; exit } }' "$f"
  done | head -n 1
}

if [[ -z $MIRROR ]]; then
  MIRROR="$(detect_mirror || true)"
  MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi
log "suite $SUITE, mirror $MIRROR, packages $PACKAGES"

if ! command -v debootstrap >/dev/null 2>&1; then
  log "installing debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

OLD_ID="$(docker image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)"
START=$(date +%s)
WORK="$(mktemp -d /tmp/shuffledp-base.XXXXXX)"
cleanup() {
  # debootstrap may leave /proc or /sys mounted inside the rootfs after a failure
  local m
  for m in proc sys dev/pts dev; do
    mountpoint -q "$WORK/rootfs/$m" 2>/dev/null && umount -l "$WORK/rootfs/$m" || true
  done
  rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
  tail -n 30 "$WORK/debootstrap.log" >&2
  echo "build_base.sh: debootstrap failed (log above)" >&2
  exit 1
}

# Trim what a runtime image does not need: package caches and lists, docs, man pages, locales.
R="$WORK/rootfs"
rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/lib/apt/lists/* "$R"/var/log/* "$R"/tmp/* \
  "$R"/usr/share/doc/* "$R"/usr/share/man/* "$R"/usr/share/info/*
find "$R"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
# Point apt in the image at the same mirror (the host's mirror may not be reachable from containers otherwise)
echo "deb $MIRROR $SUITE main" >"$R/etc/apt/sources.list"

tar --numeric-owner -C "$R" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --change 'LABEL org.shuffledp.base=bookworm' \
  - "$TAG" >/dev/null

NEW_ID="$(docker image inspect --format '{{.Id}}' "$TAG")"
if [[ -n $OLD_ID && $OLD_ID != "$NEW_ID" ]]; then
  # --force replaced the tag: drop the old base unless an image still builds on it
  docker rmi "$OLD_ID" >/dev/null 2>&1 || log "previous base ${OLD_ID:7:12} still in use; left in place"
fi
END=$(date +%s)
log "built $TAG in $((END - START)) s; size $(image_size "$TAG")"
echo "base_build_seconds=$((END - START))"
echo "base_image_size_bytes=$(docker image inspect --format '{{.Size}}' "$TAG")"
