#!/usr/bin/env bash
# The shuffledp docker deployment in one command (deploy/docker-compose.yml).
#
# Usage: deploy/compose.sh [options] COMMAND [args]
#   up [--build]           create the PKI and the image if missing, start everything, wait until all are healthy
#   run [CONFIG] [--out DIR] [-- shuffledp-run options]
#                          run an experiment on the deployment as the operator (mTLS, operator certificate);
#                          progress per round, then a results directory (default results/<name>-<time>)
#   results RUN_ID [--out DIR]   fetch a run's results again (RUN_ID: "run_id" in its results' ledger.json)
#   cancel RUN_ID [--out DIR]    cancel a run (one whose `run` was lost) and fetch what it has; a run that ended
#                          already is left as it is
#   status                 containers and their health
#   logs [SERVICE...]      follow the logs (all services by default)
#   down [--volumes]       stop and remove the containers (--volumes: also the ledger and shuffler state)
#   pki [--force]          create (or replace) the PKI only
#   revoke NAME...         revoke client-node (device) certificates: `shuffledp pki revoke` in the PKI, then its
#                          CA-signed crl.pem published to the running shuffler, which refuses them from their next
#                          call on (a device already connected keeps its stream until it reconnects)
#   compose ARGS...        any other docker compose command with this deployment's files and settings
# Options (or environment):
#   --project NAME   (SHUFFLEDP_PROJECT, default shuffledp)  compose project name; several can run side by side
#   --config FILE    (SHUFFLEDP_CONFIG, default deploy/example.toml)  the ONE mounted run configuration
#   --pki DIR        (SHUFFLEDP_PKI, default deploy/pki)
#   --port PORT      (SHUFFLEDP_ANALYZER_PORT, default 50051)  analyzer port on the host's 127.0.0.1
#   --image NAME     (SHUFFLEDP_IMAGE, default shuffledp:latest)
#   --clients N      (SHUFFLEDP_CLIENT_NODES) client-node containers; default: [deployment] client_nodes of CONFIG
#   --fleets F       (SHUFFLEDP_FLEETS) devices: with [deployment] users_per_node = 1 in CONFIG the client nodes are
#                    single-user device nodes, run by F fleet containers (fleet-0.., `shuffledp serve fleet`, each
#                    a consecutive range of devices with their own certificates) instead of a container per node;
#                    default 2, or one per 400 devices
#   --timeout S      (SHUFFLEDP_UP_TIMEOUT, default 180)  seconds `up` waits for healthy containers
#   SHUFFLEDP_COMPOSE_FILES  extra compose files (':'-separated) layered on top, e.g. resource limits
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/_common.sh" pki 180
PROJECT="${SHUFFLEDP_PROJECT:-shuffledp}"
PORT="${SHUFFLEDP_ANALYZER_PORT:-50051}"
SERVICE_UID=10001  # the image's user (deploy/Dockerfile)

own_option() {
  case "$1" in
    --project) PROJECT="${2:?--project needs a name}" ;;
    --port) PORT="${2:?--port needs a number}" ;;
    *) return 1 ;;
  esac
}
parse_options "$@"
set -- "${ARGS[@]}"

# compose project names become network and volume prefixes: keep them to what both compose versions accept
[[ $PROJECT =~ ^[a-z0-9][a-z0-9_-]*$ ]] || die "--project '$PROJECT' must match [a-z0-9][a-z0-9_-]*"
{ [[ $PORT =~ ^[0-9]+$ ]] && (( PORT >= 1 && PORT <= 65535 )); } || die "--port '$PORT' must be 1..65535"

# the number of client nodes: [deployment] client_nodes of the configuration (the analyzer waits for that many)
FROM_CONFIG="$(config_clients "$CONFIG")"
if [[ -z $CLIENTS ]]; then
  CLIENTS="$FROM_CONFIG"
elif [[ $CLIENTS != "$FROM_CONFIG" ]]; then
  die "--clients $CLIENTS but $CONFIG has [deployment] client_nodes = $FROM_CONFIG; they must agree"
fi
DEVICES=""
if config_devices "$CONFIG"; then
  DEVICES=1
  check_count "$CLIENTS" 100000
  FLEETS="${FLEETS:-$(default_fleets "$CLIENTS")}"
  (( FLEETS <= CLIENTS )) || die "--fleets $FLEETS: more fleets than the $CLIENTS devices"
else
  check_count "$CLIENTS"
  [[ -z $FLEETS ]] || die "--fleets: $CONFIG does not ask for devices ([deployment] users_per_node = 1)"
fi

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
if [[ -n $DEVICES ]]; then
  # fleet-0 .. fleet-(F-1): each runs devices first..first+count-1 of the CLIENTS nodes, with those devices'
  # certificates only (<pki>/fleets/fleet-<j>, made by link_fleet_pki) and their users' spend on its own volume
  mkdir -p "$DEPLOY/.build"
  EXTRA="$DEPLOY/.build/fleets.$PROJECT.yml"
  {
    echo "# generated by deploy/compose.sh for $CLIENTS devices in $FLEETS fleets; do not edit"
    echo "services:"
    j=0
    while read -r first count; do
      cat <<EOF
  fleet-$j:
    image: \${SHUFFLEDP_IMAGE:-shuffledp:latest}
    restart: unless-stopped
    read_only: true
    tmpfs: [/tmp, /results]
    cap_drop: [ALL]
    security_opt: ["no-new-privileges:true"]
    stop_grace_period: 15s
    depends_on: [shuffler]
    networks: [client-net]
    command: [fleet, --pki=/pki, "--shuffler=shuffler:50052", --config=/etc/shuffledp/config.toml,
              --first-index=$first, --count=$count, --num-nodes=$CLIENTS, --state-dir=/var/lib/shuffledp/state,
              --port-file=/tmp/started]
    volumes:
      - \${SHUFFLEDP_PKI:-./pki}/fleets/fleet-$j:/pki:ro
      - \${SHUFFLEDP_CONFIG:-./example.toml}:/etc/shuffledp/config.toml:ro
      - fleet-$j-state:/var/lib/shuffledp
    healthcheck:
      # a fleet serves nothing: healthy once its devices started (certificates and data loaded, dialling)
      test: [CMD, test, -s, /tmp/started]
      interval: 5s
      timeout: 5s
      retries: 3
      start_period: 60s
EOF
      j=$((j + 1))
    done < <(fleet_ranges "$CLIENTS" "$FLEETS")
    echo "volumes:"
    for ((j = 0; j < FLEETS; j++)); do echo "  fleet-$j-state: {}"; done
  } >"$EXTRA"
  FILES+=(-f "$EXTRA")
elif (( CLIENTS > 2 )); then
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
      test: [CMD, python, -m, shuffledp.transport.health, "127.0.0.1:50053", --pki, /pki, --name, client-$i,
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
if [[ -n $DEVICES ]]; then
  for ((j = 0; j < FLEETS; j++)); do SERVICES+=("fleet-$j"); done
else
  for ((i = 0; i < CLIENTS; i++)); do SERVICES+=("client-$i"); done
fi

compose() { "${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}" "$@"; }
compose_ps() { compose ps "$@"; }

# certificates of every party; keys of the services owned by the image's uid (the containers run as that uid and
# must read their 0600 keys), the rest by the caller
compose_pki() {
  ensure_pki "$CLIENTS" "${1:-}" "--clients $CLIENTS pki --force" "$SERVICE_UID"
  local name owner
  for name in analyzer shuffler client-0; do
    owner="$(stat -c %u "$PKI/$name/key.pem")"
    [[ $owner == "$SERVICE_UID" ]] || die "$PKI/$name/key.pem is owned by uid $owner, not $SERVICE_UID (the \
containers' user): recreate it with $0 pki --force, or chown -R $SERVICE_UID $PKI/{analyzer,shuffler,client-*}"
  done
}

# The shuffler's revocation list: the PKI's crl.pem copied into <pki>/crl/ and renamed into place there. The shuffler
# mounts that directory (not the PKI's, which holds every party's key, nor the file, whose mount would keep the old
# inode) and reads the list again once it changed.
publish_crl() {
  mkdir -p "$PKI/crl"
  chmod 755 "$PKI/crl"
  [[ -f $PKI/crl.pem ]] || return 0
  cp "$PKI/crl.pem" "$PKI/crl/.crl.pem.tmp"
  chmod 644 "$PKI/crl/.crl.pem.tmp"
  mv -f "$PKI/crl/.crl.pem.tmp" "$PKI/crl/crl.pem"
}

# <pki>/fleets/fleet-<j>: ca.crt and the directories of fleet j's devices, their files hard-linked (the same files, no
# copy of a key), so that a fleet container mounts one directory holding its devices' keys and no other. Made anew
# at each up (a PKI changed by `pki init --force` or `pki issue`), then swapped in. The keys belong to the
# containers' uid, so only root may link them: here if this is root, else in a container as root.
link_fleet_pki() {
  # shellcheck disable=SC2016  # expanded by the script's shell
  local script='set -e
pki=$1; shift; new="$pki/.fleets.new"; j=0
rm -rf "$new"; mkdir -m 0755 "$new"
while [ $# -gt 0 ]; do
  d="$new/fleet-$j"; mkdir -m 0755 "$d"; ln "$pki/ca.crt" "$d/ca.crt"
  seq -f "$pki/client-%.0f" "$1" "$(($1 + $2 - 1))" | xargs cp -al -t "$d"
  j=$((j + 1)); shift 2
done
rm -rf "$pki/.fleets.old"; [ ! -e "$pki/fleets" ] || mv "$pki/fleets" "$pki/.fleets.old"
mv "$new" "$pki/fleets"; rm -rf "$pki/.fleets.old"'
  local ranges
  # shellcheck disable=SC2207  # numbers only
  ranges=($(fleet_ranges "$CLIENTS" "$FLEETS"))
  if [[ $(id -u) -eq 0 ]]; then
    sh -c "$script" sh "$PKI" "${ranges[@]}"
  else
    docker run --rm --user 0 --network none -v "$PKI:/pki" --entrypoint sh "$IMAGE" -c "$script" sh /pki "${ranges[@]}"
  fi
}

# compose's services whose containers are not running and healthy yet (a service whose healthcheck an override
# removed counts once it runs)
unhealthy() {
  local svc cid state
  for svc in "$@"; do
    # by label (both compose versions set them): much faster than a compose call per service
    cid="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
      --filter "label=com.docker.compose.service=$svc" | head -n 1)"
    state="$( [[ -n $cid ]] && docker inspect --format '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$cid" || echo missing)"
    [[ $state == running/healthy || $state == running/ ]] || PENDING+=("$svc:$state")
  done
}

case "$CMD" in
  up)
    case "${1:-}" in
      "") ensure_image ;;
      --build) ensure_image --build ;;
      *) die "up takes only --build (rebuild the image from the working tree)" ;;
    esac
    compose_pki
    publish_crl
    if [[ -n $DEVICES ]]; then
      link_fleet_pki
      compose rm -s -f client-0 client-1 >/dev/null 2>&1 || true  # of an earlier up with a container per node
      log "starting $PROJECT: shuffler, analyzer, $CLIENTS devices in $FLEETS fleets (compose: ${COMPOSE[*]})"
    else
      log "starting $PROJECT: ${SERVICES[*]} (compose: ${COMPOSE[*]})"
    fi
    compose up -d --remove-orphans "${SERVICES[@]}"
    wait_for unhealthy compose_ps "$0 --project $PROJECT logs" 2 "${SERVICES[@]}"
    log "all ${#SERVICES[@]} services healthy; analyzer on 127.0.0.1:$PORT"
    ;;
  run)
    parse_run "$@"
    cli="$(host_cli)"
    if [[ -n $cli ]]; then
      out=()
      [[ -z $RUN_OUT ]] || out=(--out "$RUN_OUT")
      exec "$cli" run "$RUN_CONF" --analyzer "127.0.0.1:$PORT" --pki "$PKI" "${out[@]}" "${RUN_ARGS[@]}"
    fi
    # no shuffledp on the host: the operator CLI from the image, on operator-net
    operator_container "${PROJECT}_operator-net" "$(results_dir "$RUN_OUT" "$RUN_CONF")" "$RUN_CONF" \
      /etc/shuffledp/run.toml "${RUN_ARGS[@]}"
    ;;
  results | cancel)
    parse_results "$@"
    cli="$(host_cli)"
    # prints "run RUN_ID: STATE, k/T rounds, eps spent ...; results in DIR"; exit 2: unknown run, 3: no analyzer
    [[ -z $cli ]] || exec "$cli" run --analyzer "127.0.0.1:$PORT" --pki "$PKI" "$RUN_FLAG" "$RUN_ID" --out "$RUN_OUT"
    operator_container "${PROJECT}_operator-net" "$(results_dir "$RUN_OUT")" "" "$RUN_FLAG" "$RUN_ID"
    ;;
  status) compose ps ;;
  logs) compose logs -f --tail=100 "$@" ;;
  down)
    if [[ ${1:-} == --volumes ]]; then compose down --volumes --remove-orphans; else compose down --remove-orphans; fi
    ;;
  pki)
    force="$(pki_flag "$@")"
    compose_pki "$force"
    ;;
  revoke)
    pki_revoke "$@"
    publish_crl
    log "published $PKI/crl.pem to the shuffler of $PROJECT: it refuses these certificates from their next call on"
    ;;
  compose) compose "$@" ;;
  *) die "unknown command '$CMD' (up, run, results, cancel, status, logs, down, pki, revoke, compose)" ;;
esac
