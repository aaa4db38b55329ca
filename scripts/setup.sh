#!/usr/bin/env bash
# Installs what building tokengate needs beyond Rust itself: cmake (Pingora's zlib-ng).
# Safe to run repeatedly; does nothing when everything is there.
set -euo pipefail
if ! command -v cmake >/dev/null 2>&1; then
  echo "setup: installing cmake (needed to build Pingora)" >&2
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake >/dev/null
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
