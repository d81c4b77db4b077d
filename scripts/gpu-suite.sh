#!/usr/bin/env bash
# The GPU record: the whole test suite, `python -m cupyln check` and the bandwidth sweep on a
# machine with a GPU and the packages already installed (nothing is fetched). Logs and JSON go to
# $OUT (default ./.out); a short table is printed last.
#   scripts/gpu-suite.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -m cupyln info
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
python3 -m pytest -q -rs $workers --durations=10 "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
python3 -m cupyln check 2>&1 | tee "$OUT/check.log"
python3 -m cupyln bench -v --dtype bfloat16 --json "$OUT/bench_bf16.json" 2>&1 | tee "$OUT/bench.log"
echo "== summary =="
grep -E "passed|failed" "$OUT/pytest.log" | tail -1
tail -1 "$OUT/check.log"
