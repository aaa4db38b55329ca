# Shared by the bench scripts (source it after `cd` to the repository root):
# a scratch directory, background processes that are stopped on exit, free loopback ports,
# waiting for a server to answer, nginx `return 200` (mirroring.sh, cluster-latency.sh), and
# (compare.sh, tail.sh, pd.sh) starting a fleet of engine-sims,
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

# ENGINES fresh engine-sims (ids e1…) on free ports, so caches start cold; sets ENGINE_IDS,
# ENGINE_URLS and ENGINE_PIDS.
ENGINE_IDS=(); ENGINE_URLS=(); ENGINE_PIDS=()
start_fleet() {
  ENGINE_IDS=(); ENGINE_URLS=(); ENGINE_PIDS=()
  local i
  for i in $(seq 1 "$ENGINES"); do
    ENGINE_IDS+=("e$i")
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

# A prefill/decode fleet (bench/pd.sh): PREFILLS prefill and DECODES decode engine-sims
# (ids p1…, d1…) on free ports, speaking $1 = sglang | vllm (engine-sim --pd-mode), with
# SIM_FLAGS plus PD_SIM_FLAGS. An SGLang prefill also serves its bootstrap endpoints on a
# port of its own (--bootstrap-port 0: the engine picks a free one and prints it). Sets
# ENGINE_IDS / ENGINE_URLS / ENGINE_PIDS (the whole fleet, prefills first), PREFILL_URLS,
# PREFILL_BOOTSTRAP (ports; sglang only) and DECODE_URLS.
PREFILL_URLS=(); PREFILL_BOOTSTRAP=(); DECODE_URLS=()
start_pd_fleet() {
  local mode=$1 id role boot k
  ENGINE_IDS=(); ENGINE_URLS=(); ENGINE_PIDS=(); PREFILL_URLS=(); PREFILL_BOOTSTRAP=(); DECODE_URLS=()
  for id in $(seq -f 'p%g' 1 "$PREFILLS") $(seq -f 'd%g' 1 "$DECODES"); do
    role=decode; boot=()
    if [[ $id == p* ]]; then role=prefill; [ "$mode" = sglang ] && boot=(--bootstrap-port 0); fi
    # shellcheck disable=SC2086 # SIM_FLAGS, PD_SIM_FLAGS are lists of flags
    RUST_LOG=warn "$BIN" engine-sim --listen 127.0.0.1:0 --id "$id" --model "$MODEL" \
      $SIM_FLAGS ${PD_SIM_FLAGS:-} --role "$role" --pd-mode "$mode" "${boot[@]}" \
      2>"$WORK/sim-$id.log" >/dev/null &
    ENGINE_PIDS+=($!); PIDS+=($!); ENGINE_IDS+=("$id")
  done
  for k in "${!ENGINE_IDS[@]}"; do
    id=${ENGINE_IDS[$k]}
    ENGINE_URLS+=("$(wait_line "$WORK/sim-$id.log" 'listening on http://')")
    wait_http "${ENGINE_URLS[$k]}/health"
    if [[ $id == p* ]]; then
      PREFILL_URLS+=("${ENGINE_URLS[$k]}")
      if [ "$mode" = sglang ]; then
        for _ in $(seq 1 100); do grep -q 'bootstrap server on' "$WORK/sim-$id.log" && break; sleep 0.1; done
        PREFILL_BOOTSTRAP+=("$(grep -oE 'bootstrap server on [0-9.]+:[0-9]+' "$WORK/sim-$id.log" | head -1 | grep -oE '[0-9]+$')")
        [ -n "${PREFILL_BOOTSTRAP[-1]}" ] || { echo "no bootstrap port for $id" >&2; cat "$WORK/sim-$id.log" >&2; exit 1; }
      fi
    else
      DECODE_URLS+=("${ENGINE_URLS[$k]}")
    fi
  done
}

# The instances: block for tokengate in front of the PD fleet (roles, bootstrap ports).
pd_instances_yaml() {
  local k id p=0 boot
  echo '    instances:'
  for k in "${!ENGINE_IDS[@]}"; do
    id=${ENGINE_IDS[$k]}
    if [[ $id == p* ]]; then
      boot=""; [ -n "${PREFILL_BOOTSTRAP[$p]:-}" ] && boot=", bootstrap_port: ${PREFILL_BOOTSTRAP[$p]}"
      echo "      - { id: $id, addr: \"${ENGINE_URLS[$k]#http://}\", role: prefill$boot }"
      p=$((p + 1))
    else
      echo "      - { id: $id, addr: \"${ENGINE_URLS[$k]#http://}\", role: decode }"
    fi
  done
}

# tokengate in front of the fleet, proxy and admin listeners on port 0 (it prints both
# addresses); $1 = the service's YAML body (load_balancing / scheduler lines, indented 4);
# $2 (optional) = its instances: block (default: the ENGINES integrated engines e1…);
# $3 (optional) = top-level keys (e.g. cost_model), not indented. INSTANCE_KEYS (optional):
# more keys for every default instance line, e.g. ", cache_tokens: 16384". PREFIX_INDEX_KEYS
# (optional): more prefix_index keys, e.g. ", ttl: 10m".
# Sets GW_PID, GW_URL, GW_ADMIN; the config is $WORK/gw.yaml.
GW_PID=; GW_URL=; GW_ADMIN=
# The keys of service $2 in config file $1 (all but its instances), indented as in the file: a
# service body for start_tokengate (a documented config run as it is written).
service_keys() {
  awk -v svc="$2" '
    $0 ~ "^  - name: " svc "$" { on = 1; next }
    on && (/^  - / || /^    instances:/) { exit }
    on { print }' "$1"
}

start_tokengate() {
  {
    echo 'listen: ["127.0.0.1:0"]'
    echo 'admin_listen: "127.0.0.1:0"'
    echo 'threads: 2'
    echo "prefix_index: { block_size: $BLOCK_SIZE${PREFIX_INDEX_KEYS:-} }"
    if [ -n "${3:-}" ]; then printf '%s\n' "$3"; fi
    echo 'services:'
    echo "  - name: $MODEL"
    printf '%s\n' "$1"
    if [ -n "${2:-}" ]; then
      printf '%s\n' "$2"
    else
      echo '    instances:'
      local i
      for i in $(seq 1 "$ENGINES"); do
        echo "      - { id: e$i, addr: \"${ENGINE_URLS[$((i-1))]#http://}\"${INSTANCE_KEYS:-} }"
      done
    fi
  } >"$WORK/gw.yaml"
  "$BIN" check -c "$WORK/gw.yaml" >/dev/null
  # Emptied here, not by the redirection below: that one runs in the background child, and
  # wait_line could read the previous gateway's address first (its port refuses connections).
  : >"$WORK/gw.out"
  RUST_LOG=${GW_LOG:-warn} "$BIN" serve -c "$WORK/gw.yaml" >"$WORK/gw.out" 2>"$WORK/gw.log" &
  GW_PID=$!; PIDS+=($GW_PID)
  GW_URL=$(wait_line "$WORK/gw.out" 'proxy listening on http://')
  GW_ADMIN=$(wait_line "$WORK/gw.out" 'admin listening on http://')
  wait_http "$GW_ADMIN/health"
}

# The SGLang model gateway in front of the fleet; $1 = its --policy, $2… (optional) = more
# launch arguments (default: --worker-urls with the whole fleet). SMG_REGISTER (optional): JSON
# worker specs POSTed to smg's worker API (/workers) once it answers, for workers the command
# line cannot describe (bench/pd.sh: PD workers with `runtime_type`); it then waits until all
# of them are ready. Waits until it serves MODEL. Sets SMG_PID, SMG_URL; its log is
# $WORK/smg.log (SMG_LOG_LEVEL, default warn). Returns 1 (with the log on stderr) when smg
# does not come up.
SMG_PID=; SMG_URL=; SMG_REGISTER=()
start_smg() {
  local port policy=$1; port=$(free_port); shift
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--worker-urls "${ENGINE_URLS[@]}")
  smg launch "${args[@]}" --policy "$policy" --host 127.0.0.1 --port "$port" \
    --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" --shutdown-grace-period-secs 2 --log-level "${SMG_LOG_LEVEL:-warn}" >"$WORK/smg.log" 2>&1 &
  SMG_PID=$!; PIDS+=($SMG_PID)
  SMG_URL=http://127.0.0.1:$port
  for _ in $(seq 1 600); do
    curl -sf -o /dev/null "$SMG_URL/health" && break
    kill -0 "$SMG_PID" 2>/dev/null || { cat "$WORK/smg.log" >&2; return 1; }
    sleep 0.1
  done
  curl -sf -o /dev/null "$SMG_URL/health" || { echo "smg never answered /health" >&2; cat "$WORK/smg.log" >&2; return 1; }
  local spec n=${#SMG_REGISTER[@]}
  for spec in "${SMG_REGISTER[@]}"; do
    curl -sf -o /dev/null -X POST "$SMG_URL/workers" -H 'content-type: application/json' -d "$spec" \
      || { echo "smg refused the worker $spec" >&2; cat "$WORK/smg.log" >&2; return 1; }
  done
  # the workers must be registered (health can answer before the worker probes finish)
  for _ in $(seq 1 300); do
    if [ "$n" -gt 0 ]; then
      [ "$(curl -sf "$SMG_URL/workers" | grep -o '"status":"ready"' | wc -l)" -ge "$n" ] \
        && curl -sf "$SMG_URL/v1/models" | grep -q "$MODEL" && return 0
    elif curl -sf "$SMG_URL/v1/models" | grep -q "$MODEL"; then return 0; fi
    sleep 0.2
  done
  echo "smg has no worker serving $MODEL" >&2; cat "$WORK/smg.log" >&2; return 1
}

# nginx answering every request with one small chat completion (`return 200`): an upstream
# whose own cost is negligible, to measure the gateway's. Listens on each port given; the
# process is added to PIDS; waits until the first port answers. Needs nginx (apt nginx-light).
start_nginx_200() {
  local nginx listen="" p
  nginx=$(command -v nginx || echo /usr/sbin/nginx)
  for p in "$@"; do listen="$listen    listen 127.0.0.1:$p;"$'\n'; done
  mkdir -p "$WORK/nginx"
  cat >"$WORK/nginx/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  keepalive_requests 1000000;
  server {
$listen    location / {
      default_type application/json;
      return 200 '{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}';
    }
  }
}
NGINX
  "$nginx" -e "$WORK/nginx/error.log" -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" >"$WORK/nginx.out" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$1/health"
}
