"""GPU tier, the norm family: RMSNorm, the residual add in front of RMSNorm and LayerNorm, and
weight_offset, against the float64 reference (cupyln.reference), through the CuPy API.

As test_layer_norm_gpu: the one tolerance table, NaN-poisoned outputs (``out=``, and a
NaN-filled memory pool where the call allocates), fresh ``-2.3 + 0.5 * randn`` inputs. h is
compared exactly: it is x + residual rounded once to residual_dtype, as the reference rounds it.
"""

import itertools
import math

import numpy as np
import pytest

from cupyln import _launcher
from cupyln import reference as ref
from cupyln._dtypes import TABLE
from cupyln._problem import Problem

from .conftest import GPU_COUNT, requires_gpu
from .test_layer_norm_gpu import forward_rules, hopper_plans

pytestmark = [pytest.mark.gpu, requires_gpu]

if GPU_COUNT:
    import cupy

    import cupyln

DTYPES = [d.name for d in TABLE]
# every tier of both directions: sub-warp rows, odd widths (769: the scalar path), the stream
# widths (1024-16384, 16-bit), register clusters (32768/65536), past them (262144: the row tier,
# and the unfused residual)
NS = [1, 3, 127, 769, 1000, 1024, 4096, 8192, 16384, 32768, 65536, 262144]
MS = [0, 1, 37, 1151]
MAX_ELEMENTS = 40_000_000
SWEEP = [(m, n) for n in NS for m in MS if m * n <= MAX_ELEMENTS]
_seed = itertools.count(5000)


def fresh(shape, dtype, loc=-2.3, scale=0.5):
    return ref.sample(shape, dtype, loc=loc, scale=scale, seed=next(_seed))


def poisoned(shape, dtype):
    a = cupy.empty(shape, dtype)
    a.view({2: "uint16", 4: "uint32", 8: "uint64"}[a.itemsize])[...] = {
        "bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000,
        "float64": 0x7FF8000000000000,
    }[np.dtype(dtype).name]  # fmt: skip
    return a


def arithmetic(dtype):
    return "float64" if np.dtype(dtype) == np.float64 else "float32"


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    cupy.get_default_memory_pool().free_all_blocks()


def check_rms(x, w, dy, eps=1e-6, offset=0.0, dh=None, h=None):
    """RMSNorm of x (the forward's input, h with a residual) into poisoned outputs, forward and
    backward against the reference; returns (y, rstd, dx, dw)."""
    n, lead = x.shape[-1], x.shape[:-1]
    acc = arithmetic(x.dtype)
    outs = (poisoned(x.shape, x.dtype), poisoned(lead, acc))
    y, rstd = cupyln.rms_forward(x, w, eps, weight_offset=offset, out=outs)
    assert y is outs[0] and rstd is outs[1]
    gouts = (poisoned(x.shape, x.dtype), None if w is None else poisoned((n,), w.dtype))
    dx, dw = cupyln.rms_backward(dy, x, w, rstd, dh=dh, weight_offset=offset, out=gouts)
    assert dx is gouts[0] and (dw is None) == (w is None)
    yr, rstdr = ref.rms_forward(x, w, eps, offset)
    dxr, dwr = ref.rms_backward(dy, x, w, rstd, eps, offset, dh)
    ar = arithmetic(x.dtype)
    ref.assert_close(y, yr, "y", arithmetic=ar)
    ref.assert_close(rstd, rstdr, "rstd", arithmetic=ar)
    ref.assert_close(dx, dxr, "dx", arithmetic=ar)
    if w is not None:
        ref.assert_close(dw, dwr, "dw", atol_scale=math.sqrt(max(1, x.size // n)), arithmetic=ar)
    return y, rstd, dx, dw


# ------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("m,n", SWEEP, ids=[f"{m}x{n}" for m, n in SWEEP])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_sweep(dtype, m, n):
    x = fresh((m, n), dtype)
    w = fresh((n,), dtype, loc=1.0, scale=0.3)
    dy = fresh((m, n), dtype, loc=0.0, scale=1.0)
    check_rms(x, w, dy)


@pytest.mark.parametrize("n", [127, 1024, 4096, 16384, 65536])
@pytest.mark.parametrize("xdt,wdt", [("bfloat16", "float32"), ("float16", "float32"),
                                     ("float32", "bfloat16"), ("bfloat16", None)])  # fmt: skip
def test_rms_mixed_and_no_weight(xdt, wdt, n):
    m = 300
    x = fresh((m, n), xdt)
    w = None if wdt is None else fresh((n,), wdt, loc=1.0, scale=0.3)
    check_rms(x, w, fresh((m, n), xdt, loc=0.0, scale=1.0))


@pytest.mark.parametrize("n", [1000, 4096, 32768])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weight_offset(dtype, n):
    """Gemma's 1 + w: the scale is w + offset, dw is the gradient of w either way."""
    m = 200
    x, dy = fresh((m, n), dtype), fresh((m, n), dtype, loc=0.0, scale=1.0)
    w = fresh((n,), dtype, loc=0.0, scale=0.1)
    check_rms(x, w, dy, offset=1.0)
    y, mean, rstd = cupyln.forward(x, w, None, 1e-5, weight_offset=1.0)
    yr, _, _ = ref.forward(x, ref.to_float64(w) + 1.0, None, 1e-5)
    ref.assert_close(y, yr, "y", arithmetic="float32")
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd, weight_offset=1.0)
    dxr, dwr, dbr = ref.backward(dy, x, ref.to_float64(w) + 1.0, 1e-5, mean, rstd)
    assert dw.dtype == w.dtype
    ref.assert_close(dx, dxr, "dx", arithmetic="float32")
    ref.assert_close(dw, dwr, "dw", atol_scale=math.sqrt(m), arithmetic="float32")


def test_rms_strided_rows_and_layouts():
    base = fresh((64, 3000), "bfloat16")
    x = base[:, 500:2548]  # rows at stride 3000
    w = fresh((2048,), "bfloat16", loc=1.0, scale=0.3)
    dy = fresh((64, 2048), "bfloat16", loc=0.0, scale=1.0)
    check_rms(x, w, dy)
    xt = fresh((256, 64), "float32").T  # not rows at one stride: copied
    check_rms(xt, None, fresh((64, 256), "float32", loc=0.0, scale=1.0))


@pytest.mark.parametrize("n", [1024, 8192, 65536, 262144])
def test_rms_deterministic(n):
    m = 2000
    x, dy = fresh((m, n), "bfloat16"), fresh((m, n), "bfloat16", loc=0.0, scale=1.0)
    w = fresh((n,), "float32", loc=1.0, scale=0.3)
    _, rstd = cupyln.rms_forward(x, w)
    a = cupyln.rms_backward(dy, x, w, rstd)
    b = cupyln.rms_backward(dy, x, w, rstd)
    assert bool((a[0] == b[0]).all()) and bool((a[1] == b[1]).all())


def test_rms_nan_row_stays():
    x = fresh((40, 4096), "bfloat16")
    x[7, 100] = float("nan")
    y = cupyln.rms_norm(x, fresh((4096,), "bfloat16", loc=1.0, scale=0.3))
    bad = cupy.isnan(y.astype(cupy.float32)).any(axis=1)
    assert bool(bad[7]) and int(bad.sum()) == 1


def test_rms_norm_and_zero_rows():
    x = fresh((3, 5, 769), "float16")
    y = cupyln.rms_norm(x, None, 1e-5)
    ref.assert_close(y, ref.rms_forward(x, None, 1e-5)[0], "y")
    y, rstd = cupyln.rms_forward(fresh((0, 64), "float32"))
    assert y.shape == (0, 64) and rstd.shape == (0,)
    w = fresh((64,), "float32")
    dx, dw = cupyln.rms_backward(fresh((0, 64), "float32"), fresh((0, 64), "float32"), w, rstd)
    assert dx.shape == (0, 64) and bool((dw == 0).all())


# ------------------------------------------------------------------ residual add
RES_CASES = [(m, n) for n in [1, 127, 769, 1024, 4096, 16384, 24576, 32768, 65536, 262144]
             for m in [1, 37, 700] if m * n <= 30_000_000]  # fmt: skip


@pytest.mark.parametrize("m,n", RES_CASES, ids=[f"{m}x{n}" for m, n in RES_CASES])
@pytest.mark.parametrize("xdt,rdt,hdt", [
    ("bfloat16", "bfloat16", "bfloat16"), ("float16", "float16", "float16"),
    ("float32", "float32", "float32"), ("float64", "float64", "float64"),
    ("bfloat16", "float32", "float32"), ("bfloat16", "bfloat16", "float32"),
    ("float16", "float32", "float16"),
])  # fmt: skip
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_add_norm(norm, xdt, rdt, hdt, m, n):
    x = fresh((m, n), xdt)
    r = fresh((m, n), rdt, loc=0.3, scale=1.0)
    w = fresh((n,), xdt, loc=1.0, scale=0.3)
    b = fresh((n,), xdt, loc=0.0, scale=0.3)
    dy = fresh((m, n), xdt, loc=0.0, scale=1.0)
    dh = fresh((m, n), hdt, loc=0.0, scale=0.5)
    cupy.get_default_memory_pool().free_all_blocks()
    ref.poison_pool(8 * m * n)  # h (allocated by the call) starts out as NaN
    hr = ref.add(x, r, hdt)
    ar = arithmetic(xdt)
    if norm == "rms":
        y, rstd, h = cupyln.rms_forward(x, w, 1e-6, residual=r, residual_dtype=hdt)
        yr, rstdr = ref.rms_forward(hr, w, 1e-6)
        dx, dw = cupyln.rms_backward(dy, h, w, rstd, dh=dh)
        dxr, dwr = ref.rms_backward(dy, h, w, rstd, 1e-6, 0.0, dh)
    else:
        y, mean, rstd, h = cupyln.forward(x, w, b, 1e-5, residual=r, residual_dtype=hdt)
        yr, meanr, rstdr = ref.forward(hr, w, b, 1e-5)
        ref.assert_close(mean, meanr, "mean", arithmetic=ar)
        dx, dw, db = cupyln.backward(dy, h, w, mean, rstd, dh=dh)
        dxr, dwr, dbr = ref.backward(dy, h, w, 1e-5, mean, rstd)
        dxr = dxr + ref.to_float64(dh)
        ref.assert_close(db, dbr, "db", atol_scale=math.sqrt(m), arithmetic=ar)
    assert h.dtype == np.dtype(hdt) and y.dtype == x.dtype and dx.dtype == h.dtype
    assert bool((ref.to_float64(h) == ref.to_float64(hr)).all()), "h is not x + residual"
    ref.assert_close(y, yr, "y", arithmetic=ar)
    ref.assert_close(rstd, rstdr, "rstd", arithmetic=ar)
    ref.assert_close(dx, dxr, "dx", arithmetic=ar)
    ref.assert_close(dw, dwr, "dw", atol_scale=math.sqrt(m), arithmetic=ar)


@pytest.mark.parametrize("n", [8192, 16384, 32768])  # 512 x 2, 512 x 4, 1024 x 4 (RES_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_add_norm_stream_rows(monkeypatch, norm, dtype, n):
    """The residual add's 16-bit rows that stream in long launches on sm_90 with fast DRAM,
    N = 32768 among them (1024 threads of 4 packs, a residual's shape alone), taken here by any
    launch on any sm_90 (FWD_SHORT_WAVES, FWD_STREAM_DRAM_PER_SM = 0): y, the statistics and h
    (exactly) against the float64 reference, into NaN-filled memory."""
    with forward_rules(monkeypatch, FWD_SHORT_WAVES=0, FWD_STREAM_DRAM_PER_SM=0.0):
        m = 37
        x, r = fresh((m, n), dtype), fresh((m, n), dtype, loc=0.3, scale=1.0)
        w, b = fresh((n,), dtype, loc=1.0, scale=0.3), fresh((n,), dtype, loc=0.0, scale=0.3)
        p = Problem(m, n, x.dtype, w.dtype, b.dtype, norm == "rms", (x.dtype, x.dtype), x_stride=n,
                    r_stride=n)  # fmt: skip
        plan = _launcher.forward_launch(x.device.id, p, 8)[1]
        if hopper_plans(x):
            assert (plan.tier, plan.items) == ("stream", 2 if n == 8192 else 4), plan
        cupy.get_default_memory_pool().free_all_blocks()
        ref.poison_pool(2 * m * n)  # h (allocated by the call) starts out as NaN
        hr = ref.add(x, r, dtype)
        if norm == "rms":
            y, rstd, h = cupyln.rms_forward(x, w, 1e-6, residual=r)
            yr, rstdr = ref.rms_forward(hr, w, 1e-6)
        else:
            y, mean, rstd, h = cupyln.forward(x, w, b, 1e-5, residual=r)
            yr, meanr, rstdr = ref.forward(hr, w, b, 1e-5)
            ref.assert_close(mean, meanr, "mean")
        assert bool((ref.to_float64(h) == ref.to_float64(hr)).all()), "h is not x + residual"
        ref.assert_close(y, yr, "y")
        ref.assert_close(rstd, rstdr, "rstd")


@pytest.mark.parametrize("n", [4096, 32768])  # register rows, register clusters
def test_add_strided_residual_and_no_dh(n):
    m = 300
    x = fresh((m, n), "bfloat16")
    r = fresh((m, n + 64), "bfloat16")[:, 32 : 32 + n]  # rows at stride n + 64
    w = fresh((n,), "bfloat16", loc=1.0, scale=0.3)
    y, rstd, h = cupyln.rms_forward(x, w, residual=r)
    assert bool((ref.to_float64(h) == ref.to_float64(ref.add(x, r, "bfloat16"))).all())
    ref.assert_close(y, ref.rms_forward(h, w)[0], "y")
    dy = fresh((m, n), "bfloat16", loc=0.0, scale=1.0)
    dx, _ = cupyln.rms_backward(dy, h, w, rstd)
    ref.assert_close(dx, ref.rms_backward(dy, h, w, rstd)[0], "dx")


# ------------------------------------------------------------------ bad input
def test_family_bad_input():
    x = fresh((4, 64), "bfloat16")
    w = fresh((64,), "bfloat16")
    with pytest.raises(ValueError, match="residual must have the shape"):
        cupyln.rms_forward(x, w, residual=fresh((4, 32), "bfloat16"))
    with pytest.raises(TypeError, match="residual must be of x's precision"):
        cupyln.forward(x, w, residual=fresh((4, 64), "float64"))
    with pytest.raises(ValueError, match="residual_dtype needs a residual"):
        cupyln.rms_forward(x, w, residual_dtype="float32")
    with pytest.raises(ValueError, match="weight_offset must be finite"):
        cupyln.rms_forward(x, w, weight_offset=float("nan"))
    with pytest.raises(TypeError, match="weight_offset must be a real number"):
        cupyln.rms_norm(x, w, weight_offset="1")
    with pytest.raises(ValueError, match="weight_offset needs a weight"):
        cupyln.rms_forward(x, None, weight_offset=1.0)
    with pytest.raises(TypeError, match="residual must be a cupy.ndarray"):
        cupyln.rms_forward(x, w, residual=np.zeros((4, 64), np.float32))
    _, rstd = cupyln.rms_forward(x, w)
    with pytest.raises(ValueError, match="dh must have the shape"):
        cupyln.rms_backward(x, x, w, rstd, dh=fresh((4, 63), "bfloat16"))
    with pytest.raises(TypeError, match="rstd must be float32"):
        cupyln.rms_backward(x, x, w, rstd.astype(cupy.float64))
