#!/usr/bin/env bash
# Builds loom and runs all of its tests: the release preset (build/release), two jobs, the
# output of any failing test printed. Works from any directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/install-deps.sh
cmake --preset release
cmake --build --preset release
ctest --preset release
