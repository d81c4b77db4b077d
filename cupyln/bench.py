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
DIRECTIONS = ("forward", "backward")


@dataclass
class Row:
    """One provider at one width; a direction the run left out has None in its four fields."""

    provider: str
    dtype: str
    M: int
    N: int
    fwd_ms: float | None
    bwd_ms: float | None
    fwd_GBs: float | None
    bwd_GBs: float | None
    fwd_of_copy: float | None
    bwd_of_copy: float | None
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


def _compile_provider():
    """torch.compile (Inductor) of aten's layer norm forward and backward: Inductor decomposes
    both and generates its own Triton kernels. None without torch/CUDA."""
    tp = _torch_provider()
    if tp is None:
        return None
    torch, fwd, bwd = tp
    return torch, torch.compile(fwd, dynamic=False), torch.compile(bwd, dynamic=False)


def _inputs(m: int, n: int, dtype):
    x = ref.sample((m, n), dtype, seed=n)
    w = ref.sample((n,), dtype, loc=1.0, scale=0.2, seed=n + 1)
    b = ref.sample((n,), dtype, loc=0.0, scale=0.2, seed=n + 2)
    dy = ref.sample((m, n), dtype, loc=0.0, scale=1.0, seed=n + 3)
    return x, w, b, dy


def _time_cupyln(x, w, b, dy, directions=DIRECTIONS):
    _, mean, rstd = _api.forward(x, w, b)  # (the backward's statistics)
    return (
        time_ms(lambda: _api.forward(x, w, b)) if "forward" in directions else None,
        time_ms(lambda: _api.backward(dy, x, w, mean, rstd)) if "backward" in directions else None,
    )


def _time_torch(tp, x, w, b, dy, directions=DIRECTIONS):
    torch, fwd, bwd = tp
    tx, tw, tb, tdy = (torch.from_dlpack(a) for a in (x, w, b, dy))
    _, mean, rstd = fwd(tx, tw, tb, 1e-5)
    return (
        time_ms(lambda: fwd(tx, tw, tb, 1e-5)) if "forward" in directions else None,
        time_ms(lambda: bwd(tdy, tx, tw, tb, mean, rstd)) if "backward" in directions else None,
    )


#: the norms the sweep times: bytes forward and backward as multiples of M * N * itemsize (the
#: contract's: read x / write y; read x and dy / write dx; with a residual add, x and residual
#: in / y and h out, and h, dy, dh in / dx out)
NORMS = {"ln": (2, 3), "rms": (2, 3), "add_rms": (4, 4), "add_ln": (4, 4)}


def _time_family(norm, x, w, b, dy, directions=DIRECTIONS):
    """(forward ms, backward ms) of a family member through the CuPy API: RMSNorm, or the
    residual add in front of RMSNorm or LayerNorm (the backward with dh)."""

    fwd, bwd = "forward" in directions, "backward" in directions
    if norm == "rms":
        _, rstd = _api.rms_forward(x, w)
        return (
            time_ms(lambda: _api.rms_forward(x, w)) if fwd else None,
            time_ms(lambda: _api.rms_backward(dy, x, w, rstd)) if bwd else None,
        )
    r = ref.sample(x.shape, x.dtype, loc=0.3, scale=1.0, seed=x.shape[-1] + 4)
    if norm == "add_rms":
        _, rstd, h = _api.rms_forward(x, w, residual=r)
        return (
            time_ms(lambda: _api.rms_forward(x, w, residual=r)) if fwd else None,
            time_ms(lambda: _api.rms_backward(dy, h, w, rstd, dh=r)) if bwd else None,
        )
    _, mean, rstd, h = _api.forward(x, w, b, residual=r)
    return (
        time_ms(lambda: _api.forward(x, w, b, residual=r)) if fwd else None,
        time_ms(lambda: _api.backward(dy, h, w, mean, rstd, dh=r)) if bwd else None,
    )


def _gbs(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None else nbytes / ms * 1e-6


def run(
    dtype="bfloat16",
    elements: int = 2**27,
    ns=DEFAULT_NS,
    with_torch: bool = True,
    progress: Callable[[Row], None] | None = None,
    with_compile: bool = False,
    directions=DIRECTIONS,
    norm: str = "ln",
):
    """Sweep N at M = elements // N; returns (copy GB/s, [Row]) for cupyln, torch and (with
    ``with_compile``, about 20 s of compiling per width) torch.compile, timing the
    ``directions`` named ("forward", "backward", or both: the default). ``norm``: one of
    NORMS; the family's members (not "ln") time cupyln alone (shared/bench/peers_family.py
    times them against the peers)."""
    import cupy

    directions = (directions,) if isinstance(directions, str) else tuple(directions)
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"directions: one or both of {DIRECTIONS}, got {directions!r}")
    if norm not in NORMS:
        raise ValueError(f"norm: one of {tuple(NORMS)}, got {norm!r}")
    dtype = numpy.dtype(dtype)
    copy = copy_bandwidth()
    rows = []
    family = norm != "ln"
    tp = _torch_provider() if with_torch and not family else None
    cp = _compile_provider() if with_compile and not family else None
    fwd_bytes, bwd_bytes = NORMS[norm]
    for n in ns:
        m = max(1, elements // n)
        data = _inputs(m, n, dtype)
        if family:
            results = [("cupyln", *_time_family(norm, *data, directions))]
        else:
            results = [("cupyln", *_time_cupyln(*data, directions))]
        if tp is not None:
            results.append(("torch", *_time_torch(tp, *data, directions)))
        if cp is not None:
            results.append(("torch.compile", *_time_torch(cp, *data, directions)))
        nbytes = m * n * dtype.itemsize
        kernels = norm
        if not family:
            shapes = _api.describe(*data[:3])
            kernels = "; ".join(f"{d[:3]}: {shapes[d]}" for d in DIRECTIONS if d in directions)
        for name, f_ms, b_ms in results:
            fg, bg = _gbs(fwd_bytes * nbytes, f_ms), _gbs(bwd_bytes * nbytes, b_ms)
            of_copy = [None if g is None else g / copy for g in (fg, bg)]
            row = Row(name, dtype.name, m, n, f_ms, b_ms, fg, bg, *of_copy)
            if name == "cupyln":
                row.kernels = kernels
            rows.append(row)
            if progress is not None:
                progress(row)
        del data
        cupy.get_default_memory_pool().free_all_blocks()
    return copy, rows


# ------------------------------------------------------------------ quantized output
#: quant='s operands the sweep passes (the formats that need one)
QUANT_OPERANDS = {"fp8": {"scale": 0.01}, "nvfp4": {"global_amax": 8.0}}


def quant_bytes(norm: str, m: int, n: int, dtype, quant: str) -> int:
    """Bytes of a forward whose y is quantized: x (and the residual) read, h written, the
    elements and scales written (the statistics, M values, left out as the sweep's are)."""
    from . import _formats

    s = _formats.spec(quant, n)
    (dshape, _), sc = _formats.outputs(s, (m, n))
    x_bytes = m * n * dtype.itemsize
    nbytes = x_bytes * (3 if norm.startswith("add") else 1)  # x, or x, residual and h
    nbytes += int(numpy.prod(dshape))
    if sc is not None:
        nbytes += int(numpy.prod(sc[0])) * numpy.dtype(sc[1]).itemsize
    return nbytes


def _norm_call(norm: str, m: int, n: int, dtype):
    """The CuPy API's forward of ``norm`` on fresh rows of M x N, taking keywords."""
    x, w, b, _ = _inputs(m, n, dtype)
    r = ref.sample(x.shape, dtype, loc=0.3, scale=1.0, seed=n + 4)
    return {
        "ln": lambda **k: _api.forward(x, w, b, **k),
        "rms": lambda **k: _api.rms_forward(x, w, **k),
        "add_rms": lambda **k: _api.rms_forward(x, w, residual=r, **k),
        "add_ln": lambda **k: _api.forward(x, w, b, residual=r, **k),
    }[norm]


def run_quant(quant: str, dtype="bfloat16", elements: int = 2**27, ns=DEFAULT_NS, norm="rms",
              progress: Callable[[Row], None] | None = None):  # fmt: skip
    """The forward with y quantized (``quant``) against the same norm's plain forward, at M =
    elements // N: (copy GB/s, [Row]), the quantized rows' provider "cupyln QUANT"."""
    import cupy

    if norm not in NORMS:
        raise ValueError(f"norm: one of {tuple(NORMS)}, got {norm!r}")
    dtype = numpy.dtype(dtype)
    copy = copy_bandwidth()
    rows = []
    ops = QUANT_OPERANDS.get(quant, {})
    from . import _formats

    for n in ns:
        try:
            _formats.spec(quant, n)
        except ValueError:  # a width the format does not take (N % 32, N % 16)
            continue
        m = max(1, elements // n)
        call = _norm_call(norm, m, n, dtype)
        plain_bytes = NORMS[norm][0] * m * n * dtype.itemsize
        for name, kw, nbytes in (
            ("cupyln", {}, plain_bytes),
            (f"cupyln {quant}", dict(quant=quant, **ops), quant_bytes(norm, m, n, dtype, quant)),
        ):
            ms = time_ms(lambda kw=kw, call=call: call(**kw))
            g = _gbs(nbytes, ms)
            row = Row(name, dtype.name, m, n, ms, None, g, None, g / copy, None)
            rows.append(row)
            if progress is not None:
                progress(row)
        call = None  # the rows' arrays back to the pool
        cupy.get_default_memory_pool().free_all_blocks()
    return copy, rows


# ------------------------------------------------------------------ jagged
JAGGED_SWEEP = tuple((b, d) for b in (32, 256, 2048, 16384) for d in (32, 256))


def jagged_inputs(b: int, d: int, dtype, max_seqlen: int = 128, seed: int = 0):
    """The Helion example's batches: B sequences of lengths uniform in [1, max_seqlen]."""
    import cupy

    lengths = numpy.random.default_rng(seed).integers(1, max_seqlen + 1, b)
    offsets = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int64))
    values = ref.sample((int(offsets[-1]), d), dtype, seed=seed + 1)
    dy = ref.sample(values.shape, dtype, loc=0.0, scale=1.0, seed=seed + 2)
    return values, offsets, dy


def _torch_jagged(torch):
    """(per-sequence reference, vectorized segment sums) forward implementations in torch."""
    f = torch.nn.functional

    def per_sequence(values, offsets, eps):
        o = offsets.tolist()
        parts = [values[o[i] : o[i + 1]] for i in range(len(o) - 1)]
        return torch.cat([f.layer_norm(p, p.shape, eps=eps) for p in parts])

    def vectorized(values, offsets, eps):
        nseq, d = offsets.numel() - 1, values.shape[1]
        lengths = offsets.diff()
        seg = torch.repeat_interleave(
            torch.arange(nseq, device=values.device), lengths, output_size=values.shape[0]
        )
        count = (lengths * d).clamp(min=1).float()
        xf = values.float()
        mean = torch.zeros(nseq, device=values.device).index_add_(0, seg, xf.sum(1)) / count
        xc = xf - mean[seg, None]
        var = torch.zeros(nseq, device=values.device).index_add_(0, seg, (xc * xc).sum(1))
        return (xc * torch.rsqrt(var / count + eps)[seg, None]).to(values.dtype)

    return per_sequence, vectorized


def run_jagged(dtypes=("float32", "bfloat16"), sweep=JAGGED_SWEEP, progress=None):
    """GB/s of the jagged forward (2 * bytes of values) and backward (3 *) for cupyln, the
    Helion reference (torch layer_norm per sequence) and a vectorized torch version."""
    import cupy

    copy = copy_bandwidth()
    rows = []
    try:
        import torch

        per_seq, vec = _torch_jagged(torch) if torch.cuda.is_available() else (None, None)
    except ImportError:
        per_seq = vec = None
    for dtype in dtypes:
        for b, d in sweep:
            res, total, itemsize = _jagged_case(b, d, dtype, per_seq, vec)
            nbytes = total * d * itemsize
            for name, (f_ms, b_ms) in res.items():
                fg, bg = 2 * nbytes / f_ms * 1e-6, 3 * nbytes / b_ms * 1e-6
                row = dict(provider=name, dtype=dtype, B=b, D=d, total_L=total, fwd_ms=f_ms,
                           bwd_ms=b_ms, fwd_GBs=fg, bwd_GBs=bg, fwd_of_copy=fg / copy,
                           bwd_of_copy=bg / copy)  # fmt: skip
                rows.append(row)
                if progress is not None:
                    progress(row)
            cupy.get_default_memory_pool().free_all_blocks()
    return copy, rows


def _jagged_case(b, d, dtype, per_seq, vec):
    """({provider: (forward ms, backward ms or NaN)}, total_L, itemsize) for one batch."""
    from . import _jagged

    values, offsets, dy = jagged_inputs(b, d, dtype)
    _, mean, rstd = _jagged.jagged_forward(values, offsets, max_seqlen=128)
    kw = dict(max_seqlen=128, check_offsets=False)
    res = {
        "cupyln": (
            time_ms(lambda: _jagged.jagged_forward(values, offsets, **kw)),
            time_ms(lambda: _jagged.jagged_backward(dy, values, offsets, None, mean, rstd, **kw)),
        )
    }
    if vec is not None:
        import torch

        tv, to = torch.from_dlpack(values), torch.from_dlpack(offsets)
        res["torch vectorized"] = (time_ms(lambda: vec(tv, to, 1e-6)), float("nan"))
        if b <= 2048:  # the per-sequence loop costs seconds at B = 16384
            t = time_ms(lambda: per_seq(tv, to, 1e-6), reps=5, warmup=1)
            res["torch per sequence"] = (t, float("nan"))
    return res, values.shape[0], values.itemsize


def as_dicts(rows):
    return [r if isinstance(r, dict) else asdict(r) for r in rows]


def plot(rows, path, copy_gbs=None, title=""):
    """Write ``figure(rows, copy_gbs, title)`` to the PNG ``path`` (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(rows, copy_gbs, title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _timed(gbs) -> bool:
    """A measured GB/s: None where a direction was not timed, NaN where a provider has none."""
    return gbs is not None and gbs == gbs


def figure(rows, copy_gbs=None, title=""):
    """GB/s against N (log scale), forward and backward side by side (either alone where the
    rows time one direction), one line per provider, the copy bandwidth as a dashed ceiling.
    Jagged rows (``bench --jagged``) against B, a line per provider, D and dtype. ``rows``:
    Rows or their dicts."""
    import matplotlib.pyplot as plt

    rows = as_dicts(rows)
    panels = [
        (key, name)
        for key, name in (("fwd", "forward"), ("bwd", "backward"))
        if any(_timed(r.get(f"{key}_GBs")) for r in rows)
    ]
    if not panels:
        raise ValueError("rows: no forward or backward GB/s to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True,
                             squeeze=False)  # fmt: skip
    axes = axes[0]
    # dense rows against N; jagged rows (bench --jagged) against B, a line per D and dtype
    x = "N" if any("N" in r for r in rows) else "B"
    varying = [k for k in ("dtype", "D") if len({r.get(k) for r in rows}) > 1]

    def series(r) -> str:
        return " ".join([r["provider"]] + [f"{k}={r[k]}" if k == "D" else r[k] for k in varying])

    for ax, (key, name) in zip(axes, panels):
        for label in dict.fromkeys(series(r) for r in rows):
            rs = sorted(
                (r for r in rows if series(r) == label and _timed(r.get(f"{key}_GBs"))),
                key=lambda r: r[x],
            )
            ax.plot([r[x] for r in rs], [r[f"{key}_GBs"] for r in rs], marker="o",
                    label=label)  # fmt: skip
        if copy_gbs:
            ax.axhline(copy_gbs, ls="--", color="gray", label=f"copy {copy_gbs:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("N (row width)" if x == "N" else "B (sequences)")
        ax.set_title(f"{name} {title}".strip())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    return fig
