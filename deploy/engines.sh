#!/usr/bin/env bash
# Several Docker engines on this one machine, joined into one swarm: a multi-host test bed for deploy/swarm.sh
# (issue 28). Each engine is a container of the host engine running its own dockerd (image shuffledp-engine:bookworm,
# built offline with deploy/build_base.sh --packages docker.io,...), with its own /var/lib/docker on a volume, on a
# bridge network of the host with a fixed address. Engine 1 is the swarm manager; the others join as workers.
#
# Usage: deploy/engines.sh [--prefix NAME] COMMAND [args]
#   up N [--subnet CIDR] [--share DIR]...
#                  build the engine image if it is missing, start engines NAME-1..NAME-N (addresses .11, .12, ... of
#                  the subnet, default 172.29.213.0/24), make NAME-1 a swarm manager and join the others.
#                  --share DIR: bind-mount DIR at the same path into every engine (swarm.sh run mounts its PKI and
#                  results directory from the manager's file system)
#   host [I]       the DOCKER_HOST of engine I (default 1, the manager): a unix socket under /tmp/NAME
#   stop I | start I   stop (SIGTERM to its dockerd: every task on it ends) or start engine I again
#   down           remove the engines, their volumes, the network and /tmp/NAME
# Options (or environment): --prefix NAME (SHUFFLEDP_ENGINES, default sdpeng): names of everything it creates.
# Needs root on the host engine (capabilities for dockerd, a cgroup per engine) and a kernel with overlayfs and
# vxlan. Docker's encrypted overlays also need ESP between the engines (see docs/how-to/swarm.md).
set -euo pipefail

DEPLOY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX="${SHUFFLEDP_ENGINES:-sdpeng}"
ENGINE_IMAGE="${SHUFFLEDP_ENGINE_IMAGE:-shuffledp-engine:bookworm}"
ENGINE_PACKAGES=docker.io,iptables,procps,iproute2

die() { echo "engines.sh: $*" >&2; exit 1; }
log() { echo "[engines] $*" >&2; }

if [[ ${1:-} == --prefix ]]; then PREFIX="${2:?--prefix needs a name}"; shift 2; fi
[[ $PREFIX =~ ^[a-z0-9][a-z0-9-]{0,20}$ ]] || die "--prefix '$PREFIX' must match [a-z0-9][a-z0-9-]* (at most 21 characters)"
RUN="/tmp/$PREFIX"
NET="$PREFIX-net"
LABEL="org.shuffledp.engines=$PREFIX"

engine() { echo "$PREFIX-$1"; }
engines() { docker ps -a --filter "label=$LABEL" --format '{{.Names}}' | sort; }
sock() { echo "unix://$RUN/$1/docker.sock"; }
edocker() { local i=$1; shift; DOCKER_HOST="$(sock "$i")" docker "$@"; }

# wait until engine I's dockerd answers on its socket
wait_engine() {
  local i=$1 deadline=$((SECONDS + 90))
  until edocker "$i" info >/dev/null 2>&1; do
    if ! docker inspect --format '{{.State.Running}}' "$(engine "$i")" 2>/dev/null | grep -q true || (( SECONDS >= deadline )); then
      docker logs --tail 15 "$(engine "$i")" >&2 2>&1 || true
      die "engine $(engine "$i")'s dockerd did not start (log above)"
    fi
    sleep 0.5
  done
}

cmd_up() {
  local n=${1:?usage: up N [--subnet CIDR] [--share DIR]...} subnet=172.29.213.0/24 shares=() i
  [[ $n =~ ^[1-9]$ ]] || die "up N: N must be 1..9"
  shift
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --subnet) subnet="${2:?--subnet needs a CIDR}"; shift 2 ;;
      --share) [[ -d ${2:-} ]] || die "--share needs an existing directory"; shares+=(-v "$2:$2"); shift 2 ;;
      *) die "up takes N, --subnet CIDR and --share DIR" ;;
    esac
  done
  [[ $subnet =~ ^([0-9]+\.[0-9]+\.[0-9]+)\.0/24$ ]] || die "--subnet '$subnet' must be a /24 (a.b.c.0/24)"
  local net3=${BASH_REMATCH[1]}
  [[ -z "$(engines)" ]] || die "engines $PREFIX-* exist already ($(engines | tr '\n' ' ')): down first"
  if ! docker image inspect "$ENGINE_IMAGE" >/dev/null 2>&1; then
    log "building $ENGINE_IMAGE (deploy/build_base.sh --packages $ENGINE_PACKAGES)"
    bash "$DEPLOY/build_base.sh" --tag "$ENGINE_IMAGE" --packages "$ENGINE_PACKAGES" >&2
  fi
  docker network inspect "$NET" >/dev/null 2>&1 ||
    docker network create --driver bridge --subnet "$subnet" --label "$LABEL" "$NET" >/dev/null
  for ((i = 1; i <= n; i++)); do
    mkdir -p "$RUN/$i"
    # Not --privileged: the host engine may lack capabilities that it would add (CAP_SYS_RESOURCE here): every other
    # capability, no seccomp or AppArmor profile, writable /proc/sys, all devices. Its own cgroup parent keeps
    # the nested containers apart from the host engine's.
    docker run -d --name "$(engine "$i")" --hostname "$(engine "$i")" --label "$LABEL" \
      --cap-add ALL --cap-drop SYS_RESOURCE --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
      --security-opt systempaths=unconfined --device-cgroup-rule 'a *:* rwm' \
      --network "$NET" --ip "$net3.$((10 + i))" \
      -v /sys/fs/cgroup:/sys/fs/cgroup -v "$(engine "$i")-lib:/var/lib/docker" -v "$RUN/$i:/run/engine" \
      ${shares[@]+"${shares[@]}"} "$ENGINE_IMAGE" \
      dockerd --host unix:///var/run/docker.sock --host unix:///run/engine/docker.sock \
      --storage-driver overlay2 --cgroup-parent "$(engine "$i")" >/dev/null
  done
  for ((i = 1; i <= n; i++)); do wait_engine "$i"; done
  edocker 1 swarm init --advertise-addr "$net3.11" >/dev/null
  local token
  token="$(edocker 1 swarm join-token -q worker)"
  for ((i = 2; i <= n; i++)); do
    edocker "$i" swarm join --token "$token" "$net3.11:2377" >/dev/null
  done
  log "$n engines up, swarm manager $(engine 1) ($net3.11); DOCKER_HOST=$(sock 1)"
}

cmd_down() {
  local name
  for name in $(engines); do docker rm -f -v "$name" >/dev/null; done
  docker volume ls -q --filter "name=^$PREFIX-" | grep -E "^$PREFIX-[0-9]+-lib$" | xargs -r docker volume rm >/dev/null
  docker network rm "$NET" >/dev/null 2>&1 || true
  rm -rf "$RUN"
  log "engines $PREFIX-* removed"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  host) echo "$(sock "${2:-1}")" ;;
  stop) docker stop -t 30 "$(engine "${2:?stop I}")" >/dev/null ;;
  start) docker start "$(engine "${2:?start I}")" >/dev/null; wait_engine "$2" ;;
  down) cmd_down ;;
  -h|--help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
  *) die "unknown command '$1' (up, host, stop, start, down)" ;;
esac
