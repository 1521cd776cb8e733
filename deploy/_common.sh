# Shared by deploy/compose.sh and deploy/swarm.sh, which source it (it runs nothing by itself): the defaults and
# options both take, the image, the PKI, the operator's CLI and container, and waiting until services are ready.
# Usage: . _common.sh PKI TIMEOUT (the script's default PKI directory under deploy/, and seconds to wait for health)
# shellcheck shell=bash disable=SC2034  # what it sets is read by the scripts that source it

DEPLOY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$DEPLOY/.." && pwd)"
TOOL="$(basename "$0" .sh)"  # compose or swarm: the prefix of messages
CONFIG="${SHUFFLEDP_CONFIG:-$DEPLOY/example.toml}"
PKI="${SHUFFLEDP_PKI:-$DEPLOY/$1}"
TIMEOUT="${SHUFFLEDP_UP_TIMEOUT:-$2}"
IMAGE="${SHUFFLEDP_IMAGE:-shuffledp:latest}"
CLIENTS="${SHUFFLEDP_CLIENT_NODES:-}"
FLEETS="${SHUFFLEDP_FLEETS:-}"  # a device deployment's fleet containers (default_fleets)

die() { echo "$TOOL.sh: $*" >&2; exit 1; }
log() { echo "[$TOOL] $*" >&2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }  # the header comment

# an absolute path for FILE; its directory need not exist yet
abspath() {
  if [[ -d $(dirname "$1") ]]; then echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
  elif [[ $1 == /* ]]; then echo "$1"
  else echo "$PWD/$1"
  fi
}

# parse_options "$@": the options both scripts take, and the script's own through its function own_option NAME VALUE
# (status 1: not one of its own; 2: a flag, which takes no value). Sets CMD and ARGS, the command's arguments. Then checks the common values.
parse_options() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --config) CONFIG="${2:?--config needs a file}"; shift 2 ;;
      --pki) PKI="${2:?--pki needs a directory}"; shift 2 ;;
      --image) IMAGE="${2:?--image needs a name}"; shift 2 ;;
      --clients) CLIENTS="${2:?--clients needs a number}"; shift 2 ;;
      --fleets) FLEETS="${2:?--fleets needs a number}"; shift 2 ;;
      --timeout) TIMEOUT="${2:?--timeout needs seconds}"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      -*) local rc=0
          own_option "$1" "${2:-}" || rc=$?
          case $rc in
            0) shift 2 ;;
            2) shift ;;  # a flag: takes no value
            *) die "unknown option '$1' (see --help)" ;;
          esac ;;
      *) break ;;
    esac
  done
  [[ $# -ge 1 ]] || { usage >&2; exit 2; }
  CMD="$1"; shift
  ARGS=("$@")
  [[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout '$TIMEOUT' must be a number of seconds"
  [[ -z $CLIENTS ]] || check_count "$CLIENTS" 100000  # the scripts check their own limit once they know the mode
  [[ -z $FLEETS || $FLEETS =~ ^[1-9][0-9]*$ ]] || die "--fleets '$FLEETS' must be a number >= 1"
  [[ -f $CONFIG ]] || die "configuration $CONFIG not found"
  CONFIG="$(abspath "$CONFIG")"
  PKI="$(abspath "$PKI")"
}

# check_count N [MAX]: N client nodes, 1..MAX (default 1000: containers or replicas of one node each; a fleet
# deployment's devices go to 100000, what `shuffledp pki` issues)
check_count() {
  local max=${2:-1000}
  { [[ $1 =~ ^[0-9]+$ ]] && (( $1 >= 1 && $1 <= max )); } || die "client nodes '$1' must be 1..$max"
}

# config_value FILE SECTION KEY DEFAULT: a `key = value` of a section of the TOML configuration FILE (DEFAULT if absent)
config_value() {
  local v
  v="$(awk -v want="$2" -v key="$3" '/^[[:space:]]*\[/ { sec = $0; gsub(/[][[:space:]]/, "", sec); next }
       sec == want && $1 == key { v = $0; sub(/^[^=]*=[[:space:]]*/, "", v); sub(/[[:space:]#].*$/, "", v); print v; exit }' "$1")"
  echo "${v:-$4}"
}

# [deployment] client_nodes of the configuration FILE (2, its default, if it has none)
config_clients() { config_value "$1" deployment client_nodes 2; }

# Whether the configuration FILE asks for devices (`[deployment] users_per_node = 1`): its client nodes are then device
# nodes of one user each, run by fleet containers (`shuffledp serve fleet`) instead of one container per node.
config_devices() { [[ $(config_value "$1" deployment users_per_node 0) == 1 ]]; }

# Devices per fleet when the operator gives no --fleets: Swarm's limit on a secret (500 KB) holds one fleet's
# certificates and keys (about 1 KB a device); compose uses the same split
FLEET_DEVICES=400

# fleet_ranges N F: "first count" of each of F fleets over N devices (consecutive ranges, as `shuffledp run` splits)
fleet_ranges() {
  local n=$1 f=$2 size first
  size=$(( (n + f - 1) / f ))
  for ((first = 0; first < n; first += size)); do echo "$first $(( first + size <= n ? size : n - first ))"; done
}

# default_fleets N: fleet containers for N devices: 2 (as a local run), more past FLEET_DEVICES each, at most N
default_fleets() {
  local f=$(( ($1 + FLEET_DEVICES - 1) / FLEET_DEVICES ))
  (( f >= 2 )) || f=2
  (( f <= $1 )) || f=$1
  echo "$f"
}

# pki_revoke NAME...: `shuffledp pki revoke` in $PKI (it needs the CA key, so it runs where the PKI is: the host's CLI,
# else the image's as the caller); the CA-signed crl.pem is then published to the shuffler by the calling script
pki_revoke() {
  [[ $# -ge 1 ]] || die "usage: revoke NAME... (client-node names, e.g. client-7)"
  [[ -f $PKI/ca/ca.key ]] || die "$PKI has no CA key (ca/ca.key): revoke where the CA is"
  local cli
  cli="$(host_cli)"
  if [[ -n $cli ]]; then
    "$cli" pki revoke --pki "$PKI" "$@" >&2
  else
    ensure_image
    docker run --rm --user "$(id -u):$(id -g)" --network none --read-only -v "$PKI:/pki" --entrypoint shuffledp \
      "$IMAGE" pki revoke --pki /pki "$@" >&2
  fi
}

# The operator's shuffledp CLI on the host (the project's venv or PATH); empty if there is none.
host_cli() {
  if [[ -n ${SHUFFLEDP_CLI:-} ]]; then echo "$SHUFFLEDP_CLI"
  elif [[ -x $ROOT/.venv/bin/shuffledp ]]; then echo "$ROOT/.venv/bin/shuffledp"
  elif command -v shuffledp >/dev/null 2>&1; then command -v shuffledp
  fi
}

# the image, built offline when it is missing or with --build (its build figures go to stderr with the log)
ensure_image() {
  if [[ ${1:-} == --build ]] || ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "building $IMAGE (deploy/build_image.sh)"
    bash "$DEPLOY/build_image.sh" --tag "$IMAGE" >&2
  fi
}

# ensure_pki N FORCE FIX [OWNER]: the CA, analyzer, shuffler, operator and client-0..client-(N-1) certificates in
# $PKI. Made if there is no CA or FORCE is set (with OWNER: the services' keys owned by that uid), else checked;
# FIX is what to run after "$0 " when some are missing.
ensure_pki() {
  local want=$1 force=$2 fix=$3 owner=${4:-} name i
  if [[ -z $force && -f $PKI/ca.crt ]]; then
    for name in analyzer shuffler operator; do
      [[ -f $PKI/$name/cert.pem && -f $PKI/$name/key.pem ]] || die "$PKI has no certificate for $name; run: $0 $fix"
    done
    for ((i = 0; i < want; i++)); do
      [[ -f $PKI/client-$i/cert.pem ]] ||
        die "$PKI has certificates for fewer than $want client nodes (no client-$i); run: $0 $fix"
    done
    return 0
  fi
  local cli args=(pki init --client-nodes "$want")
  [[ -z $owner ]] || args+=(--service-owner "$owner")
  [[ -z $force ]] || args+=(--force)
  cli="$(host_cli)"
  mkdir -p "$PKI"
  if [[ -n $cli && ( -z $owner || $(id -u) -eq 0 ) ]]; then
    log "creating the PKI in $PKI ($want client-node certificates)"
    "$cli" "${args[@]}" --out "$PKI" >/dev/null
    return 0
  fi
  ensure_image
  log "creating the PKI in $PKI ($want client-node certificates, in a container)"
  if [[ -z $owner ]]; then
    docker run --rm --user "$(id -u):$(id -g)" --network none --read-only -v "$PKI:/out" --entrypoint shuffledp \
      "$IMAGE" "${args[@]}" --out /out >/dev/null
  else
    # --service-owner needs root: as root in the container, then the CA and the operator certificate back to the
    # caller
    docker run --rm --user 0 --network none -v "$PKI:/out" --entrypoint sh "$IMAGE" -c \
      "shuffledp ${args[*]} --out /out >/dev/null && chown -R $(id -u):$(id -g) /out/ca /out/ca.crt /out/operator /out/pki.json"
  fi
}

# the `pki` command's one flag: prints "force" for --force
pki_flag() {
  case "${1:-}" in
    "") ;;
    --force) echo force ;;
    *) die "pki takes only --force" ;;
  esac
}

# parse_run [CONFIG] [--out DIR] [-- shuffledp-run options]: sets RUN_CONF (absolute), RUN_OUT ('' if not given) and
# RUN_ARGS
parse_run() {
  RUN_CONF=$CONFIG RUN_OUT=""
  if [[ $# -gt 0 && $1 != -* ]]; then [[ -f $1 ]] || die "configuration $1 not found"; RUN_CONF="$(abspath "$1")"; shift; fi
  if [[ ${1:-} == --out ]]; then RUN_OUT="${2:?--out needs a directory}"; shift 2; fi
  [[ ${1:-} == -- ]] && shift
  RUN_ARGS=("$@")
}

# parse_results RUN_ID [--out DIR]: sets RUN_ID, RUN_OUT (default results/RUN_ID) and RUN_FLAG (the CLI flag of $CMD)
parse_results() {
  RUN_ID="${1:?$CMD needs a RUN_ID (printed by run)}"; shift
  RUN_FLAG=--fetch; [[ $CMD != cancel ]] || RUN_FLAG=--cancel  # the operator CLI's flag for this command
  [[ $RUN_ID =~ ^[A-Za-z0-9_-]+$ ]] || die "RUN_ID '$RUN_ID' is not a run id"
  RUN_OUT="$ROOT/results/$RUN_ID"
  if [[ ${1:-} == --out ]]; then RUN_OUT="${2:?--out needs a directory}"; fi
}

# results_dir DIR CONF: DIR (or results/<CONF's name>-<time> if DIR is ''), created, as an absolute path
results_dir() {
  local dir="${1:-$ROOT/results/$(basename "$2" .toml)-$(date +%Y%m%d-%H%M%S)}"
  mkdir -p "$dir"
  abspath "$dir"
}

# operator_container NETWORK RESULTS CONF ARGS...: `shuffledp run ARGS...` as the operator, in a one-off container on
# NETWORK holding the operator certificate (which no service holds); results land in RESULTS on this host, and CONF
# ('' for none) is mounted as /etc/shuffledp/run.toml. Replaces this shell.
operator_container() {
  local network=$1 results=$2 conf=$3; shift 3
  [[ -f $PKI/operator/key.pem ]] || die "$PKI has no operator certificate (the deployment was made from another --pki?)"
  local mounts=(-v "$PKI/ca.crt:/pki/ca.crt:ro" -v "$PKI/operator:/pki/operator:ro" -v "$results:/results")
  [[ -z $conf ]] || mounts+=(-v "$conf:/etc/shuffledp/run.toml:ro")
  exec docker run --rm -i --network "$network" --read-only --tmpfs /tmp --cap-drop ALL \
    --security-opt no-new-privileges --user "$(id -u):$(id -g)" "${mounts[@]}" --entrypoint shuffledp "$IMAGE" \
    run "$@" --analyzer analyzer:50051 --pki /pki --out /results
}

# wait_for CHECK REPORT HINT PAUSE NAMES...: every PAUSE seconds `CHECK NAMES...`, which fills PENDING with what is
# not ready yet ("name:state"), until PENDING is empty. After $TIMEOUT s: REPORT NAMES... (details, to stderr), then
# die with the pending ones and HINT.
wait_for() {
  local check=$1 report=$2 hint=$3 pause=$4 deadline=$((SECONDS + TIMEOUT))
  shift 4
  while :; do
    PENDING=()
    "$check" "$@"
    if [[ ${#PENDING[@]} -eq 0 ]]; then return 0; fi
    if (( SECONDS >= deadline )); then
      "$report" "$@" >&2 || true
      die "not ready after ${TIMEOUT} s: ${PENDING[*]} (see: $hint)"
    fi
    sleep "$pause"
  done
}
