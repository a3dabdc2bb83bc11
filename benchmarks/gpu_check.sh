#!/usr/bin/env bash
# The first GPU run, for one CUDA machine: ONE command, at most 6.5 minutes in all (GPU_CHECK_SECONDS, default 390),
# the install and every cold compile included. Each part runs under `timeout` with its budget cut to what is left
# of the whole, so the script ends inside its bound even when a part hangs; a killed part loses only itself.
#
#   part      budget  what
#   install    30 s   make halo.kernels importable (the repo's link, else `pip install -e . --no-deps`), inside the bound
#   env        20 s   torch / CUDA / triton versions, the device
#   kernels    80 s   every Triton kernel vs its torch reference at FIXED shapes (no hypothesis: ~30 cold compiles),
#                     Philox draws and dropout, offsets beyond 2**31 elements
#   pack       40 s   pack / unpack / 1-rank exchange at 181x1440 and 721x1440, 64 / 256 ch, bf16, vs copy_ and
#                     F.pad: 50 back-to-back calls and one CUDA graph of 50 calls (device ms, host us apart)
#   step       85 s   1 rank: 16 steady steps checked for host syncs (two periods of the every-8th replicated
#                     check), whole-step graph vs eager, per-module make_graphed_callables, bf16 autocast vs
#                     unsharded, inductor on channels_last
#   nccl2      75 s   2 ranks on the one GPU, real NCCL (NCCL_HOSTID per rank, NCCL_IB_DISABLE=1, loopback):
#                     host groups, torch-version paths (2.11's and the current one's), check_equivalence on CUDA,
#                     16 sync-free steady steps, p2p inside a captured graph
#   conv       40 s   DomainConv2d vs nn.Conv2d at 181 / 721 rows x 1440, bf16, 64 / 256 ch, eager and graph-replayed
#   total     370 s   (+ packing the archive after each part)
#
# Results: the runner keeps only a few files, so everything (per-part json, logs, rank logs) is written to a work
# folder and packed into ONE archive, $OUT/gpu_check.tar.gz, re-packed after every part (a kill of the whole command
# keeps what ran); beside it $OUT/gpu_check_summary.txt (one line per part: name, verdict, exit code, seconds) and
# $OUT/gpu_check.jsonl (one line per part's report): three files.
# Usage: bash benchmarks/gpu_check.sh [--dry-run]      (PYTHON=... picks the interpreter; default python3)
#   --dry-run: every part on the CPU (gloo, tiny sizes, Triton's interpreter) under the same bounds; what needs
#   CUDA reports "skipped: no CUDA". CI runs it (tests/test_gpu_check_dryrun.py).
set -uo pipefail
export PYTHONUNBUFFERED=1

DRY=""
if [ "${1:-}" = "--dry-run" ]; then
    DRY="--dry-run"
    export TRITON_INTERPRET=0  # CPU tensors take the reference unless a check asks for Triton (then interpreted)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny shapes on a shared CPU: one thread, no spinning
fi
TOTAL="${GPU_CHECK_SECONDS:-390}"
START=$SECONDS
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-benchmarks/out}"
mkdir -p "$OUT_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/halo_gpu_check.XXXXXX")"
SUMMARY="$WORK/gpu_check_summary.txt"
: > "$SUMMARY"
status=0

# pack_results: the work folder into one archive in $OUT (written aside, then renamed: never half an archive)
pack_results() {
    tar -czf "$OUT_DIR/gpu_check.tar.gz.part" -C "$WORK" . 2>/dev/null && mv -f "$OUT_DIR/gpu_check.tar.gz.part" \
        "$OUT_DIR/gpu_check.tar.gz"
    cp -f "$SUMMARY" "$OUT_DIR/gpu_check_summary.txt"
    [ -f "$WORK/gpu_check.jsonl" ] && cp -f "$WORK/gpu_check.jsonl" "$OUT_DIR/gpu_check.jsonl"
    return 0
}
trap pack_results EXIT

left() { echo $((TOTAL - (SECONDS - START))); }

# part NAME BUDGET_S COMMAND...: under `timeout` (its budget, or what is left of the whole minus a margin for the
# parts' kill and the archive), logged to NAME.log, one summary line when it ends, the archive re-packed.
part() {
    local name=$1 budget=$2
    shift 2
    local t0=$SECONDS rest
    rest=$(($(left) - 8))
    [ "$rest" -lt "$budget" ] && budget=$rest
    if [ "$budget" -lt 5 ]; then
        echo "$name skipped: out-of-time rc=0 0s" | tee -a "$SUMMARY"
        status=1
        return
    fi
    echo "== $name (<= ${budget} s; $(left) s left of ${TOTAL}) =="
    export GPU_CHECK_PART_BUDGET=$budget  # (nccl2 bounds its two ranks inside it)
    timeout --kill-after=3 "$budget" "$@" 2>&1 | tee "$WORK/$name.log"
    local rc=${PIPESTATUS[0]}
    local verdict=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then verdict="timed-out"; elif [ "$rc" -ne 0 ]; then verdict=FAILED; fi
    [ "$verdict" = ok ] || status=1
    echo "$name $verdict rc=$rc $((SECONDS - t0))s" | tee -a "$SUMMARY"
    pack_results
}

# install: halo.kernels is the top-level kernels/ (a link in a checkout, an editable install otherwise), made
# importable inside the bound: the link where it is missing (no Python start), pip only if the import still fails
install_kernels() {
    if [ -d kernels ] && [ ! -e halo/kernels ]; then
        ln -s ../kernels halo/kernels && echo "linked halo/kernels -> ../kernels"
    fi
    [ -e halo/kernels ] && { echo "halo/kernels present"; return 0; }
    echo "installing the repo in editable mode (no dependencies)"
    "$PY" -m pip install -q -e . --no-deps --no-build-isolation
}
export -f install_kernels
export PY
part install 30 bash -c install_kernels

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

for p in kernels:80 pack:40 step:85 nccl2:75 conv:40; do
    # shellcheck disable=SC2086  # $DRY: empty or one option
    part "${p%%:*}" "${p##*:}" "$PY" benchmarks/gpu_check.py --part "${p%%:*}" --out "$WORK" $DRY
done

echo "results in $OUT_DIR/gpu_check.tar.gz (+ gpu_check_summary.txt, gpu_check.jsonl); $((SECONDS - START)) s of" \
     "${TOTAL}; status $status"
cat "$SUMMARY"
exit $status
