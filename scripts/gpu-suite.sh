#!/usr/bin/env bash
# The GPU record: the whole test suite, `python -m cupyln check`, the bandwidth sweep, the host
# overhead, the jagged sweep and the training-step comparison on a machine with a GPU and the
# packages already installed (nothing is fetched). Logs and JSON go to $OUT (default ./.out); a
# short summary is printed last.
#   scripts/gpu-suite.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m cupyln info
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 16" || echo "")
timeout 420 python3 -m pytest -q -rs $workers --durations=10 -p no:cacheprovider "$@" 2>&1 \
  | tee "$OUT/pytest.log" | tail -40
python3 -m cupyln check 2>&1 | tee "$OUT/check.log" | tail -3
python3 -m cupyln bench -v --dtype bfloat16 --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench.log"
{
  python3 -m cupyln bench --overhead
  python3 -m cupyln bench --train
  python3 -m cupyln bench --jagged --json "$OUT/jagged.json"
} 2>&1 | tee "$OUT/extra.log"
echo "== summary =="
grep -E "passed|failed" "$OUT/pytest.log" | tail -1
tail -1 "$OUT/check.log"
