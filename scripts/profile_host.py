"""Where the per-call host time goes: cProfile of many warm calls on tiny arrays (4 x 64),
for the CuPy API and the torch bridge; prints the top functions by own time.
    python scripts/profile_host.py [calls]"""

import cProfile
import pstats
import sys

import cupy

import cupyln
from cupyln import bench_frameworks, reference


def profile(name, fn, calls):
    for _ in range(200):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    cupy.cuda.runtime.deviceSynchronize()
    print(f"== {name}: {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main(calls: int) -> None:
    x = reference.sample((4, 64), "float32", seed=0)
    w = reference.sample((64,), "float32", seed=1)
    dy = reference.sample((4, 64), "float32", seed=2)
    _, mean, rstd = cupyln.forward(x, w, w)
    profile("cupyln.forward", lambda: cupyln.forward(x, w, w), calls)
    profile("cupyln.backward", lambda: cupyln.backward(dy, x, w, mean, rstd), calls)
    try:
        import torch

        import cupyln.torch as clt
    except ImportError:
        return
    tx = torch.randn(4, 64, device="cuda")
    tw = torch.randn(64, device="cuda")
    profile("cupyln.torch.layer_norm, no grad", lambda: clt.layer_norm(tx, (64,), tw, tw), calls)
    txg = tx.clone().requires_grad_()
    tdy = torch.randn(4, 64, device="cuda")
    profile("cupyln.torch.layer_norm, fwd+bwd",
            lambda: clt.layer_norm(txg, (64,), tw, tw).backward(tdy), calls)  # fmt: skip
    for k, v in bench_frameworks.host_overhead_us().items():
        print(f"host time per {k}: {v:.1f} us")
    for k, v in bench_frameworks.torch_overhead_us().items():
        print(f"host time per call, {k}: {v:.1f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
