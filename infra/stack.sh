#!/usr/bin/env bash
# The local rlstage stack: a Prefect server, a process worker for the deployments' pool, an
# MLflow tracking server and a Ray head, all on 127.0.0.1, each in its own process group (session).
# Commands and flow runs on this home join the stack's Ray, so the role workers one of them releases
# stay warm for the next (ray.warm_worker_idle_s); `down` stops them with the cluster.
#
#   infra/stack.sh up        start what is not running; prints the exports to use
#   infra/stack.sh status    what runs, on which port; the exports
#   infra/stack.sh env       only the exports:  eval "$(infra/stack.sh env)"
#   infra/stack.sh deploy    prefect deploy --all (prefect.yaml) against this stack's server
#   infra/stack.sh down      stop everything: TERM each process group (twice for the worker),
#                            KILL what is left after RLSTAGE_STOP_TIMEOUT seconds
#
# The stack runs on the local home that the CLI and `rlstage ui` share (infra/home.py): Prefect home
# <home>/prefect, MLflow store <home>/mlflow, pids, ports and logs <home>/stack.
# Settings (environment): RLSTAGE_HOME (default <repo>/.rlstage), RLSTAGE_VENV (default <repo>/.venv), RLSTAGE_POOL
# (rlstage-process), RLSTAGE_PREFECT_PORT / RLSTAGE_MLFLOW_PORT / RLSTAGE_RAY_PORT (default: 4200 / 5000 / 6379
# when free, else any free port), RLSTAGE_RAY_CPUS (the machine's), RLSTAGE_RAY_OBJECT_STORE_MB (512),
# RLSTAGE_STOP_TIMEOUT (15), PREFECT_UI_ENABLED (true).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RLSTAGE_VENV:-$REPO/.venv}
export RLSTAGE_HOME=${RLSTAGE_HOME:-$REPO/.rlstage}
STATE=$RLSTAGE_HOME/stack
POOL=${RLSTAGE_POOL:-rlstage-process}
STOP_TIMEOUT=${RLSTAGE_STOP_TIMEOUT:-15}
PY=$VENV/bin/python
SERVICES=(prefect-server mlflow ray worker) # start order; stopped in reverse

# Offline, loopback-only, no telemetry (the same values as infra/env.py); Ray reads
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import time, so flow runs must get it from their parent.
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_CLI_PROMPT=false
export MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
export RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false AWS_EC2_METADATA_DISABLED=true
export PYTHONUNBUFFERED=1
export PREFECT_HOME=$RLSTAGE_HOME/prefect

die() { echo "stack: $*" >&2; exit 1; }
pidfile() { echo "$STATE/$1.pid"; }
portfile() { echo "$STATE/$1.port"; }
read_or_empty() { [[ -f $1 ]] && cat "$1" || true; }

# A service runs when its recorded pid is alive and still leads its own session.
running() {
  local pid
  pid=$(read_or_empty "$(pidfile "$1")")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && [[ $(ps -o sid= -p "$pid" | tr -d ' ') == "$pid" ]]
}

# The preferred port when it is free on 127.0.0.1, else one the kernel picks; with a second
# argument "strict", only the given port will do (infra/prefect_server.py: free_port).
pick_port() { PYTHONPATH=$REPO "$PY" -m rlstage.infra.prefect_server port "$@"; }
# A new home's database starts migrated, from the schema rlstage ships for the installed version (infra/db_templates.py)
seed_db() { PYTHONPATH=$REPO "$PY" -m rlstage.infra.db_templates seed "$1" "$2"; }

# RLSTAGE_<NAME>_PORT when set (must be free), else the port of the last start, else the default.
choose_port() { # name env_value default
  if [[ -n $2 ]]; then
    pick_port "$2" strict
  else
    pick_port "$(read_or_empty "$(portfile "$1")" | grep . || echo "$3")"
  fi
}

wait_http() { # url timeout_s pid name
  if ! PYTHONPATH=$REPO "$PY" -m rlstage.infra.prefect_server wait "$1" "$2" "$3"; then
    echo "--- last lines of $STATE/$4.log:" >&2
    tail -n 25 "$STATE/$4.log" >&2
    stop_service "$4" >&2
    exit 1
  fi
}

# start NAME CMD...: a new session (setsid: pid = process group id = session id), output to the log.
start() {
  local name=$1 pid
  shift
  echo "== $(date -Is) $*" >>"$STATE/$name.log"
  setsid "$@" >>"$STATE/$name.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$(pidfile "$name")"
  sleep 0.2
  # A non-interactive shell does not make background jobs group leaders, so setsid does not fork.
  if kill -0 "$pid" 2>/dev/null && [[ $(ps -o sid= -p "$pid" | tr -d ' ') != "$pid" ]]; then
    die "$name (pid $pid) is not a session leader; refusing to track it"
  fi
}

prefect_url() { echo "http://127.0.0.1:$(read_or_empty "$(portfile prefect-server)")/api"; }
mlflow_url() { echo "http://127.0.0.1:$(read_or_empty "$(portfile mlflow)")"; }

print_env() {
  echo "export RLSTAGE_HOME=$RLSTAGE_HOME"
  echo "export PREFECT_API_URL=$(prefect_url)"
  echo "export MLFLOW_TRACKING_URI=$(mlflow_url)"
  # The venv's commands (prefect, rlstage, mlflow) by name; a PATH that has them already is left alone.
  case ":$PATH:" in *":$VENV/bin:"*) ;; *) echo "export PATH=\"$VENV/bin:\$PATH\"" ;; esac
}

cmd_up() {
  [[ -x $PY ]] || die "no virtual environment at $VENV (run scripts/setup.sh)"
  mkdir -p "$STATE" "$PREFECT_HOME" "$RLSTAGE_HOME/mlflow/artifacts"
  local port

  if running prefect-server; then
    echo "prefect server: already running (pid $(cat "$(pidfile prefect-server)"))"
  else
    port=$(choose_port prefect-server "${RLSTAGE_PREFECT_PORT:-}" 4200)
    echo "$port" >"$(portfile prefect-server)"
    seed_db prefect "$PREFECT_HOME/prefect.db"
    # The UI calls the API at PREFECT_UI_API_URL (default port 4200), not where the server runs.
    start prefect-server env PREFECT_UI_ENABLED="${PREFECT_UI_ENABLED:-true}" PREFECT_UI_API_URL="$(prefect_url)" \
      "$VENV/bin/prefect" server start --host 127.0.0.1 --port "$(cat "$(portfile prefect-server)")"
    wait_http "$(prefect_url)/health" 120 "$(cat "$(pidfile prefect-server)")" prefect-server
    echo "prefect server: $(prefect_url) (pid $(cat "$(pidfile prefect-server)"))"
  fi
  export PREFECT_API_URL
  PREFECT_API_URL=$(prefect_url)

  if running mlflow; then
    echo "mlflow server: already running (pid $(cat "$(pidfile mlflow)"))"
  else
    port=$(choose_port mlflow "${RLSTAGE_MLFLOW_PORT:-}" 5000)
    echo "$port" >"$(portfile mlflow)"
    seed_db mlflow "$RLSTAGE_HOME/mlflow/mlflow.db"
    start mlflow "$VENV/bin/mlflow" server --host 127.0.0.1 --port "$(cat "$(portfile mlflow)")" --workers 1 \
      --backend-store-uri "sqlite:///$RLSTAGE_HOME/mlflow/mlflow.db" \
      --artifacts-destination "$RLSTAGE_HOME/mlflow/artifacts"
    wait_http "$(mlflow_url)/health" 120 "$(cat "$(pidfile mlflow)")" mlflow
    echo "mlflow server:  $(mlflow_url) (pid $(cat "$(pidfile mlflow)"))"
  fi

  if running ray; then
    echo "ray head: already running (pid $(cat "$(pidfile ray)"))"
  else
    port=$(choose_port ray "${RLSTAGE_RAY_PORT:-}" 6379)
    echo "$port" >"$(portfile ray)"
    # Ray's token authentication: commands on this home read the token (infra/home.py: running_ray)
    [[ -s $STATE/ray.token ]] || (umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(16))" >"$STATE/ray.token")
    # --block keeps the head's processes in this service's session, so `down` stops them and the idle workers
    # (no drain on `down`: its idle workers hold no work, and a drain waits 30 s)
    start ray env RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$(cat "$STATE/ray.token")" RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 \
      "$VENV/bin/ray" start --head --block \
      --port "$port" --node-ip-address 127.0.0.1 --include-dashboard=false --disable-usage-stats \
      ${RLSTAGE_RAY_CPUS:+--num-cpus "$RLSTAGE_RAY_CPUS"} --object-store-memory $((${RLSTAGE_RAY_OBJECT_STORE_MB:-512} << 20))
    wait_http "tcp://127.0.0.1:$port" 120 "$(cat "$(pidfile ray)")" ray
    echo "ray head:       127.0.0.1:$port (pid $(cat "$(pidfile ray)"))"
  fi

  if running worker; then
    echo "worker: already running (pid $(cat "$(pidfile worker)"))"
  else
    if ! "$VENV/bin/prefect" work-pool inspect "$POOL" >/dev/null 2>&1; then
      "$VENV/bin/prefect" work-pool create "$POOL" --type process >/dev/null
    fi
    # Flow runs inherit the worker's environment: PREFECT_API_URL (Ray workers then report to this
    # server instead of starting their own) and MLFLOW_TRACKING_URI (used when a run's config
    # names no tracking.tracking_uri).
    start worker env MLFLOW_TRACKING_URI="$(mlflow_url)" \
      PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-2}" \
      "$VENV/bin/prefect" worker start --pool "$POOL" --type process --install-policy never \
      --name "rlstage-$(hostname)-$$"
    sleep 1
    running worker || { tail -n 25 "$STATE/worker.log" >&2; rm -f "$(pidfile worker)"; die "the worker exited"; }
    echo "worker: pool $POOL (pid $(cat "$(pidfile worker)"))"
  fi
  print_env >"$STATE/env.sh"
  echo
  echo "# state and logs under $STATE; use the stack with:"
  print_env
}

# Every process group under the given pid (the flow runs a worker starts lead their own
# sessions, and their Ray processes their own groups): printed one per line, root first.
descendant_groups() {
  ps -eo pid=,ppid=,pgid= | awk -v root="$1" '
    { parent[$1] = $2; group[$1] = $3 }
    END {
      print group[root]
      for (p in parent) { q = p; while (q in parent && q != root && q > 1) q = parent[q]; if (q == root && p != root) print group[p] }
    }' | awk '!seen[$0]++'
}

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

stop_service() {
  local name=$1 pid groups g deadline
  pid=$(read_or_empty "$(pidfile "$name")")
  if [[ -z $pid ]] || ! kill -0 "$pid" 2>/dev/null; then
    rm -f "$(pidfile "$name")"
    return
  fi
  if [[ $(ps -o sid= -p "$pid" | tr -d ' ') != "$pid" ]]; then
    echo "$name: pid $pid is no longer the session we started; leaving it" >&2
    rm -f "$(pidfile "$name")"
    return
  fi
  mapfile -t groups < <(descendant_groups "$pid")
  kill -TERM -- "-$pid" 2>/dev/null || true
  if [[ $name == worker ]]; then
    # An idle worker ignores its first SIGTERM (for up to 60 s): the second one stops it.
    sleep 1
    kill -TERM -- "-$pid" 2>/dev/null || true
  fi
  # Flow runs of the worker (their own sessions) and anything else below the service.
  for g in "${groups[@]}"; do
    [[ $g == "$pid" ]] || kill -TERM -- "-$g" 2>/dev/null || true
  done
  deadline=$((SECONDS + STOP_TIMEOUT))
  for g in "${groups[@]}"; do
    while group_alive "$g" && ((SECONDS < deadline)); do sleep 0.2; done
    if group_alive "$g"; then
      echo "$name: process group $g still alive after ${STOP_TIMEOUT}s, sending KILL" >&2
      kill -KILL -- "-$g" 2>/dev/null || true
    fi
  done
  rm -f "$(pidfile "$name")"
  echo "$name: stopped (process group $pid)"
}

cmd_down() {
  [[ -d $STATE ]] || { echo "stack: nothing under $STATE"; return; }
  local i
  for ((i = ${#SERVICES[@]} - 1; i >= 0; i--)); do stop_service "${SERVICES[i]}"; done
}

cmd_status() {
  local name state=0
  for name in "${SERVICES[@]}"; do
    if running "$name"; then
      printf '%-15s running  pid %-8s %s\n' "$name" "$(cat "$(pidfile "$name")")" \
        "$([[ -f $(portfile "$name") ]] && echo "127.0.0.1:$(cat "$(portfile "$name")")" || echo "pool $POOL")"
    else
      printf '%-15s stopped\n' "$name"
      state=3
    fi
  done
  if ((state == 0)); then
    echo
    print_env
  fi
  return $state
}

cmd_deploy() {
  running prefect-server || die "the Prefect server is not running (infra/stack.sh up)"
  cd "$REPO"
  # prefect.yaml resolves {{ $PWD }} when deploying: it must be the repository root.
  PWD=$REPO PREFECT_API_URL=$(prefect_url) "$VENV/bin/prefect" deploy --all --no-prompt
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env)
    running prefect-server || die "the stack is not running (infra/stack.sh up)"
    print_env
    ;;
  deploy) cmd_deploy ;;
  *)
    echo "usage: $0 up|down|status|env|deploy" >&2
    exit 2
    ;;
esac
