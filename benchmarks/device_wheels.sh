# Sourced by the H200 scripts (h200_round.sh, h200_nodes.sh, h200_store_profile.sh): makes
# the Python modules a script imports importable on the device, whose image lacks some of
# them, by installing the carried wheels ($KVPACK_WHEELS, default .perf/whl) into
# /tmp/kvpack-site and appending that to PYTHONPATH when an import fails.
#   ensure_modules "cryptography fastapi" || exit 2
ensure_modules() {
    local imports whl
    imports=$(echo "$1" | tr ' ' ',')
    if python3 -c "import $imports" 2>/dev/null; then
        return 0
    fi
    whl=${KVPACK_WHEELS:-.perf/whl}
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvpack-site "$whl"/*.whl; then
        echo "$1: not importable and no usable wheels in $whl" >&2
        return 1
    fi
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/kvpack-site"
}
