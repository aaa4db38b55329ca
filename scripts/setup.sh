#!/usr/bin/env bash
# Installs what building and testing tokengate needs beyond Rust itself:
#   cmake       Pingora's zlib-ng (the build)
#   chromium    the status page test in a real headless browser (tests/status_page.rs)
#   prometheus  a real Prometheus + promtool scraping the gateway (tests/dashboard.rs)
#   redis       a real redis-server for the replicas' shared state (tests/cluster.rs)
# Safe to run repeatedly; does nothing when everything is there. Without apt-get, only cmake
# is required: the browser, Prometheus and Redis tests skip with a message when their tools are
# missing (CI requires them).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
if command -v apt-get >/dev/null 2>&1; then
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || need+=(prometheus)
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  elif command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y cmake
  elif command -v brew >/dev/null 2>&1; then
    brew install cmake
  else
    echo "setup: please install cmake with your package manager" >&2
    exit 1
  fi
fi
for c in rustfmt clippy; do
  if ! rustup component list --installed 2>/dev/null | grep -q "^$c"; then
    rustup component add "$c" >/dev/null 2>&1 || true
  fi
done
