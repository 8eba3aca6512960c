#!/bin/bash
# Issue 14: the node tier's H200 throughput goals in one device call (~4-6 minutes).
#
# Runs from the repository root (kvpack not installed: src/ goes on PYTHONPATH). Wheels the
# image lacks (cryptography, fastapi, uvicorn, pydantic, ...) are installed from
# $KVPACK_WHEELS (default .perf/whl, an ignored folder the caller carries) when missing.
# Writes into $OUT:
#   nodes.jsonl   bench_nodes: resident-producer 4 GiB handoff at 1/2/4/8 stripes vs
#                 bench_handoff_procs and raw TLS, CPU (user+sys and sys) per request
#   gil.jsonl     diag_stripe_gil: TLS streams as threads of one process vs processes
#   nodes.log     progress and both benchmarks' own output
# What decides what (docs/bench/nodes_profile.md, round 4): receiver_sys_cpu_s small =>
# install planes were recycled; gil.jsonl threads_vs_procs near 1 at 4 stripes => threads
# can stripe (the page faults were the bound), well under 1 => receiver stripe processes.
# Invocation (device tool): run(command="bash benchmarks/h200_nodes.sh", carry=[".perf/whl"], timeout_s=560)
# KVPACK_NODES_DRY=1: the same steps at toy sizes (a check of this script on any host).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/nodes.log"; }
if [ "${KVPACK_NODES_DRY:-0}" = 1 ]; then
    NODES_ARGS="--handoff-mib 64 --repeat 1 --stripes 1,4 --sessions 1"
    GIL_ARGS="--mib 64 --stripes 1,4 --switch-ms 5"
else
    NODES_ARGS="--handoff-mib 4096 --repeat 1 --stripes 1,2,4,8 --sessions 1"
    GIL_ARGS="--mib 4096 --stripes 1,2,4,8 --switch-ms 5,0.5"
fi
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
. "$(dirname "$0")/device_wheels.sh"
ensure_modules "cryptography fastapi uvicorn" || exit 2
log "bench_nodes $NODES_ARGS"
timeout 300 python3 benchmarks/bench_nodes.py $NODES_ARGS --out "$OUT/nodes.jsonl" >>"$OUT/nodes.log" 2>&1 || log "bench_nodes rc $?"
log "diag_stripe_gil $GIL_ARGS"
timeout 220 python3 benchmarks/diag_stripe_gil.py $GIL_ARGS --out "$OUT/gil.jsonl" >>"$OUT/nodes.log" 2>&1 || log "diag_stripe_gil rc $?"
log "done"
