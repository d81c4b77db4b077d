"""Bandwidth benchmark: cupyln forward/backward against the device-to-device copy.

Bytes as the Triton tutorial counts them: forward 2*M*N*itemsize (read x, write y), backward
3*M*N*itemsize (read x and dy, write dx). Each timing is the median of CUDA-event timings of
single calls, with the L2 cache flushed (a 256 MiB buffer overwritten) before every call.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy

from . import _api
from . import reference as ref

DEFAULT_NS = (512, 768, 1000, 1024, 2048, 4096, 5120, 8192, 12288, 16384, 32768, 65536)


@dataclass
class Row:
    provider: str
    dtype: str
    M: int
    N: int
    fwd_ms: float
    bwd_ms: float
    fwd_GBs: float
    bwd_GBs: float
    fwd_of_copy: float
    bwd_of_copy: float
    kernels: str = ""


def time_ms(fn: Callable[[], object], reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current stream, L2 flushed before each call."""
    import cupy

    flush = cupy.empty(256 * 2**20 // 4, dtype=cupy.int32)
    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        flush.fill(0)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy GB/s, counting bytes read plus bytes written."""
    import cupy

    a = cupy.ones(nbytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    t = time_ms(lambda: b.__setitem__(Ellipsis, a), reps=20)
    return 2 * nbytes / t * 1e-6


def _torch_provider():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def fwd(x, w, b, eps):
        return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], w, b, eps)

    def bwd(dy, x, w, b, mean, rstd):
        return torch.ops.aten.native_layer_norm_backward(
            dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True]
        )

    return torch, fwd, bwd


def _inputs(m: int, n: int, dtype):
    x = ref.sample((m, n), dtype, seed=n)
    w = ref.sample((n,), dtype, loc=1.0, scale=0.2, seed=n + 1)
    b = ref.sample((n,), dtype, loc=0.0, scale=0.2, seed=n + 2)
    dy = ref.sample((m, n), dtype, loc=0.0, scale=1.0, seed=n + 3)
    return x, w, b, dy


def _time_cupyln(x, w, b, dy):
    _, mean, rstd = _api.forward(x, w, b)
    return (
        time_ms(lambda: _api.forward(x, w, b)),
        time_ms(lambda: _api.backward(dy, x, w, mean, rstd)),
    )


def _time_torch(tp, x, w, b, dy):
    torch, fwd, bwd = tp
    tx, tw, tb, tdy = (torch.from_dlpack(a) for a in (x, w, b, dy))
    _, mean, rstd = fwd(tx, tw, tb, 1e-5)
    return (
        time_ms(lambda: fwd(tx, tw, tb, 1e-5)),
        time_ms(lambda: bwd(tdy, tx, tw, tb, mean, rstd)),
    )


def run(
    dtype="bfloat16",
    elements: int = 2**27,
    ns=DEFAULT_NS,
    with_torch: bool = True,
    progress: Callable[[Row], None] | None = None,
):
    """Sweep N at M = elements // N; returns (copy GB/s, [Row]) for cupyln (and torch)."""
    import cupy

    dtype = numpy.dtype(dtype)
    copy = copy_bandwidth()
    rows = []
    tp = _torch_provider() if with_torch else None
    for n in ns:
        m = max(1, elements // n)
        data = _inputs(m, n, dtype)
        results = [("cupyln", *_time_cupyln(*data))]
        if tp is not None:
            results.append(("torch", *_time_torch(tp, *data)))
        nbytes = m * n * dtype.itemsize
        shapes = _api.describe(*data[:3])
        kernels = f"fwd: {shapes['forward']}; bwd: {shapes['backward']}"
        for name, f_ms, b_ms in results:
            fg, bg = 2 * nbytes / f_ms * 1e-6, 3 * nbytes / b_ms * 1e-6
            row = Row(name, dtype.name, m, n, f_ms, b_ms, fg, bg, fg / copy, bg / copy)
            if name == "cupyln":
                row.kernels = kernels
            rows.append(row)
            if progress is not None:
                progress(row)
        del data
        cupy.get_default_memory_pool().free_all_blocks()
    return copy, rows


def host_overhead_us(calls: int = 5000) -> dict:
    """CPU microseconds per call of forward / backward on tiny arrays (4 x 64 float32), warm:
    what the Python layer costs on top of the launch, measured over many calls."""
    import time

    import cupy

    x = ref.sample((4, 64), "float32", seed=0)
    w = ref.sample((64,), "float32", seed=1)
    dy = ref.sample((4, 64), "float32", seed=2)
    _, mean, rstd = _api.forward(x, w, w)
    out = {}
    for name, fn in (
        ("forward", lambda: _api.forward(x, w, w)),
        ("backward", lambda: _api.backward(dy, x, w, mean, rstd)),
    ):
        for _ in range(100):
            fn()
        cupy.cuda.get_current_stream().synchronize()
        t = time.process_time()
        for _ in range(calls):
            fn()
        out[name] = (time.process_time() - t) / calls * 1e6
        cupy.cuda.get_current_stream().synchronize()
    return out


def as_dicts(rows):
    return [r if isinstance(r, dict) else asdict(r) for r in rows]


def plot(rows, path, copy_gbs=None, title=""):
    """Write a PNG of GB/s against N (log scale), forward and backward side by side, one line
    per provider, the copy bandwidth as a dashed ceiling. ``rows``: Rows or their dicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = as_dicts(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (key, name) in zip(axes, (("fwd", "forward"), ("bwd", "backward"))):
        for provider in dict.fromkeys(r["provider"] for r in rows):
            rs = sorted((r for r in rows if r["provider"] == provider), key=lambda r: r["N"])
            ax.plot([r["N"] for r in rs], [r[f"{key}_GBs"] for r in rs], marker="o",
                    label=provider)  # fmt: skip
        if copy_gbs:
            ax.axhline(copy_gbs, ls="--", color="gray", label=f"copy {copy_gbs:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("N (row width)")
        ax.set_title(f"{name} {title}".strip())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
