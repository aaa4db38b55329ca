# Shared by the bench scripts (source it after `cd` to the repository root):
# a scratch directory, background processes that are stopped on exit, free loopback ports and
# waiting for a server to answer. A script may define `cleanup_extra` for anything else to stop.
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
