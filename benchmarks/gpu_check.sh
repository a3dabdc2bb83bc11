#!/usr/bin/env bash
# The first GPU run, for one CUDA machine: at most 6.5 minutes, each part under its own `timeout`, each part's
# results written when it ends (a killed part loses only itself; what ran before it stays in $OUT).
#
#   part      budget  what
#   env        20 s   torch / CUDA / triton versions, the device
#   kernels   110 s   tests/test_kernels.py CUDA cases (compiled Triton vs reference, > 2**31 elements, the
#                     compile-for-sm_90 of every kernel incl. Philox) + tests/test_random.py's Philox cases on CUDA
#   pack       45 s   pack / unpack / 1-rank exchange at 181x1440 and 721x1440, 64 / 256 ch, bf16, vs copy_ and
#                     F.pad: 50 back-to-back calls and one CUDA graph of 50 calls (device ms, host us apart)
#   step       85 s   1 rank: sync-free step, whole-step graph vs eager, per-module make_graphed_callables, bf16
#                     autocast vs unsharded, inductor on channels_last
#   nccl2      75 s   2 ranks on the one GPU, real NCCL (NCCL_HOSTID per rank, NCCL_IB_DISABLE=1, loopback):
#                     host groups, check_equivalence on CUDA, sync-free step, p2p inside a captured graph
#   conv       45 s   HaloConv2d vs nn.Conv2d at 181 / 721 rows x 1440, bf16, 64 / 256 ch, eager and graph-replayed
#   total     380 s
#
# Outputs go to $OUT if set, else benchmarks/out: gpu_check_<part>.json (+ gpu_check.jsonl), logs, junit xml, and
# gpu_check_summary.txt (one line per part: name, status, exit code, seconds), appended as each part ends.
# Usage: bash benchmarks/gpu_check.sh [--dry-run]      (PYTHON=/path/to/python to pick the interpreter)
#   --dry-run: the plumbing on the CPU (gloo, tiny sizes); the parts that need CUDA report "skipped: no CUDA".
set -uo pipefail
export PYTHONUNBUFFERED=1

DRY=""
if [ "${1:-}" = "--dry-run" ]; then
    DRY="--dry-run"
    export TRITON_INTERPRET=0  # CPU tensors take the torch reference: the dry run checks the plumbing, not kernels
fi
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT_DIR="${OUT:-benchmarks/out}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/gpu_check_summary.txt"
: > "$SUMMARY"
status=0

# part NAME BUDGET_S COMMAND...: run under `timeout`, log to $OUT_DIR/NAME.log, one summary line when it ends.
part() {
    local name=$1 budget=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (<= ${budget} s) =="
    timeout --kill-after=5 "$budget" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    local verdict=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="timed out"; elif [ "$rc" -ne 0 ]; then verdict=FAILED; fi
    [ "$verdict" = ok ] || status=1
    echo "$name $verdict rc=$rc $((SECONDS - t0))s" | tee -a "$SUMMARY"
}

skip() {
    echo "$1 skipped: no CUDA rc=0 0s" | tee -a "$SUMMARY"
}

if ! "$PY" -c "import halo.kernels" 2>/dev/null; then
    echo "halo.kernels is not importable: installing the repo in editable mode (no dependencies)"
    "$PY" -m pip install -q -e . --no-deps --no-build-isolation || { echo "install failed"; exit 2; }
fi

part env 20 "$PY" -c "
import os, sys, torch
import halo.kernels as hk
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton:', hk.HAS_TRITON, hk.TRITON_IMPORT_ERROR or '')
if hk.HAS_TRITON:
    import triton
    print('triton', triton.__version__, '| TRITON_INTERPRET =', os.environ.get('TRITON_INTERPRET'))
if not torch.cuda.is_available():
    print('no CUDA device visible')
    sys.exit(0 if '$DRY' else 3)
print('device', torch.cuda.get_device_name(), '| nccl', torch.cuda.nccl.version(),
      '| backend for a CUDA tensor:', hk.backend_for(torch.zeros(1, device='cuda')))
"
if [ -z "$DRY" ] && ! grep -q "^env ok" "$SUMMARY"; then
    echo "the environment check failed: this script is the GPU check"; exit 3
fi

if [ -n "$DRY" ]; then
    skip kernels
else
    # CUDA cases only (the interpreter cases are CI's); -rs lists skips: a skipped CUDA case is a failure here.
    part kernels 80 "$PY" -m pytest tests/test_kernels.py -q -rs -p no:cacheprovider -k "cuda" \
        --junitxml "$OUT_DIR/test_kernels_gpu.xml"
    if grep -q "SKIPPED" "$OUT_DIR/kernels.log"; then
        echo "kernels: CUDA cases were skipped: the check did not run on the GPU" | tee -a "$SUMMARY"; status=1
    fi
    part random 30 "$PY" -m pytest tests/test_random.py -q -rs -p no:cacheprovider -k "triton or philox or cuda" \
        --junitxml "$OUT_DIR/test_random_gpu.xml"
fi

part pack 45 "$PY" benchmarks/gpu_check.py --part pack --out "$OUT_DIR" $DRY
part step 85 "$PY" benchmarks/gpu_check.py --part step --out "$OUT_DIR" $DRY
part nccl2 75 "$PY" benchmarks/gpu_check.py --part nccl2 --timeout 65 --out "$OUT_DIR" $DRY
part conv 45 "$PY" benchmarks/gpu_check.py --part conv --out "$OUT_DIR" $DRY

echo "outputs in $OUT_DIR; status $status"
cat "$SUMMARY"
exit $status
