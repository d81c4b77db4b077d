#!/usr/bin/env bash
# The GPU record: the test suite (all but the CPU-only NVRTC sweep, which CI runs), `python -m
# cupyln check` and the benchmarks, on a machine with a GPU and the packages installed (nothing
# is fetched). Writes $OUT (default ./.out)/pytest.log, bench.log, bench_bf16.json and
# jagged.json; prints a short summary last. QUANT=1: the quantized outputs' table instead of the
# other benchmarks (each format beside the plain norm, RMSNorm and add+RMSNorm; torch.compile's
# fused norm and quantization beside fp8_row and mxfp8).
#   [QUANT=1] scripts/gpu-suite.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m cupyln info
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 16" || echo "")
timeout 420 python3 -m pytest -q -rs $workers --durations=10 -p no:cacheprovider \
  -m "not sweep" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
if [ "${QUANT:-0}" = 1 ]; then
  {
    python3 -m cupyln check
    for q in fp8 fp8_row fp8_block mxfp8 nvfp4; do
      python3 -m cupyln bench --quant $q --norm rms
      python3 -m cupyln bench --quant $q --norm add_rms --n 1024,4096,16384
    done
    for q in fp8_row mxfp8; do
      python3 -m cupyln bench --quant $q --peers --norm rms --n 1024,4096,16384
    done
  } 2>&1 | tee "$OUT/bench.log" | grep -v "it/s\|width/s"
else
  {
    python3 -m cupyln check
    python3 -m cupyln bench -v --dtype bfloat16 --json "$OUT/bench_bf16.json"
    python3 -m cupyln bench --overhead
    python3 -m cupyln bench --train
    python3 -m cupyln bench --jax
    python3 -m cupyln bench --jagged --json "$OUT/jagged.json"
  } 2>&1 | tee "$OUT/bench.log" | grep -v "it/s\|width/s"
fi
echo "== summary =="
grep -E "passed|failed" "$OUT/pytest.log" | tail -1
grep -E "^check" "$OUT/bench.log"
