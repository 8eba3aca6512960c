#!/bin/bash
# Issue 20 (store writes at disk speed): where an H200-host save loses to the store's own
# durable write pattern (docs/bench/store_profile.md). CPU only (no GPU is touched); ~200 s.
#
# Runs from the repository root of a fresh checkout, like h200_round.sh (src/ on PYTHONPATH,
# cryptography wheels from $KVPACK_WHEELS, default .perf/whl, when missing). Writes into $OUT:
#   store_write_w16.jsonl  bench_store_write, 16 store workers (32 writer threads)
#   store_write_w32.jsonl  the same with 32 workers (64 threads): does more in flight pay?
#   save_wall.txt          py-spy raw samples (all threads, idle included) of one save round
#   save_gil.txt           py-spy raw samples of the threads holding the GIL, same round
#   verify_threads.jsonl   diag_verify_threads: decode_chunk vs decode_chunk_one_pass (64 KiB
#                          and 256 KiB blocks) on 1 and 16 threads: keep, resize or drop the
#                          one-pass default (KVPACK_ONE_PASS_BLOCK) on many cores
#   (the py-spy files only where py-spy is installed)
# The JSON lines carry save_over_store_pattern (issue 20's goal: >= 0.9) and
# save_over_hash_then_pattern: near 1, the gap is hashing on the writer threads; well
# below 1, it is kvpack's per-chunk work and GIL handoffs (save_gil.txt shows which).
#
# Invocation (device tool), from the main checkout:
#   run(command="bash benchmarks/h200_store_profile.sh", carry=[".perf/whl"], timeout_s=300)
# KVPACK_ROUND_DRY=1 runs the same steps at toy sizes on a CPU (a check of this script).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [ "${KVPACK_ROUND_DRY:-0}" = 1 ]; then
    SIZE="--gib 0.03125 --repeat 1"
    PROFILE_SIZE="--gib 0.03125 --repeat 1"
    DIAG_CHUNKS=8
else
    SIZE="--gib 1 --repeat 3"
    PROFILE_SIZE="--gib 1 --repeat 1"
    DIAG_CHUNKS=256
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
. "$(dirname "$0")/device_wheels.sh"
ensure_modules "cryptography" || exit 2
SCRATCH=/var/tmp/kvpack-store-profile-$$
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH"
trap 'rm -rf "$SCRATCH"' EXIT
uptime | tee "$OUT/uptime.txt"
for workers in 16 32; do
    # shellcheck disable=SC2086
    timeout 90 python3 benchmarks/bench_store_write.py --dir "$SCRATCH/sw" --chunk-mib 2 --workers "$workers" $SIZE \
        --out "$OUT/store_write_w$workers.jsonl" || echo "bench_store_write --workers $workers rc=$?"
done
# host verification: two passes vs the one-pass verifier at 64 KiB (the default) and 256 KiB
# blocks on 1 and 16 threads (GIL handoffs per block grow with the thread count)
for block in 65536 262144; do
    timeout 60 python3 benchmarks/diag_verify_threads.py --chunks "$DIAG_CHUNKS" --threads 1,16 --dir "$SCRATCH/diag" --block "$block" \
        >>"$OUT/verify_threads.jsonl" || echo "diag_verify_threads --block $block rc=$?"
done
if command -v py-spy >/dev/null; then
    for mode in wall gil; do
        flag="--idle"
        if [ "$mode" = gil ]; then flag="--gil"; fi
        # shellcheck disable=SC2086
        timeout 60 py-spy record -r 200 $flag -f raw -o "$OUT/save_$mode.txt" -- \
            python3 benchmarks/bench_store_write.py --dir "$SCRATCH/sw" --chunk-mib 2 --workers 16 $PROFILE_SIZE ||
            echo "py-spy $mode rc=$?"
    done
else
    echo "py-spy not installed: no profile" | tee "$OUT/save_wall.txt"
fi
uptime | tee -a "$OUT/uptime.txt"
