#!/bin/bash
# Issue 20: one H200 round (16-core nvidia-h200 host), all within ~410 s of wall time.
#
# Runs from the repository root of a fresh checkout (kvpack NOT installed: src/ goes on
# PYTHONPATH). The device image has torch/transformers but not cryptography: its wheels
# (cryptography, cffi, pycparser for cp312 manylinux x86_64) are installed from
# $KVPACK_WHEELS (default .perf/whl, an ignored folder the caller carries) when missing.
# Every measurement writes its JSON lines into $OUT:
#   env.txt            GPU, versions, disk
#   limits.jsonl       bench_limits: page cache -> host (threads / processes), cold read,
#                      H2D, GPU SHA-256 per message size, the durable write pattern
#   store_write.jsonl  bench_store_write: save vs the store's durable pattern on this disk
#   pytest.txt         pytest tests/gpu (the tail)
#   bench_gpu.jsonl    bench_gpu at 8k/32k/131k: restore vs recompute vs the floors
#   round.log          progress and every benchmark's own output
#
# Invocation (device tool), from the main checkout:
#   run(command="bash benchmarks/h200_round.sh", carry=[".perf/whl"], timeout_s=440)
# KVPACK_ROUND_DRY=1 runs the same steps at toy sizes on a CPU (a check of this script).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${KVPACK_ROUND_BUDGET_S:-410}
DRY=${KVPACK_ROUND_DRY:-0}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
cap() {
    local l
    l=$(left)
    if [ "$l" -lt 5 ]; then l=5; fi
    if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi
}
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/round.log"; }

if [ "$DRY" = 1 ]; then
    LIMITS_ARGS="--object-mib 2 --total-gib 0.125 --skip-cold --hash-mib 1"
    WRITE_ARGS="--gib 0.0625 --repeat 1"
    PYTEST_ARGS="tests/gpu/test_chunk_readers.py"
    GPU_ARGS="--device cpu --dtype f32 --layers 2 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 --intermediate 512 --tokens 512 --repeat 1 --skip-cold"
else
    LIMITS_ARGS="--object-mib 2 --total-gib 2 --hash-mib 1,2,4"
    WRITE_ARGS="--gib 1 --repeat 3"
    PYTEST_ARGS="tests/gpu --timeout 90"
    GPU_ARGS="--tokens 8192,32768,131072 --repeat 3 --cold-max-tokens 32768"
fi

export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
. "$(dirname "$0")/device_wheels.sh"
ensure_modules "cryptography" || exit 2
KVPACK_ROUND_DRY=$DRY python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt" || exit 3
import os
import cryptography, kvpack, torch, transformers
assert os.environ["KVPACK_ROUND_DRY"] == "1" or torch.cuda.is_available(), "no CUDA device"
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run)"
print("kvpack", kvpack.__file__, "torch", torch.__version__, "transformers", transformers.__version__, "cryptography", cryptography.__version__, name)
EOF
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv >>"$OUT/env.txt" 2>&1
df -h /var/tmp >>"$OUT/env.txt"
SCRATCH=/var/tmp/kvpack-round-$$
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH"
trap 'rm -rf "$SCRATCH"' EXIT

log "bench_limits"
# shellcheck disable=SC2086
timeout "$(cap 60)" python3 benchmarks/bench_limits.py --dir "$SCRATCH/lim" $LIMITS_ARGS --out "$OUT/limits.jsonl" >>"$OUT/round.log" 2>&1 ||
    log "bench_limits rc=$?"
rm -rf "$SCRATCH/lim"

log "bench_store_write"
# shellcheck disable=SC2086
timeout "$(cap 45)" python3 benchmarks/bench_store_write.py --dir "$SCRATCH/sw" --chunk-mib 2 $WRITE_ARGS --out "$OUT/store_write.jsonl" >>"$OUT/round.log" 2>&1 ||
    log "bench_store_write rc=$?"
rm -rf "$SCRATCH/sw"

log "pytest tests/gpu"
# shellcheck disable=SC2086
timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider $PYTEST_ARGS >"$OUT/pytest.full" 2>&1
log "pytest rc=$?"
tail -n 30 "$OUT/pytest.full" >"$OUT/pytest.txt"
rm -f "$OUT/pytest.full"
tail -n 1 "$OUT/pytest.txt" | tee -a "$OUT/round.log"

log "bench_gpu"
# shellcheck disable=SC2086
timeout "$(cap 400)" python3 benchmarks/bench_gpu.py --store-dir "$SCRATCH/bg" --handoff-tokens 0 $GPU_ARGS --out "$OUT/bench_gpu.jsonl" >>"$OUT/round.log" 2>&1 ||
    log "bench_gpu rc=$?"
log "done"
for f in "$OUT"/*.jsonl; do
    echo "== $f"
    cut -c1-700 "$f"
done
