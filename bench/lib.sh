# Shared by the bench scripts (source it after `cd` to the repository root):
# a scratch directory, background processes that are stopped on exit, free loopback ports,
# waiting for a server to answer, and (compare.sh, tail.sh) starting a fleet of engine-sims,
# tokengate or smg in front of it. A script may define `cleanup_extra` for anything else to stop.
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  if declare -F cleanup_extra >/dev/null; then cleanup_extra || true; fi
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port that is free on 127.0.0.1 right now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits up to 30 s for URL to answer 2xx; exits the script if it never does.
wait_http() {
  for _ in $(seq 1 300); do
    curl --noproxy '*' -sf -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "not ready: $1" >&2
  exit 1
}

# Waits until FILE holds a line matching REGEX; prints the URL at its end.
wait_line() {
  local file=$1 re=$2
  for _ in $(seq 1 300); do
    if grep -qE "$re" "$file" 2>/dev/null; then grep -E "$re" "$file" | head -1 | grep -oE 'http://[0-9.:]+$'; return 0; fi
    sleep 0.1
  done
  echo "no line /$re/ in $file" >&2; cat "$file" >&2; return 1
}

# Stops the PIDs given and forgets them.
stop() {
  local p
  for p in "$@"; do kill "$p" 2>/dev/null || true; done
  for p in "$@"; do wait "$p" 2>/dev/null || true; done
  local keep=() q
  for q in "${PIDS[@]}"; do [[ " $* " == *" $q "* ]] || keep+=("$q"); done
  PIDS=("${keep[@]}")
}

# The fleet and router helpers below read: BIN (the tokengate binary), ENGINES, MODEL,
# SIM_FLAGS (engine-sim flags), BLOCK_SIZE (the gateway's prefix_index.block_size).

# ENGINES fresh engine-sims (ids e1…) on free ports, so caches start cold; sets ENGINE_URLS
# and ENGINE_PIDS.
ENGINE_URLS=(); ENGINE_PIDS=()
start_fleet() {
  ENGINE_URLS=(); ENGINE_PIDS=()
  local i
  for i in $(seq 1 "$ENGINES"); do
    # shellcheck disable=SC2086 # SIM_FLAGS is a list of flags
    RUST_LOG=warn "$BIN" engine-sim --listen 127.0.0.1:0 --id "e$i" --model "$MODEL" \
      $SIM_FLAGS \
      2>"$WORK/sim$i.log" >/dev/null &
    ENGINE_PIDS+=($!); PIDS+=($!)
  done
  for i in $(seq 1 "$ENGINES"); do
    ENGINE_URLS+=("$(wait_line "$WORK/sim$i.log" 'listening on http://')")
    wait_http "${ENGINE_URLS[$((i-1))]}/health"
  done
}

# tokengate in front of the fleet, proxy and admin listeners on port 0 (it prints both
# addresses); $1 = the service's YAML body (load_balancing / scheduler lines, indented 4).
# Sets GW_PID, GW_URL, GW_ADMIN; the config is $WORK/gw.yaml.
GW_PID=; GW_URL=; GW_ADMIN=
start_tokengate() {
  {
    echo 'listen: ["127.0.0.1:0"]'
    echo 'admin_listen: "127.0.0.1:0"'
    echo 'threads: 2'
    echo "prefix_index: { block_size: $BLOCK_SIZE }"
    echo 'services:'
    echo "  - name: $MODEL"
    printf '%s\n' "$1"
    echo '    instances:'
    local i
    for i in $(seq 1 "$ENGINES"); do
      echo "      - { id: e$i, addr: \"${ENGINE_URLS[$((i-1))]#http://}\" }"
    done
  } >"$WORK/gw.yaml"
  "$BIN" check -c "$WORK/gw.yaml" >/dev/null
  RUST_LOG=warn "$BIN" serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
  GW_PID=$!; PIDS+=($GW_PID)
  GW_URL=$(wait_line "$WORK/gw.out" 'proxy listening on http://')
  GW_ADMIN=$(wait_line "$WORK/gw.out" 'admin listening on http://')
  wait_http "$GW_ADMIN/health"
}

# The SGLang model gateway in front of the fleet; $1 = its --policy. Waits until it serves
# MODEL. Sets SMG_PID, SMG_URL; its log is $WORK/smg.log.
SMG_PID=; SMG_URL=
start_smg() {
  local port; port=$(free_port)
  smg launch --worker-urls "${ENGINE_URLS[@]}" --policy "$1" --host 127.0.0.1 --port "$port" \
    --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --shutdown-grace-period-secs 2 --log-level warn >"$WORK/smg.log" 2>&1 &
  SMG_PID=$!; PIDS+=($SMG_PID)
  SMG_URL=http://127.0.0.1:$port
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null "$SMG_URL/health" && break
    kill -0 "$SMG_PID" 2>/dev/null || { cat "$WORK/smg.log" >&2; return 1; }
    sleep 0.1
  done
  wait_http "$SMG_URL/health"
  # the workers must be registered (health can answer before the worker probes finish)
  for _ in $(seq 1 300); do
    if curl -sf "$SMG_URL/v1/models" | grep -q "$MODEL"; then return 0; fi
    sleep 0.2
  done
  echo "smg has no worker serving $MODEL" >&2; cat "$WORK/smg.log" >&2; return 1
}
