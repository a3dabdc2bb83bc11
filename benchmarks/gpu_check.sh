#!/usr/bin/env bash
# The GPU check, for one CUDA machine: one prepared run, at most ~8 minutes (each part bounded by `timeout`).
#   1. tests/test_kernels.py: every Triton-vs-reference test runs compiled on CUDA (and through the
#      interpreter on CPU), plus the > 2**31-element int64-offset test;                         (<= 210 s)
#   1b. tests/test_random.py's Philox kernel tests on CUDA, benchmarks/dropout.py --quick       (<= 180 s)
#   2. benchmarks/gpu_check.py: a converted model's steady training step under
#      torch.cuda.set_sync_debug_mode("error") (no host sync) with no tensor read or built from data; CUDA-graph
#      capture and replay of its forward + backward; torch.compile(fullgraph=True, inductor); HaloConv2d vs
#      nn.Conv2d fwd + bwd time on the same local shape (bf16, 721 x 1440);                    (<= 180 s)
#   3. benchmarks/pack_kernels.py --quick: Triton vs torch reference vs copy, 1 and 64 MB (full: 1 MB .. 1 GB,
#      by hand);                                                                                  (<= 150 s)
# Outputs (logs, junit xml, gpu_check.json, benchmark table, CSV, PNG, environment) go to $OUT if set, else
# benchmarks/out. Needs the repo pip-installed (pip install -e .) or importable; if `import halo.kernels`
# fails, it tries `pip install -e . --no-deps --no-build-isolation` (works offline).
# Usage: bash benchmarks/gpu_check.sh        (PYTHON=/path/to/python to pick the interpreter)
set -uo pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT_DIR="${OUT:-benchmarks/out}"
mkdir -p "$OUT_DIR"
status=0

if ! "$PY" -c "import halo.kernels" 2>/dev/null; then
    echo "halo.kernels is not importable: installing the repo in editable mode (no dependencies)"
    "$PY" -m pip install -q -e . --no-deps --no-build-isolation || { echo "install failed"; exit 2; }
fi

"$PY" - <<'EOF' | tee "$OUT_DIR/gpu_check_env.txt"
import os, torch
import halo.kernels as hk
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton:", hk.HAS_TRITON, hk.TRITON_IMPORT_ERROR or "")
if hk.HAS_TRITON:
    import triton
    print("triton", triton.__version__, "| TRITON_INTERPRET =", os.environ.get("TRITON_INTERPRET"))
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible: this script is the GPU check")
print("device", torch.cuda.get_device_name(), "| backend for a CUDA tensor:", hk.backend_for(torch.zeros(1, device="cuda")))
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 3

echo "== 1/3 kernel tests (CUDA compiled + CPU interpreter) =="
# The CUDA cases use the compiled kernels whatever TRITON_INTERPRET says (halo.kernels builds both).
timeout 210 "$PY" -m pytest tests/test_kernels.py -q -rs -p no:cacheprovider --durations=10 \
    --junitxml "$OUT_DIR/test_kernels_gpu.xml" 2>&1 | tee "$OUT_DIR/test_kernels_gpu.log"
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -eq 0 ] || { echo "kernel tests FAILED (rc $test_rc)"; status=1; }
if grep -q "SKIPPED.*no CUDA device" "$OUT_DIR/test_kernels_gpu.log"; then
    echo "CUDA cases were skipped: the check did not run on the GPU"; status=1
fi

echo "== 1b/3 sharding-invariant randomness: Philox kernel vs reference on CUDA, dropout vs torch's =="
timeout 120 "$PY" -m pytest tests/test_random.py -q -rs -p no:cacheprovider -k "triton or philox or reference_path" \
    2>&1 | tee "$OUT_DIR/test_random_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "random tests FAILED"; status=1; }
timeout 60 "$PY" benchmarks/dropout.py --quick --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/dropout_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "dropout benchmark FAILED"; status=1; }

echo "== 2/3 converted model on the GPU: sync-free step, CUDA graph, inductor, HaloConv2d vs conv =="
timeout 180 "$PY" benchmarks/gpu_check.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gpu_check.txt"
check_rc=${PIPESTATUS[0]}
[ "$check_rc" -eq 0 ] || { echo "gpu_check.py FAILED (rc $check_rc)"; status=1; }

echo "== 3/3 pack benchmark =="
timeout 150 "$PY" benchmarks/pack_kernels.py --quick --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/pack_kernels_gpu.txt"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" -eq 0 ] || { echo "benchmark FAILED (rc $bench_rc)"; status=1; }

# The target: unpack into an extended buffer at >= 85 % of copy bandwidth for activations >= 64 MB.
"$PY" - "$OUT_DIR/pack_kernels.csv" <<'EOF' || status=1
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
last = rows[-1]["date"] if rows else None  # this run's rows: the CSV accumulates runs
rows = [r for r in rows if r["date"] == last and r["impl"] == "triton" and r["op"] == "unpack"
        and int(r["bytes"]) >= 64 * 2**20]
worst = min(rows, key=lambda r: float(r["frac_copy"])) if rows else None
if worst is None:
    sys.exit("no triton unpack rows >= 64 MB in the CSV")
print(f"unpack >= 64 MB: worst {float(worst['frac_copy']):.2f} of copy bandwidth ({worst['layout']}, "
      f"{int(worst['bytes']) >> 20} MB, width {worst['width']}); target 0.85")
sys.exit(0 if float(worst["frac_copy"]) >= 0.85 else 1)
EOF

echo "outputs in $OUT_DIR; status $status"
exit $status
