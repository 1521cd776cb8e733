#!/usr/bin/env bash
# The shuffledp docker deployment in one command (deploy/docker-compose.yml).
#
# Usage: deploy/compose.sh [options] COMMAND [args]
#   up [--build]           create the PKI and the image if missing, start everything, wait until all are healthy
#   run [CONFIG] [--out DIR] [-- shuffledp-run options]
#                          run an experiment on the deployment as the operator (mTLS, operator certificate);
#                          progress per round, then a results directory (default results/<name>-<time>)
#   results RUN_ID [--out DIR]   fetch a run's results again (RUN_ID: "run_id" in its results' ledger.json)
#   status                 containers and their health
#   logs [SERVICE...]      follow the logs (all services by default)
#   down [--volumes]       stop and remove the containers (--volumes: also the ledger and shuffler state)
#   pki [--force]          create (or replace) the PKI only
#   compose ARGS...        any other docker compose command with this deployment's files and settings
# Options (or environment):
#   --project NAME   (SHUFFLEDP_PROJECT, default shuffledp)  compose project name; several can run side by side
#   --config FILE    (SHUFFLEDP_CONFIG, default deploy/example.toml)  the ONE mounted run configuration
#   --pki DIR        (SHUFFLEDP_PKI, default deploy/pki)
#   --port PORT      (SHUFFLEDP_ANALYZER_PORT, default 50051)  analyzer port on the host's 127.0.0.1
#   --image NAME     (SHUFFLEDP_IMAGE, default shuffledp:latest)
#   --clients N      (SHUFFLEDP_CLIENT_NODES) client-node containers; default: [deployment] client_nodes of CONFIG
#   --timeout S      (SHUFFLEDP_UP_TIMEOUT, default 180)  seconds `up` waits for healthy containers
#   SHUFFLEDP_COMPOSE_FILES  extra compose files (':'-separated) layered on top, e.g. resource limits
set -euo pipefail

DEPLOY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$DEPLOY/.." && pwd)"
PROJECT="${SHUFFLEDP_PROJECT:-shuffledp}"
CONFIG="${SHUFFLEDP_CONFIG:-$DEPLOY/example.toml}"
PKI="${SHUFFLEDP_PKI:-$DEPLOY/pki}"
PORT="${SHUFFLEDP_ANALYZER_PORT:-50051}"
IMAGE="${SHUFFLEDP_IMAGE:-shuffledp:latest}"
CLIENTS="${SHUFFLEDP_CLIENT_NODES:-}"
TIMEOUT="${SHUFFLEDP_UP_TIMEOUT:-180}"
SERVICE_UID=10001  # the image's user (deploy/Dockerfile)

die() { echo "compose.sh: $*" >&2; exit 1; }
log() { echo "[compose] $*" >&2; }
usage() { sed -n '2,25p' "$0"; }

abspath() { (cd "$(dirname "$1")" && echo "$(pwd)/$(basename "$1")"); }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --project) PROJECT="${2:?--project needs a name}"; shift 2 ;;
    --config) CONFIG="${2:?--config needs a file}"; shift 2 ;;
    --pki) PKI="${2:?--pki needs a directory}"; shift 2 ;;
    --port) PORT="${2:?--port needs a number}"; shift 2 ;;
    --image) IMAGE="${2:?--image needs a name}"; shift 2 ;;
    --clients) CLIENTS="${2:?--clients needs a number}"; shift 2 ;;
    --timeout) TIMEOUT="${2:?--timeout needs seconds}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
CMD="$1"; shift

# compose project names become network and volume prefixes: keep them to what both compose versions accept
[[ $PROJECT =~ ^[a-z0-9][a-z0-9_-]*$ ]] || die "--project '$PROJECT' must match [a-z0-9][a-z0-9_-]*"
[[ $PORT =~ ^[0-9]+$ ]] && (( PORT >= 1 && PORT <= 65535 )) || die "--port '$PORT' must be 1..65535"
[[ -f $CONFIG ]] || die "configuration $CONFIG not found"
CONFIG="$(abspath "$CONFIG")"
mkdir -p "$(dirname "$PKI")"
PKI="$(abspath "$PKI")"

# the number of client nodes: [deployment] client_nodes of the configuration (the analyzer waits for that many)
config_clients() {
  awk '/^[[:space:]]*\[/ { sec = $0; gsub(/[][[:space:]]/, "", sec); next }
       sec == "deployment" && $1 == "client_nodes" { v = $0; sub(/^[^=]*=[[:space:]]*/, "", v); sub(/[[:space:]#].*$/, "", v); print v; exit }' "$CONFIG"
}
FROM_CONFIG="$(config_clients)"
FROM_CONFIG="${FROM_CONFIG:-2}"  # the configuration's default
if [[ -z $CLIENTS ]]; then
  CLIENTS="$FROM_CONFIG"
elif [[ $CLIENTS != "$FROM_CONFIG" ]]; then
  die "--clients $CLIENTS but $CONFIG has [deployment] client_nodes = $FROM_CONFIG; they must agree"
fi
[[ $CLIENTS =~ ^[0-9]+$ ]] && (( CLIENTS >= 1 && CLIENTS <= 1000 )) || die "client nodes '$CLIENTS' must be 1..1000"

# docker compose v2 plugin or the standalone docker-compose v1
if docker compose version >/dev/null 2>&1; then
  COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE=(docker-compose)
else
  die "neither 'docker compose' nor 'docker-compose' found; install one of them"
fi

export SHUFFLEDP_PKI="$PKI" SHUFFLEDP_CONFIG="$CONFIG" SHUFFLEDP_ANALYZER_PORT="$PORT" SHUFFLEDP_IMAGE="$IMAGE" \
  SHUFFLEDP_CLIENT_NODES="$CLIENTS"

# client-2 .. client-(N-1): an override file in the shape of client-0 (YAML anchors cannot cross files)
FILES=(-f "$DEPLOY/docker-compose.yml")
if (( CLIENTS > 2 )); then
  mkdir -p "$DEPLOY/.build"
  EXTRA="$DEPLOY/.build/clients.$PROJECT.yml"
  {
    echo "# generated by deploy/compose.sh for $CLIENTS client nodes; do not edit"
    echo "services:"
    for ((i = 2; i < CLIENTS; i++)); do
      cat <<EOF
  client-$i:
    image: \${SHUFFLEDP_IMAGE:-shuffledp:latest}
    restart: unless-stopped
    read_only: true
    tmpfs: [/tmp, /results]
    cap_drop: [ALL]
    security_opt: ["no-new-privileges:true"]
    stop_grace_period: 15s
    depends_on: [shuffler]
    networks: [client-net]
    command: [client, --listen=0.0.0.0:50053, --pki=/pki, --name=client-$i, "--shuffler=shuffler:50052",
              --config=/etc/shuffledp/config.toml, --node-index=$i, "--num-nodes=\${SHUFFLEDP_CLIENT_NODES:-2}",
              --state-dir=/var/lib/shuffledp/state]
    volumes:
      - \${SHUFFLEDP_PKI:-./pki}/ca.crt:/pki/ca.crt:ro
      - \${SHUFFLEDP_PKI:-./pki}/client-$i:/pki/client-$i:ro
      - \${SHUFFLEDP_CONFIG:-./example.toml}:/etc/shuffledp/config.toml:ro
      - client-$i-state:/var/lib/shuffledp
    healthcheck:
      test: [CMD, python, -m, shuffledp.health, "127.0.0.1:50053", --pki, /pki, --name, client-$i,
             --service, shuffledp.v1.ClientNode]
      interval: 10s
      timeout: 8s
      retries: 3
      start_period: 30s
EOF
    done
    echo "volumes:"
    for ((i = 2; i < CLIENTS; i++)); do echo "  client-$i-state: {}"; done
  } >"$EXTRA"
  FILES+=(-f "$EXTRA")
fi
if [[ -n ${SHUFFLEDP_COMPOSE_FILES:-} ]]; then
  IFS=: read -r -a extra_files <<<"$SHUFFLEDP_COMPOSE_FILES"
  for f in "${extra_files[@]}"; do
    [[ -f $f ]] || die "SHUFFLEDP_COMPOSE_FILES: $f not found"
    FILES+=(-f "$(abspath "$f")")
  done
fi
SERVICES=(shuffler analyzer)
for ((i = 0; i < CLIENTS; i++)); do SERVICES+=("client-$i"); done

compose() { "${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" "$@"; }

# The operator's shuffledp CLI on the host (the project's venv or PATH); empty if there is none.
host_cli() {
  if [[ -n ${SHUFFLEDP_CLI:-} ]]; then echo "$SHUFFLEDP_CLI"
  elif [[ -x $ROOT/.venv/bin/shuffledp ]]; then echo "$ROOT/.venv/bin/shuffledp"
  elif command -v shuffledp >/dev/null 2>&1; then command -v shuffledp
  fi
}

ensure_image() {
  if [[ ${1:-} == --build ]] || ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "building $IMAGE (deploy/build_image.sh)"
    bash "$DEPLOY/build_image.sh" --tag "$IMAGE"
  fi
}

# certificates of every party; keys of the services owned by the image's uid, the rest by the caller
ensure_pki() {
  local force=${1:-}
  if [[ -z $force && -f $PKI/ca.crt ]]; then
    local i
    for name in analyzer shuffler operator; do
      [[ -f $PKI/$name/cert.pem ]] || die "$PKI has no certificate for $name; run: $0 pki --force"
    done
    for ((i = 0; i < CLIENTS; i++)); do
      [[ -f $PKI/client-$i/cert.pem ]] || die "$PKI has no certificate for client-$i; run: $0 --clients $CLIENTS pki --force"
    done
    # the containers run as uid $SERVICE_UID and must read their 0600 keys
    local owner
    for name in analyzer shuffler client-0; do
      owner="$(stat -c %u "$PKI/$name/key.pem")"
      [[ $owner == "$SERVICE_UID" ]] || die "$PKI/$name/key.pem is owned by uid $owner, not $SERVICE_UID (the \
containers' user): recreate it with $0 pki --force, or chown -R $SERVICE_UID $PKI/{analyzer,shuffler,client-*}"
    done
    return 0
  fi
  local cli args=(pki init --client-nodes "$CLIENTS" --service-owner "$SERVICE_UID" ${force:+--force})
  cli="$(host_cli)"
  if [[ -n $cli && $(id -u) -eq 0 ]]; then
    log "creating the PKI in $PKI"
    "$cli" "${args[@]}" --out "$PKI" >/dev/null
  else
    # --service-owner needs root: make it inside a container of the image, then give the CA and the operator
    # certificate back to the caller
    ensure_image
    log "creating the PKI in $PKI (in a container)"
    mkdir -p "$PKI"
    docker run --rm --user 0 --network none -v "$PKI:/out" --entrypoint sh "$IMAGE" -c \
      "shuffledp ${args[*]} --out /out >/dev/null && chown -R $(id -u):$(id -g) /out/ca /out/ca.crt /out/operator /out/pki.json"
  fi
}

wait_healthy() {
  local deadline=$((SECONDS + TIMEOUT)) svc cid state pending
  while :; do
    pending=()
    for svc in "${SERVICES[@]}"; do
      # by label (both compose versions set them): much faster than a compose call per service
      cid="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$svc" | head -n 1)"
      state="$( [[ -n $cid ]] && docker inspect --format '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$cid" || echo missing)"
      # running and healthy; a service whose healthcheck an override removed counts once it runs
      [[ $state == running/healthy || $state == running/ ]] || pending+=("$svc:$state")
    done
    if [[ ${#pending[@]} -eq 0 ]]; then
      log "all ${#SERVICES[@]} services healthy; analyzer on 127.0.0.1:$PORT"
      return 0
    fi
    if (( SECONDS >= deadline )); then
      compose ps >&2 || true
      die "not healthy after ${TIMEOUT} s: ${pending[*]} (see: $0 --project $PROJECT logs)"
    fi
    sleep 2
  done
}

case "$CMD" in
  up)
    case "${1:-}" in
      "") ensure_image ;;
      --build) ensure_image --build ;;
      *) die "up takes only --build (rebuild the image from the working tree)" ;;
    esac
    ensure_pki
    log "starting $PROJECT: ${SERVICES[*]} (compose: ${COMPOSE[*]})"
    compose up -d --remove-orphans "${SERVICES[@]}"
    wait_healthy
    ;;
  run)
    CONF="$CONFIG"
    if [[ $# -gt 0 && $1 != -* ]]; then CONF="$(abspath "$1")"; shift; fi
    OUT=()
    if [[ ${1:-} == --out ]]; then OUT=(--out "${2:?--out needs a directory}"); shift 2; fi
    [[ ${1:-} == -- ]] && shift
    cli="$(host_cli)"
    if [[ -n $cli ]]; then
      exec "$cli" run "$CONF" --analyzer "127.0.0.1:$PORT" --pki "$PKI" "${OUT[@]}" "$@"
    fi
    # no shuffledp on the host: the operator CLI from the image, on operator-net, with the operator certificate
    RESULTS="${OUT[1]:-$ROOT/results/$(basename "$CONF" .toml)-$(date +%Y%m%d-%H%M%S)}"
    mkdir -p "$RESULTS"
    RESULTS="$(abspath "$RESULTS")"
    exec docker run --rm -i --user "$(id -u):$(id -g)" --network "${PROJECT}_operator-net" \
      -v "$PKI/ca.crt:/pki/ca.crt:ro" -v "$PKI/operator:/pki/operator:ro" -v "$CONF:/etc/shuffledp/run.toml:ro" \
      -v "$RESULTS:/results" --entrypoint shuffledp "$IMAGE" \
      run /etc/shuffledp/run.toml --analyzer analyzer:50051 --pki /pki --out /results "$@"
    ;;
  results)
    RUN_ID="${1:?results needs a RUN_ID (printed by run)}"; shift
    OUTDIR="$ROOT/results/$RUN_ID"
    if [[ ${1:-} == --out ]]; then OUTDIR="${2:?--out needs a directory}"; fi
    cli="$(host_cli)"
    [[ -n $cli ]] || die "results needs the shuffledp CLI on the host (pip install the project)"
    # prints "run RUN_ID: STATE, k/T rounds, eps spent ...; results in DIR"; exit 2: unknown run, 3: no analyzer
    exec "$cli" run --analyzer "127.0.0.1:$PORT" --pki "$PKI" --fetch "$RUN_ID" --out "$OUTDIR"
    ;;
  status) compose ps ;;
  logs) compose logs -f --tail=100 "$@" ;;
  down)
    if [[ ${1:-} == --volumes ]]; then compose down --volumes --remove-orphans; else compose down --remove-orphans; fi
    ;;
  pki)
    case "${1:-}" in
      "") ensure_pki ;;
      --force) ensure_pki force ;;
      *) die "pki takes only --force" ;;
    esac
    ;;
  compose) compose "$@" ;;
  *) die "unknown command '$CMD' (up, run, results, status, logs, down, pki, compose)" ;;
esac
