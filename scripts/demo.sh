#!/usr/bin/env bash
# Builds the GPT-2 training example (release preset) and runs its short demo.
# Extra arguments go to gpt2_train after --demo. Works from any directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/install-deps.sh
cmake --preset release
cmake --build --preset release --target gpt2_train
exec build/release/examples/gpt2_train --demo "$@"
