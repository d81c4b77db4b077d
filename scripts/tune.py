"""A/B a tuned plan constant: the benchmark sweep with the constant at each value, side by side.

    python scripts/tune.py FWD_REG_ITEMS=8,4 [--dtype bfloat16] [--n 768,1024,5120]
        [--log2-elements 27] [--direction forward] [--rounds 3]

The constant is one of cupyln/_plans' (forward, backward, jagged, common). Each round
times every value in turn in one process (cached plans and kernels are dropped between
values), and the table shows each width's best GB/s of the rounds per value and the change
against the first value. That is the A/B docs/tuning.md records for each constant; the
jagged constants take ``--jagged``, which runs the jagged sweep instead.
"""

import argparse
import ast
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cupyln import _control, bench  # noqa: E402


def sweep(args, directions):
    """{(N, direction): GB/s} of one sweep at the current constants."""
    if args.jagged:
        _, rows = bench.run_jagged((args.dtype,))
        out = {}
        for r in rows:
            if r["provider"] == "cupyln":
                for d in directions:
                    out[((r["B"], r["D"]), d)] = r[("fwd" if d == "forward" else "bwd") + "_GBs"]
        return out
    ns = tuple(int(v) for v in args.n.split(",")) if args.n else bench.DEFAULT_NS
    _, rows = bench.run(args.dtype, 2**args.log2_elements, ns, False, None, False, directions)
    out = {}
    for r in rows:
        for d, gbs in (("forward", r.fwd_GBs), ("backward", r.bwd_GBs)):
            if gbs is not None:
                out[(r.N, d)] = gbs
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("setting", help="NAME=value1,value2,... (Python literals)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", default="", help="widths (default: the benchmark's)")
    p.add_argument("--log2-elements", type=int, default=27)
    p.add_argument("--direction", choices=("forward", "backward", "both"), default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jagged", action="store_true", help="the jagged sweep")
    args = p.parse_args()
    name, _, values = args.setting.partition("=")
    values = [ast.literal_eval(v) for v in values.split(",")]
    try:
        original = _control.set_plan_constant(name, values[0])
    except KeyError as e:
        sys.exit(str(e))
    directions = bench.DIRECTIONS if args.direction == "both" else (args.direction,)
    best: dict = {}
    try:
        for _ in range(args.rounds):
            for v in values:
                _control.set_plan_constant(name, v)
                for key, gbs in sweep(args, directions).items():
                    best[(v, key)] = max(best.get((v, key), 0.0), gbs)
    finally:
        _control.set_plan_constant(name, original)
    keys = sorted({k for _, k in best})
    print(f"{name}, {args.dtype}, best of {args.rounds}, GB/s")
    print(f"{'N':>8} {'dir':>9} " + " ".join(f"{str(v):>16}" for v in values))
    for key in keys:
        base = best[(values[0], key)]
        cells = [f"{best[(v, key)]:7.0f} ({best[(v, key)] / base - 1:+6.1%})" for v in values]
        print(f"{key[0]:>8} {key[1]:>9} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
