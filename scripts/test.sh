#!/usr/bin/env bash
# Runs the whole test suite (unit + integration tests through the real binary).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo test --workspace "$@"
