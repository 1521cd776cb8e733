#!/usr/bin/env bash
# shuffledp as a Docker Swarm stack (deploy/stack.yml): one host for a try-out, many for real populations.
#
# Usage: deploy/swarm.sh [options] COMMAND [args]
#   init [--advertise-addr ADDR]  create a swarm on this engine if there is none (default address 127.0.0.1: this
#                          host only; give an address the other hosts can reach to add them later), and label
#                          this host with every role
#   label HOST ROLES       give HOST exactly these roles: a comma-separated list of analyzer, shuffler, clients, or
#                          `all` or `none` (node labels shuffledp.role.<role>=true; HOST: a node name or ID,
#                          `self` for this one). Only one host at a time may hold analyzer, and only one shuffler
#                          (their state volumes live there)
#   up [--build] [--new-state] [--monitoring [--monitoring-port P]]
#                          build the image if it is missing, create the PKI if it is missing, prepare the state
#                          volumes on the labelled hosts, deploy the stack with the keys as secrets, and wait until
#                          every task is healthy. --new-state: the analyzer or shuffler role moved to another host
#                          on purpose, so start an empty state there (the old host's ledger is then not used).
#                          --monitoring: every service serves Prometheus metrics (deploy/monitoring/stack.yml) and a
#                          Prometheus container on this host scrapes them, on http://127.0.0.1:P (default 9090)
#   run [CONFIG] [--out DIR] [-- shuffledp-run options]
#                          drive an experiment as the operator: `shuffledp run` in a one-off container on
#                          operator-net, with the operator certificate. Shows progress per round, then a results
#                          directory (default results/<name>-<time>)
#   results RUN_ID [--out DIR]   fetch a run's results again (RUN_ID: printed by run)
#   cancel RUN_ID [--out DIR]    cancel a run (one whose `run` was lost) and fetch what it has; a run that ended
#                          already is left as it is
#   ship HOST...           copy the image (--image) from this engine to each HOST without a registry: docker save
#                          once, docker load on every HOST in parallel, then check that each has the same image ID.
#                          HOST: an ssh destination (user@host: Docker's own ssh transport, which needs the docker
#                          CLI and access to the engine there) or a Docker host URL (ssh://, tcp://, unix://)
#   scale N                client-node replicas (1..max client nodes; new replicas get the next task slots)
#   status                 hosts and their roles, services, tasks (with the error of any failed task)
#   logs SERVICE           follow one service's log (analyzer, shuffler, clients)
#   down [--volumes]       remove the stack, its secrets, configs and networks. --volumes: also the state
#                          volumes on this host (the ledger too) and the state records
#   pki [--force]          create (or replace) the PKI only
#   revoke NAME...         revoke client-node (device) certificates: `shuffledp pki revoke` in the PKI, then its
#                          CA-signed crl.pem published into the shuffler's state volume on its host, where the
#                          running shuffler reads it: it refuses them from their next call on (a device already
#                          connected keeps its stream until it reconnects)
# Devices: with [deployment] users_per_node = 1 in CONFIG the client nodes are single-user device nodes, run by
# services fleet-0..fleet-(F-1) (`shuffledp serve fleet`, a consecutive range of devices each, on the hosts with
# the clients role) instead of client-node replicas; `scale` does not apply (the devices are client_nodes).
# Options (or environment):
#   --stack NAME       (SHUFFLEDP_STACK, default shuffledp)  stack name; several can run side by side
#   --config FILE      (SHUFFLEDP_CONFIG, default deploy/example.toml)  the client nodes read its [data] section
#   --pki DIR          (SHUFFLEDP_PKI, default deploy/swarm/pki)  CA, service and operator certificates
#   --image NAME       (SHUFFLEDP_IMAGE, default shuffledp:latest)  loaded on every host (there is no registry)
#   --clients N        (SHUFFLEDP_CLIENT_NODES) client-node replicas at `up`; default: [deployment] client_nodes
#                      of CONFIG (or the running stack's count)
#   --fleets F         (SHUFFLEDP_FLEETS) devices: fleet services (default 2, or one per 400 devices: each fleet's
#                      certificates and keys are one Swarm secret, at most 500 KB)
#   --max-clients S    (SHUFFLEDP_MAX_CLIENT_NODES) how far `scale` can go: the users are split into S data
#                      shards, and certificates client-0..client-(S-1) exist. Fixed while the stack runs.
#                      Default: the running stack's value, else N
#   --timeout S        (SHUFFLEDP_UP_TIMEOUT, default 240)  seconds up and scale wait for healthy tasks
#   --per-host N       (SHUFFLEDP_CLIENTS_PER_HOST, default 0: no limit) at most N client replicas on one host, so
#                      the replicas of a host that goes away wait for it (and their users' spend records on it)
#                      instead of starting on another host with empty ones
#   --plain-overlays   (SHUFFLEDP_PLAIN_OVERLAYS=1) overlays without Docker's IPsec encryption, for hosts whose
#                      kernel has no ESP (the encrypted overlays then carry nothing between hosts); mTLS still
#                      protects every hop. Fixed while the stack runs
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/_common.sh" swarm/pki 240
STACK="${SHUFFLEDP_STACK:-shuffledp}"
MAX_CLIENTS="${SHUFFLEDP_MAX_CLIENT_NODES:-}"
PER_HOST="${SHUFFLEDP_CLIENTS_PER_HOST:-0}"
PLAIN="${SHUFFLEDP_PLAIN_OVERLAYS:-}"
SERVICES=(analyzer shuffler clients)
STATEFUL=(analyzer shuffler)
MARKER=.shuffledp-state  # in the analyzer's and the shuffler's state volume (deploy/stack.yml)
DEVICES=""  # [deployment] users_per_node = 1: the client nodes are devices, run by fleet services
DEVICE_NODES=0

own_option() {
  case "$1" in
    --stack) STACK="${2:?--stack needs a name}" ;;
    --max-clients) MAX_CLIENTS="${2:?--max-clients needs a number}" ;;
    --per-host) PER_HOST="${2:?--per-host needs a number}" ;;
    --plain-overlays) PLAIN=1; return 2 ;;
    *) return 1 ;;
  esac
}
parse_options "$@"
set -- "${ARGS[@]}"
if config_devices "$CONFIG"; then DEVICES=1; fi

# stack names prefix services, networks, volumes, secrets and node labels
[[ $STACK =~ ^[a-z0-9][a-z0-9_-]{0,30}$ ]] || die "--stack '$STACK' must match [a-z0-9][a-z0-9_-]* (at most 31 characters)"
[[ -z $MAX_CLIENTS ]] || check_count "$MAX_CLIENTS"
[[ $PER_HOST =~ ^[0-9]+$ ]] || die "--per-host '$PER_HOST' must be a number (0: no limit)"

command -v docker >/dev/null 2>&1 || die "the docker CLI is not installed"
docker info >/dev/null 2>&1 || die "no Docker engine reachable (docker info failed)"

# ----------------------------------------------------------------------------------------------------- helpers
swarm_state() { docker info --format '{{.Swarm.LocalNodeState}}'; }

require_manager() {
  [[ $(swarm_state) == active ]] || die "this engine is not in a swarm: run '$0 init' (one-host try-out) or join one"
  [[ $(docker info --format '{{.Swarm.ControlAvailable}}') == true ]] ||
    die "this host is a swarm worker: run swarm.sh on a manager (docker node ls there)"
}

service_exists() { docker service inspect "${STACK}_$1" >/dev/null 2>&1; }

# an environment variable of the running clients service ('' if there is none)
clients_env() {
  service_exists clients || return 0
  docker service inspect --format '{{range .Spec.TaskTemplate.ContainerSpec.Env}}{{println .}}{{end}}' \
    "${STACK}_clients" | sed -n "s/^$1=//p"
}

# IDs of the nodes labelled with a role
role_nodes() { docker node ls -q --filter "node.label=shuffledp.role.$1=true"; }

node_name() { docker node inspect --format '{{.Description.Hostname}}' "$1"; }

# the host that holds the prepared state of a stateful role (node label written by up), '' if none
state_label() { echo "shuffledp.state.${STACK}.$1"; }
state_node() { docker node ls -q --filter "node.label=$(state_label "$1")" | head -n 1; }

# CA, analyzer, shuffler, client-0..client-(S-1) and operator certificates (keys readable by the caller only)
swarm_pki() {
  ensure_pki "$1" "${2:-}" "--max-clients $1 pki --force (and down first if the stack runs)"
}

# The secret files deploy/stack.yml reads: the CA certificate, each service's own certificate and key, and for the
# client nodes two golang templates that Swarm renders per task, so that the replica in slot s receives only
# client-(s-1)'s certificate and key.
write_secrets() {
  local dir=$1 max=$2 i kind
  cp "$PKI/ca.crt" "$dir/ca.crt"
  for p in analyzer shuffler; do
    cp "$PKI/$p/cert.pem" "$dir/$p.crt"
    cp "$PKI/$p/key.pem" "$dir/$p.key"
  done
  if [[ -n $DEVICES ]]; then
    # no client-node replica runs: the templates hold no key (a secret cannot be empty)
    for kind in crt key; do echo "device deployment: no client-node replicas" >"$dir/clients.$kind.tmpl"; done
    write_fleets "$dir"
    chmod 600 "$dir"/*
    return 0
  fi
  for kind in crt key; do
    local file=cert.pem
    [[ $kind == key ]] && file=key.pem
    {
      for ((i = 0; i < max; i++)); do
        if grep -q '{{' "$PKI/client-$i/$file"; then die "$PKI/client-$i/$file is not a PEM file"; fi
        if ((i == 0)); then printf '{{if eq .Task.Slot "%d"}}' 1; else printf '{{else if eq .Task.Slot "%d"}}' $((i + 1)); fi
        cat "$PKI/client-$i/$file"
      done
      printf '{{end}}'
    } >"$dir/clients.$kind.tmpl"
  done
  chmod 600 "$dir"/*
}

# Devices: $dir/fleet-<j>.pem, the certificates and keys of fleet j's devices ("# client-<i>", cert.pem, key.pem each;
# the fleet's entrypoint splits it into a PKI directory in its /tmp), and $dir/fleets.yml, the stack file of the fleet
# services, each with its own secret: a fleet holds its devices' keys and no other.
write_fleets() {
  local dir=$1 j=0 first count i bundle size
  {
    echo 'version: "3.8"'
    echo "services:"
    while read -r first count; do
      cat <<EOF
  fleet-$j:
    image: \${SHUFFLEDP_IMAGE:-shuffledp:latest}
    read_only: true
    cap_drop: [ALL]
    stop_grace_period: 15s
    entrypoint: [/bin/sh, -c, "eval \"\$\$SHUFFLEDP_FLEET_ENTRYPOINT\"", fleet]
    command: [--first-index=$first, --count=$count, --num-nodes=$DEVICE_NODES]
    environment:
      SHUFFLEDP_FLEET_ENTRYPOINT: |
        python -c "\$\$SHUFFLEDP_SPLIT" /pki/devices.pem /tmp/pki && ln -sfn /pki/ca.crt /tmp/pki/ca.crt &&
        exec shuffledp serve fleet --pki=/tmp/pki --shuffler=shuffler:50052 --config=/etc/shuffledp/config.toml \\
          --state-dir=/var/lib/shuffledp/state --port-file=/tmp/started "\$\$@"
      SHUFFLEDP_SPLIT: |
        import os, re, sys
        text, out = open(sys.argv[1]).read(), sys.argv[2]
        pem = r"(-----BEGIN [A-Z ]+-----\n.*?-----END [A-Z ]+-----\n)"
        for name, cert, key in re.findall(r"^# (client-[0-9]+)\n" + pem + pem, text, re.S | re.M):
            os.makedirs(os.path.join(out, name), mode=0o700)
            for f, data, mode in (("cert.pem", cert, 0o644), ("key.pem", key, 0o600)):
                fd = os.open(os.path.join(out, name, f), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
                os.write(fd, data.encode())
                os.close(fd)
    secrets:
      - {source: ca-crt, target: /pki/ca.crt, mode: 0444}
      - {source: fleet-$j, target: /pki/devices.pem, uid: "10001", gid: "10001", mode: 0400}
    configs:
      - {source: run-config, target: /etc/shuffledp/config.toml, mode: 0444}
    volumes:
      - {type: tmpfs, target: /tmp}
      - {type: tmpfs, target: /results}
      # what each of its devices' users spent
      - {type: volume, source: fleet-$j-state, target: /var/lib/shuffledp}
    networks: [client-net]
    healthcheck:
      # a fleet serves nothing: healthy once its devices started (certificates and data loaded, dialling)
      test: [CMD, test, -s, /tmp/started]
      interval: 5s
      timeout: 5s
      retries: 3
      start_period: 60s
    deploy:
      endpoint_mode: dnsrr
      replicas: 1
      placement:
        constraints: [node.labels.shuffledp.role.clients == true]
      restart_policy: {condition: any, delay: 2s}
      update_config: {parallelism: 1, order: stop-first, failure_action: rollback}
      rollback_config: {parallelism: 1, order: stop-first}
EOF
      bundle="$dir/fleet-$j.pem"
      for ((i = first; i < first + count; i++)); do
        printf '# client-%d\n%s\n%s\n' "$i" "$(<"$PKI/client-$i/cert.pem")" "$(<"$PKI/client-$i/key.pem")"
      done >"$bundle"
      size=$(stat -c %s "$bundle")
      (( size <= 500000 )) || die "fleet-$j's $count devices take $size bytes of certificates and keys, over Swarm's \
500 KB for a secret: more fleets (--fleets $(( FLEETS * (size / 500000 + 1) )))"
      j=$((j + 1))
    done < <(fleet_ranges "$DEVICE_NODES" "$FLEETS")
    echo "volumes:"
    for ((j = 0; j < FLEETS; j++)); do echo "  fleet-$j-state: {}"; done
    echo "secrets:"
    for ((j = 0; j < FLEETS; j++)); do echo "  fleet-$j: {file: \"$dir/fleet-$j.pem\"}"; done
  } >"$dir/fleets.yml"
}

# The shuffler's revocation list: the PKI's crl.pem written into the shuffler's state volume (crl/crl.pem) on its
# host, by a one-off service pinned there that receives the file as a config; renamed into place, so that the running
# shuffler, which reads it again once it changed, sees the whole new list. Needs the state volume (prepare_state).
publish_crl() {
  [[ -f $PKI/crl.pem ]] || return 0
  local node job="${STACK}_publish-crl" cfg state deadline=$((SECONDS + 120))
  node="$(state_node shuffler)"
  [[ -n $node ]] || die "stack $STACK has no shuffler state yet (run: $0 --stack $STACK up)"
  cfg="${STACK}_crl-$(sha256sum "$PKI/crl.pem" | cut -c1-12)"
  docker config inspect "$cfg" >/dev/null 2>&1 ||
    docker config create --label "com.docker.stack.namespace=$STACK" "$cfg" "$PKI/crl.pem" >/dev/null
  docker service rm "$job" >/dev/null 2>&1 || true
  # shellcheck disable=SC2016  # expanded by the job's shell
  docker service create --quiet --detach --no-resolve-image --name "$job" --replicas 1 --restart-condition none \
    --label "org.shuffledp.stack=$STACK" --constraint "node.id == $node" --read-only --no-healthcheck \
    --mount "type=volume,source=${STACK}_shuffler-state,target=/var/lib/shuffledp,volume-label=com.docker.stack.namespace=$STACK" \
    --mount "type=tmpfs,target=/results" --config "source=$cfg,target=/crl.pem,mode=0444" \
    --entrypoint /bin/sh "$IMAGE" -c 'd=/var/lib/shuffledp/crl; mkdir -p "$d" && cp /crl.pem "$d/.crl.pem.tmp" &&
mv -f "$d/.crl.pem.tmp" "$d/crl.pem" && echo "published crl.pem ($(wc -c <"$d/crl.pem") bytes)"' >/dev/null
  while :; do
    state="$(docker service ps --format '{{.CurrentState}}' "$job" 2>/dev/null | head -n 1)"
    case "$state" in
      Complete*) break ;;
      Failed*|Rejected*)
        docker service ps --no-trunc --format '{{.Error}}' "$job" >&2 || true
        docker service rm "$job" >/dev/null 2>&1 || true
        die "publishing crl.pem to the shuffler's host $(node_name "$node") failed" ;;
    esac
    if (( SECONDS >= deadline )); then
      docker service rm "$job" >/dev/null 2>&1 || true
      die "publishing crl.pem to the shuffler's host $(node_name "$node") did not finish in 120 s (task: ${state:-none})"
    fi
    sleep 0.5
  done
  log "shuffler: $(docker service logs --raw "$job" 2>/dev/null | tail -n 1)"
  docker service rm "$job" >/dev/null
  # the configs of earlier lists: no task uses them any more
  docker config ls --filter "label=com.docker.stack.namespace=$STACK" --format '{{.Name}}' | while read -r c; do
    [[ $c != "${STACK}_crl-"* || $c == "$cfg" ]] || docker config rm "$c" >/dev/null 2>&1 || true
  done
}

# Before the first deployment on a host, write the marker into the analyzer's (shuffler's) state volume there, by a
# one-off service pinned to that host (replicated, run once: a replicated-job would leave its container behind after
# `docker service rm` on Docker 20.10). The services refuse to start on a volume without the marker
# (deploy/stack.yml), so a task that Swarm reschedules onto another host never starts with an empty ledger. Only
# `up` prepares a volume, and it records the host in a node label; a role moved to another host needs --new-state.
prepare_state() {
  local new_state=$1 role node old job jobs=() script
  # shellcheck disable=SC2016  # expanded by the job's shell
  script='m=/var/lib/shuffledp/'"$MARKER"'
if [ -f "$m" ]; then echo "existing state: $(cat "$m")"; exit 0; fi
held=""; [ -d /var/lib/shuffledp/state ] && held=" (adopted a state directory that had no marker)"
printf "stack=%s role=%s host=%s prepared=%s\n" "$1" "$0" "$SHUFFLEDP_HOST" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$m"
echo "new state$held: $(cat "$m")"'
  for role in "${STATEFUL[@]}"; do
    node="$(role_nodes "$role")"
    old="$(state_node "$role")"
    if [[ -n $old && $old != "$node" ]]; then
      [[ $new_state == 1 ]] || die "the $role state of stack $STACK is on host $(node_name "$old"), but host \
$(node_name "$node") has the $role role: label $(node_name "$old") $role again, or pass up --new-state to start \
an empty state on $(node_name "$node") (what the old one recorded is then not used)"
      docker node update --label-rm "$(state_label "$role")" "$old" >/dev/null
    fi
    job="${STACK}_prepare-$role"
    docker service rm "$job" >/dev/null 2>&1 || true
    docker service create --quiet --detach --no-resolve-image --name "$job" --replicas 1 --restart-condition none \
      --label "org.shuffledp.stack=$STACK" --constraint "node.id == $node" --read-only --no-healthcheck \
      --mount "type=volume,source=${STACK}_${role}-state,target=/var/lib/shuffledp,volume-label=com.docker.stack.namespace=$STACK" \
      --mount "type=tmpfs,target=/results" --env "SHUFFLEDP_HOST={{.Node.Hostname}}" \
      --entrypoint /bin/sh "$IMAGE" -c "$script" "$role" "$STACK" >/dev/null
    jobs+=("$job")
  done
  local deadline=$((SECONDS + 120)) state
  for job in "${jobs[@]}"; do
    role="${job##*_prepare-}"
    while :; do
      state="$(docker service ps --format '{{.CurrentState}}' "$job" 2>/dev/null | head -n 1)"
      case "$state" in
        Complete*) break ;;
        Failed*|Rejected*)
          docker service ps --no-trunc --format '{{.Error}}' "$job" >&2 || true
          docker service rm "$job" >/dev/null 2>&1 || true
          die "preparing the $role state volume failed (is $IMAGE loaded on $(node_name "$(role_nodes "$role")")?)" ;;
      esac
      if (( SECONDS >= deadline )); then
        docker service rm "$job" >/dev/null 2>&1 || true
        die "preparing the $role state volume did not finish in 120 s (task: ${state:-none}); is $IMAGE loaded on \
$(node_name "$(role_nodes "$role")")? (docker save $IMAGE | ssh HOST docker load)"
      fi
      sleep 0.5
    done
    log "$role: $(docker service logs --raw "$job" 2>/dev/null | tail -n 1)"
    docker service rm "$job" >/dev/null
    docker node update --label-add "$(state_label "$role")=true" "$(role_nodes "$role")" >/dev/null
  done
}

check_roles() {
  local role nodes count
  for role in "${SERVICES[@]}"; do
    nodes="$(role_nodes "$role")"
    count=$(grep -c . <<<"$nodes" || true)
    (( count >= 1 )) || die "no host has the $role role: $0 label HOST $role (or '$0 label self all' on one host)"
    if [[ $role != clients ]] && (( count > 1 )); then
      die "$count hosts have the $role role; exactly one may (its state volume lives there): $0 label HOST none"
    fi
  done
}

# the services that do not run as many tasks as they should yet, each past its health check (Swarm reports a task
# with a health check as running only once it is healthy)
not_ready() {
  local svc want have
  for svc in "$@"; do
    want="$(docker service inspect --format '{{.Spec.Mode.Replicated.Replicas}}' "${STACK}_$svc" 2>/dev/null || echo "?")"
    have="$(docker service ps --filter desired-state=running --format '{{.CurrentState}}' "${STACK}_$svc" 2>/dev/null |
      grep -c '^Running' || true)"
    [[ $have == "$want" ]] || PENDING+=("$svc:$have/$want")
  done
}

tasks_report() {
  local svc
  for svc in "$@"; do
    docker service ps --no-trunc --format '  {{.Name}} on {{.Node}}: {{.CurrentState}} {{.Error}}' "${STACK}_$svc" || true
  done
}

wait_ready() {
  wait_for not_ready tasks_report "$0 --stack $STACK status; $0 --stack $STACK logs SERVICE" 1 "$@"
  log "ready: $(for svc in "$@"; do printf '%s ' "$svc:$(docker service inspect --format '{{.Spec.Mode.Replicated.Replicas}}' "${STACK}_$svc")"; done)"
}

config_name() { echo "${STACK}_config-$(sha256sum "$CONFIG" | cut -c1-12)"; }

# -------------------------------------------------------------------------------------------------- commands
cmd_init() {
  local addr=127.0.0.1
  case "${1:-}" in
    "") ;;
    --advertise-addr) addr="${2:?--advertise-addr needs an address}" ;;
    *) die "init takes only --advertise-addr ADDR" ;;
  esac
  case "$(swarm_state)" in
    inactive)
      docker swarm init --advertise-addr "$addr" >/dev/null
      log "created a swarm with this host as its manager (advertising $addr)" ;;
    active) log "this engine is in a swarm already; only labelling" ;;
    *) die "this engine's swarm state is '$(swarm_state)'; fix it first (docker info)" ;;
  esac
  cmd_label self all
  log "other hosts join with: $(docker swarm join-token worker 2>/dev/null | grep -o 'docker swarm join .*' || echo 'docker swarm join-token worker')"
}

cmd_label() {
  [[ $# -eq 2 ]] || die "usage: label HOST ROLES (ROLES: analyzer,shuffler,clients | all | none)"
  require_manager
  local host=$1 id want=() role other args=()
  [[ $host == self ]] && host="$(docker info --format '{{.Swarm.NodeID}}')"
  id="$(docker node inspect --format '{{.ID}}' "$host" 2>/dev/null)" || die "no swarm node '$1' (docker node ls)"
  case "$2" in
    all) want=("${SERVICES[@]}") ;;
    none) want=() ;;
    *) IFS=, read -r -a want <<<"$2"
       for role in "${want[@]}"; do
         [[ " ${SERVICES[*]} " == *" $role "* ]] || die "unknown role '$role' (analyzer, shuffler, clients, all, none)"
       done ;;
  esac
  for role in "${SERVICES[@]}"; do
    local has
    has="$(docker node inspect --format "{{index .Spec.Labels \"shuffledp.role.$role\"}}" "$id")"
    if [[ " ${want[*]} " == *" $role "* ]]; then
      if [[ $role != clients ]]; then
        for other in $(role_nodes "$role"); do
          [[ $other == "$id" ]] || die "host $(node_name "$other") has the $role role already, and only one host \
may (its state volume lives there): move it with '$0 label $(node_name "$other") none' first"
        done
      fi
      [[ $has == true ]] || args+=(--label-add "shuffledp.role.$role=true")
    elif [[ -n $has ]]; then
      args+=(--label-rm "shuffledp.role.$role")
    fi
  done
  [[ ${#args[@]} -eq 0 ]] || docker node update "${args[@]}" "$id" >/dev/null
  log "host $(node_name "$id"): roles ${want[*]:-none}"
}

# Prometheus of stack STACK (--monitoring): a container on this host, not a service, so that its port can be
# published on 127.0.0.1 only; it joins the stack's attachable metrics networks. Its data volume carries the
# stack's label (down --volumes removes it).
PROMETHEUS_IMAGE="${SHUFFLEDP_PROMETHEUS_IMAGE:-shuffledp-prometheus:latest}"
start_prometheus() {
  local port="$1" name="${STACK}-prometheus" net config
  docker image inspect "$PROMETHEUS_IMAGE" >/dev/null 2>&1 || bash "$DEPLOY/monitoring/build_prometheus.sh" --tag "$PROMETHEUS_IMAGE" >&2
  docker rm -f "$name" >/dev/null 2>&1 || true
  config="$(sed "s/STACK/$STACK/g" "$DEPLOY/monitoring/prometheus-swarm.yml")"
  docker volume create --label "com.docker.stack.namespace=$STACK" "${STACK}_prometheus-data" >/dev/null
  # the image's configuration is the compose deployment's: this one is written to /tmp (a read-only root)
  docker create --name "$name" --label "org.shuffledp.prometheus=$STACK" --read-only --cap-drop ALL \
    --security-opt no-new-privileges:true --restart unless-stopped --tmpfs /tmp \
    --mount "type=volume,src=${STACK}_prometheus-data,dst=/prometheus" -p "127.0.0.1:$port:9090" \
    -e "PROMETHEUS_CONFIG=$config" --entrypoint /bin/sh "$PROMETHEUS_IMAGE" -c \
    'printf "%s\n" "$PROMETHEUS_CONFIG" >/tmp/prometheus.yml && exec /usr/bin/prometheus --config.file=/tmp/prometheus.yml --storage.tsdb.path=/prometheus --web.listen-address=0.0.0.0:9090' >/dev/null
  for net in analyzer shuffler client; do docker network connect "${STACK}_metrics-$net-net" "$name"; done
  docker start "$name" >/dev/null
  log "Prometheus of stack $STACK: http://127.0.0.1:$port (container $name)"
}

cmd_up() {
  local build="" new_state=0 monitoring=0 prom_port=9090
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --build) build=--build ;;
      --new-state) new_state=1 ;;
      --monitoring) monitoring=1 ;;
      --monitoring-port)
        prom_port="${2:-}"; shift
        [[ $prom_port =~ ^[0-9]+$ ]] && (( prom_port >= 1 && prom_port <= 65535 )) || die "--monitoring-port '$prom_port' must be a port number"
        ;;
      *) die "up takes only --build, --new-state, --monitoring and --monitoring-port P" ;;
    esac
    shift
  done
  local stack_files=(-c "$DEPLOY/stack.yml")
  if (( monitoring )); then
    stack_files+=(-c "$DEPLOY/monitoring/stack.yml")
  else  # an earlier up --monitoring: its Prometheus would hold the networks that --prune removes now
    docker rm -f "${STACK}-prometheus" >/dev/null 2>&1 || true
  fi
  require_manager
  local running_max running_clients
  running_max="$(clients_env SHUFFLEDP_MAX_CLIENT_NODES)"
  running_clients="$(docker service inspect --format '{{.Spec.Mode.Replicated.Replicas}}' "${STACK}_clients" 2>/dev/null || true)"
  if [[ -n $DEVICES ]]; then
    # the devices are the configuration's client_nodes; no client-node replica runs
    local from_config
    from_config="$(config_clients "$CONFIG")"
    [[ -z $CLIENTS || $CLIENTS == "$from_config" ]] ||
      die "--clients $CLIENTS but $CONFIG has [deployment] client_nodes = $from_config devices; they must agree"
    DEVICE_NODES="$from_config"
    check_count "$DEVICE_NODES" 100000
    FLEETS="${FLEETS:-$(default_fleets "$DEVICE_NODES")}"
    (( FLEETS <= DEVICE_NODES )) || die "--fleets $FLEETS: more fleets than the $DEVICE_NODES devices"
    CLIENTS=0 MAX_CLIENTS="$DEVICE_NODES" running_max=""
  elif [[ -n $FLEETS ]]; then
    die "--fleets: $CONFIG does not ask for devices ([deployment] users_per_node = 1)"
  fi
  if [[ -z $CLIENTS ]]; then
    CLIENTS="${running_clients:-$(config_clients "$CONFIG")}"
    if ! [[ $CLIENTS =~ ^[0-9]+$ ]] || (( CLIENTS < 1 )); then
      die "[deployment] client_nodes '$CLIENTS' of $CONFIG must be >= 1"
    fi
  fi
  if [[ -n $running_max && -n $MAX_CLIENTS && $MAX_CLIENTS != "$running_max" ]]; then
    die "the running stack $STACK has --max-clients $running_max (its data shards and certificates); down first to change it"
  fi
  MAX_CLIENTS="${MAX_CLIENTS:-${running_max:-$CLIENTS}}"
  (( CLIENTS <= MAX_CLIENTS )) || die "--clients $CLIENTS exceeds --max-clients $MAX_CLIENTS"
  [[ -n $DEVICES ]] || check_count "$MAX_CLIENTS"
  ensure_image $build
  check_roles
  swarm_pki "$MAX_CLIENTS"
  prepare_state "$new_state"
  publish_crl

  local secrets
  secrets="$(mktemp -d /tmp/shuffledp-secrets.XXXXXX)"
  # shellcheck disable=SC2064  # the directory is fixed now
  trap "rm -rf '$secrets'" EXIT
  chmod 700 "$secrets"
  write_secrets "$secrets" "$MAX_CLIENTS"
  local cfg_name out i plain ready=("${SERVICES[@]}")
  if [[ -n $DEVICES ]]; then
    stack_files+=(-c "$secrets/fleets.yml")
    for ((i = 0; i < FLEETS; i++)); do ready+=("fleet-$i"); done
  fi
  if [[ -n $PLAIN ]]; then
    # the same stack files without `encrypted` on their overlays (every other line as is)
    for ((i = 1; i < ${#stack_files[@]}; i += 2)); do
      plain="$secrets/plain-$((i / 2))-$(basename "${stack_files[i]}")"
      grep -v '^    driver_opts: {encrypted: ""}$' "${stack_files[i]}" >"$plain"
      ! grep -q 'encrypted: ""' "$plain" || die "could not drop the encryption from ${stack_files[i]}"
      stack_files[i]="$plain"
    done
    log "overlays NOT encrypted by Docker (--plain-overlays): mTLS alone protects the traffic between hosts"
  fi
  cfg_name="$(config_name)"
  if [[ -n $DEVICES ]]; then
    log "deploying stack $STACK: analyzer, shuffler, $DEVICE_NODES devices in $FLEETS fleets; configuration $CONFIG"
  else
    log "deploying stack $STACK: analyzer, shuffler, $CLIENTS of at most $MAX_CLIENTS client nodes; configuration $CONFIG"
  fi
  # --resolve-image never: there is no registry; every host uses its own loaded copy of the image
  if ! out="$(SHUFFLEDP_STACK="$STACK" SHUFFLEDP_IMAGE="$IMAGE" SHUFFLEDP_SECRETS="$secrets" SHUFFLEDP_CONFIG="$CONFIG" \
    SHUFFLEDP_CONFIG_NAME="$cfg_name" SHUFFLEDP_CLIENT_NODES="$CLIENTS" SHUFFLEDP_MAX_CLIENT_NODES="$MAX_CLIENTS" \
    SHUFFLEDP_CLIENTS_PER_HOST="$PER_HOST" \
    docker stack deploy --detach=true --resolve-image never --prune "${stack_files[@]}" "$STACK" 2>&1)"; then
    echo "$out" >&2
    if grep -q "only updates to Labels are allowed" <<<"$out"; then
      die "the secrets of the running stack $STACK differ from $PKI (a new PKI?): '$0 --stack $STACK down' first"
    fi
    die "docker stack deploy failed (above)"
  fi
  rm -rf "$secrets"
  # configurations of earlier deployments that no task uses any more (immutable, so each content has its own)
  docker config ls --filter "label=com.docker.stack.namespace=$STACK" --format '{{.Name}}' | while read -r c; do
    [[ $c == "$cfg_name" ]] || docker config rm "$c" >/dev/null 2>&1 || true
  done
  wait_ready "${ready[@]}"
  (( monitoring == 0 )) || start_prometheus "$prom_port"
}

cmd_run() {
  parse_run "$@"
  local out
  service_exists analyzer || die "stack $STACK is not deployed (run: $0 --stack $STACK up)"
  out="$(results_dir "$RUN_OUT" "$RUN_CONF")"
  log "operator: $RUN_CONF on stack $STACK; results in $out"
  # operator-net: the analyzer publishes no port
  operator_container "${STACK}_operator-net" "$out" "$RUN_CONF" /etc/shuffledp/run.toml "${RUN_ARGS[@]}"
}

cmd_results() {
  parse_results "$@"
  service_exists analyzer || die "stack $STACK is not deployed (run: $0 --stack $STACK up)"
  operator_container "${STACK}_operator-net" "$(results_dir "$RUN_OUT")" "" "$RUN_FLAG" "$RUN_ID"
}

cmd_ship() {
  [[ $# -ge 1 ]] || die "usage: ship HOST... (user@host, or a Docker host URL: ssh://, tcp://, unix://)"
  local id tar host url pids=() hosts=() failed=() i
  id="$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null)" || die "no image $IMAGE here: build it first (up --build)"
  tar="$(mktemp "${TMPDIR:-/tmp}/shuffledp-image.XXXXXX")"
  trap 'rm -f "$tar"' EXIT
  log "saving $IMAGE ($id)"
  docker save -o "$tar" "$IMAGE"
  for host in "$@"; do
    url=$host; [[ $url == *://* ]] || url="ssh://$host"
    DOCKER_HOST="$url" docker load -q -i "$tar" >/dev/null &
    pids+=($!); hosts+=("$url")
  done
  for i in "${!pids[@]}"; do
    # a load that failed, or left another image under the name, is a host that would run something else
    if ! wait "${pids[$i]}" ||
      [[ $(DOCKER_HOST="${hosts[$i]}" docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null) != "$id" ]]; then
      failed+=("${hosts[$i]}")
    fi
  done
  [[ ${#failed[@]} == 0 ]] || die "$IMAGE did not arrive on: ${failed[*]}"
  log "$IMAGE loaded on $# host(s): $*"
}

cmd_scale() {
  [[ $# -eq 1 && $1 =~ ^[0-9]+$ ]] || die "usage: scale N (client-node replicas)"
  require_manager
  service_exists clients || die "stack $STACK is not deployed (run: $0 --stack $STACK up)"
  local max
  max="$(clients_env SHUFFLEDP_MAX_CLIENT_NODES)"
  ! service_exists fleet-0 || die "stack $STACK runs devices in fleets: their number is [deployment] client_nodes \
of the configuration (change it, then up again)"
  (( $1 >= 1 && $1 <= max )) || die "scale $1: this stack has certificates and data shards for 1..$max client \
nodes (--max-clients at up); to go further: down, then up --max-clients N (the users are then re-split)"
  docker service scale --detach "${STACK}_clients=$1" >/dev/null
  log "client nodes: $1 replicas"
  wait_ready clients
}

cmd_status() {
  require_manager
  echo "hosts:"
  docker node ls -q | while read -r id; do
    docker node inspect --format '  {{.Description.Hostname}} ({{.Status.State}}, {{.Spec.Availability}}): roles {{range $k, $v := .Spec.Labels}}{{$k}} {{end}}' "$id" |
      sed 's/shuffledp\.role\.//g; s/shuffledp\.state\.[^ ]* \{0,1\}//g; s/ *$//'
  done
  service_exists analyzer || { echo "stack $STACK: not deployed"; return 0; }
  echo "services:"
  docker stack services --format '  {{.Name}} {{.Replicas}} {{.Image}}' "$STACK"
  echo "tasks:"
  docker stack ps --no-trunc --format '  {{.Name}} on {{.Node}}: {{.DesiredState}} / {{.CurrentState}} {{.Error}}' "$STACK"
}

cmd_logs() {
  [[ $# -eq 1 && ( " ${SERVICES[*]} " == *" $1 "* || $1 =~ ^fleet-[0-9]+$ ) ]] ||
    die "usage: logs SERVICE (analyzer, shuffler, clients, fleet-<j>)"
  exec docker service logs -f --tail 100 "${STACK}_$1"
}

cmd_down() {
  local volumes=0
  case "${1:-}" in
    "") ;;
    --volumes) volumes=1 ;;
    *) die "down takes only --volumes" ;;
  esac
  require_manager
  local label="label=com.docker.stack.namespace=$STACK"
  docker rm -f "${STACK}-prometheus" >/dev/null 2>&1 || true  # it holds the metrics networks (up --monitoring)
  if service_exists analyzer || service_exists shuffler || service_exists clients || service_exists fleet-0; then
    docker stack rm "$STACK" >/dev/null
  fi
  docker service ls -q --filter "label=org.shuffledp.stack=$STACK" | xargs -r docker service rm >/dev/null
  # stack rm returns at once: wait until the tasks' containers and the networks are gone
  local deadline=$((SECONDS + 120))
  while [[ -n "$(docker ps -aq --filter "$label")$(docker network ls -q --filter "$label")" ]]; do
    (( SECONDS < deadline )) || die "stack $STACK not gone after 120 s: $(docker ps -a --filter "$label" --format '{{.Names}}' | tr '\n' ' ')"
    sleep 1
  done
  docker secret ls -q --filter "$label" | xargs -r docker secret rm >/dev/null
  docker config ls -q --filter "$label" | xargs -r docker config rm >/dev/null
  if [[ $volumes == 1 ]]; then
    # a container Swarm is still removing may hold a volume for a moment
    local vol
    deadline=$((SECONDS + 60))
    for vol in $(docker volume ls -q --filter "$label"); do
      until docker volume rm "$vol" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || die "volume $vol still in use: $(docker ps -a --filter "volume=$vol" --format '{{.Names}}' | tr '\n' ' ')"
        sleep 1
      done
    done
    local role node
    for role in "${STATEFUL[@]}"; do
      node="$(state_node "$role")"
      [[ -z $node ]] || docker node update --label-rm "$(state_label "$role")" "$node" >/dev/null
    done
    if [[ $(docker node ls -q | wc -l) -gt 1 ]]; then
      log "removed the volumes on this host; on other hosts: docker volume ls --filter $label (then docker volume rm)"
    fi
    log "stack $STACK removed with its state"
  else
    log "stack $STACK removed; the ledger, participation record and users' spend stay in volumes (down --volumes: delete)"
  fi
}

cmd_revoke() {
  require_manager
  pki_revoke "$@"
  if [[ -n $(state_node shuffler) ]]; then
    publish_crl
  else
    log "stack $STACK has no shuffler state yet: up publishes the list"
  fi
}

cmd_pki() {
  local force
  force="$(pki_flag "$@")"
  swarm_pki "${MAX_CLIENTS:-${CLIENTS:-$(config_clients "$CONFIG")}}" "$force"
}

case "$CMD" in
  init) cmd_init "$@" ;;
  label) cmd_label "$@" ;;
  up) cmd_up "$@" ;;
  run) cmd_run "$@" ;;
  results | cancel) cmd_results "$@" ;;
  ship) cmd_ship "$@" ;;
  scale) cmd_scale "$@" ;;
  status) cmd_status ;;
  logs) cmd_logs "$@" ;;
  down) cmd_down "$@" ;;
  pki) cmd_pki "$@" ;;
  revoke) cmd_revoke "$@" ;;
  *) die "unknown command '$CMD' (init, label, up, run, results, cancel, ship, scale, status, logs, down, pki, revoke)" ;;
esac
