"""A/B of this tree against an older cupyln package on one GPU, old and new alternating in fresh
processes: the kernels (``cupyln bench --no-torch --json`` for each norm and dtype, the best of
``--runs`` per cell, each cell's change printed) and the host time per call (``cupyln bench
--overhead``, the minimum of ``--runs`` per line; cupyln's torch fwd+bwd is also given over the
floor measured in the same process, torch's kernels in a Python autograd.Function, which cancels
the host's state between processes).

    mkdir OLD && git archive REV cupyln | tar -x -C OLD     # the older package, in OLD/cupyln
    python scripts/ab.py OLD [--norms ln,rms] [--dtypes bfloat16] [--runs 2] [--budget 500]

``--budget`` (seconds for the kernel A/B) skips the pairs that would end past it, so that the
host-time A/B (about a minute and a half) still runs inside a machine's time limit."""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

NEW = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^host time per (.*?)(?: \(4 x 64 float32\))?: ([\d.]+) us$")
FLOOR = "call, torch kernels in a Python autograd.Function, fwd+bwd"
OURS = "call, cupyln.torch.layer_norm, fwd+bwd"
RATIO = "cupyln.torch fwd+bwd over the autograd.Function floor"


def cupyln(tree: str, *args: str, timeout: float = 300) -> str:
    """``python -m cupyln ARGS`` on the package in ``tree``; its stdout ('' on failure)."""
    env = dict(os.environ, PYTHONPATH=tree)
    try:
        r = subprocess.run([sys.executable, "-m", "cupyln", *args], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"  timed out: {tree} {' '.join(args)}", flush=True)
        return ""
    if r.returncode:
        print(f"  failed: {tree} {' '.join(args)}\n{r.stderr[-2000:]}", flush=True)
    return r.stdout


def kernels(old: str, norm: str, dtype: str, runs: int) -> None:
    best = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for side, tree in (("old", old), ("new", NEW)):
                path = os.path.join(tmp, f"{side}{i}.json")
                cupyln(tree, "bench", "--no-torch", "--norm", norm, "--dtype", dtype, "--json",
                       path)  # fmt: skip
                if not os.path.exists(path):
                    continue
                with open(path) as f:
                    rows = json.load(f)["rows"]
                for r in rows:
                    for key in ("fwd_GBs", "bwd_GBs"):
                        if r["provider"] == "cupyln" and r.get(key):
                            cell = (r["N"], key[:3])
                            best[side][cell] = max(best[side].get(cell, 0.0), r[key])
    cells = [
        f"{n}{d[0]} {best['new'][(n, d)] / v - 1:+.1%}"
        for (n, d), v in sorted(best["old"].items())
        if (n, d) in best["new"]
    ]
    print(f"{norm:7s} {dtype:8s} " + "  ".join(cells), flush=True)


def overhead(old: str, runs: int) -> None:
    lows: dict = {"old": {}, "new": {}}
    ratios: dict = {"old": [], "new": []}
    for _ in range(runs):
        for side, tree in (("old", old), ("new", NEW)):
            got = {}
            for line in cupyln(tree, "bench", "--overhead").splitlines():
                m = LINE.match(line.strip())
                if m:
                    got[m.group(1)] = float(m.group(2))
            if FLOOR in got and OURS in got:
                got[RATIO] = got[OURS] / got[FLOOR]
            for k, v in got.items():
                lows[side][k] = min(lows[side].get(k, v), v)
            if RATIO in got:
                ratios[side].append(got[RATIO])
    for k, v in lows["old"].items():
        if k in lows["new"]:
            print(f"{k:72s} old {v:8.3f}  new {lows['new'][k]:8.3f}", flush=True)
    if ratios["old"] and ratios["new"]:
        old_r, new_r = (statistics.median(ratios[s]) for s in ("old", "new"))
        print(f"{'the same ratio, median of the processes':72s} old {old_r:8.3f}  new {new_r:8.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="a folder holding the older package as cupyln/")
    p.add_argument("--norms", default="ln,rms,add_rms,add_ln")
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--runs", type=int, default=2, help="alternations (best / minimum of them)")
    p.add_argument("--budget", type=float, default=0, help="seconds; 0: no limit")
    a = p.parse_args()
    old = os.path.abspath(a.old)
    if not os.path.isdir(os.path.join(old, "cupyln")):
        print(f"{old} holds no cupyln/ package", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    spent_per_pair = 0.0
    for norm in filter(None, a.norms.split(",")):  # --norms "": the host time alone
        for dtype in a.dtypes.split(","):
            start = time.monotonic()
            if a.budget and start - t0 + spent_per_pair > a.budget:
                print(f"{norm:7s} {dtype:8s} skipped: past the budget", flush=True)
                continue
            kernels(old, norm, dtype, a.runs)
            spent_per_pair = max(spent_per_pair, time.monotonic() - start)
    overhead(old, max(a.runs, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
