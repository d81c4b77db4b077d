"""Edge cases found by reading the code: each once crashed, gave a wrong result or raised
another error than the named TypeError/ValueError the rest of the API raises. The checks that
take plain values run on the CPU tier; the rest need a GPU."""

import contextlib

import numpy as np
import pytest

import cupyln
from cupyln import _checks, _control
from cupyln.cli import _gpu_count

from .conftest import GPU_COUNT, requires_gpu

if GPU_COUNT:
    import cupy

    from cupyln import reference as ref


# ------------------------------------------------------------------ plain values (CPU)
@pytest.mark.parametrize(
    "value,exc,match",
    [
        ("1.5", TypeError, "weight_offset must be a real number; got str"),
        (True, TypeError, "weight_offset must be a real number; got bool"),
        (np.ones(2), TypeError, "weight_offset must be a real number; got ndarray"),
        (10**400, ValueError, "weight_offset must be finite; got an int past float's range"),
        (float("nan"), ValueError, "weight_offset must be finite; got nan"),
    ],
)
def test_weight_offset_is_a_finite_real_number(value, exc, match):
    with pytest.raises(exc, match=match):
        _checks.weight_offset(value)


def test_eps_past_floats_range_is_a_value_error():
    with pytest.raises(ValueError, match="eps must be finite and >= 0; got an int past"):
        _checks.eps(10**400)


@pytest.mark.parametrize("value", [["float32"], {"a": 1}, "float128x"])
def test_an_unhashable_or_unknown_dtype_is_named(value):
    with pytest.raises(TypeError, match="residual_dtype must be one of"):
        _checks.dtype_arg(value, None, "residual_dtype")


@pytest.mark.parametrize(
    "value,exc", [("abc", TypeError), (2.5, TypeError), (True, TypeError), (0, ValueError)]
)
def test_max_seqlen_is_a_positive_int(value, exc):
    with pytest.raises(exc, match="max_seqlen must be a positive int or None"):
        _checks.max_seqlen(value)
    assert _checks.max_seqlen(None) is None and _checks.max_seqlen(np.int64(7)) == 7


def test_describe_refuses_a_numpy_array():
    with pytest.raises(TypeError, match="x must be a cupy.ndarray.*numpy.ndarray"):
        cupyln.describe(np.ones((4, 8), np.float32))


def test_no_driver_is_said_plainly():
    """Without any NVIDIA driver the reason names the missing driver, not CUDA's
    cudaErrorInsufficientDriver (which means a driver older than the runtime); with one, the
    reason never says it is missing."""
    pytest.importorskip("cupy")
    import cupy

    driver = 0
    with contextlib.suppress(Exception):
        driver = cupy.cuda.runtime.driverGetVersion()
    count, why = _gpu_count()
    if driver == 0:
        assert count == 0 and "no NVIDIA driver found" in why, why
    else:
        assert "no NVIDIA driver" not in why, why


def _precompiled(monkeypatch, **kwargs):
    """(problem, db dtype) that cupyln.precompile hands the launcher for these keywords."""
    seen = []
    monkeypatch.setattr(
        _control._launcher, "precompile", lambda d, p, db, bw: seen.append((p, db)) or set()
    )
    monkeypatch.setattr(_control._runtime, "OnDevice", lambda d: contextlib.nullcontext())
    _control.precompile(1024, "bfloat16", device=0, **kwargs)
    return seen[0]


def test_precompile_keywords_mean_what_the_calls_mean(monkeypatch):
    """residual_dtype is h's dtype, as in forward; residual the residual's; the old spellings
    (bias_dtype for db, h_dtype beside residual_dtype as the residual's) warn and map."""
    f4, bf = np.dtype("float32"), np.dtype(cupyln._dtypes.BFLOAT16)
    p, db = _precompiled(monkeypatch, residual="float32", residual_dtype="bfloat16")
    assert p.residual == (f4, bf) and db == bf
    p, _ = _precompiled(monkeypatch, residual_dtype="float32")
    assert p.residual == (f4, f4)
    with pytest.warns(DeprecationWarning, match="h_dtype is deprecated"):
        p, _ = _precompiled(monkeypatch, residual_dtype="float32", h_dtype="bfloat16")
    assert p.residual == (f4, bf)
    with pytest.warns(DeprecationWarning, match="bias_dtype is deprecated"):
        _, db = _precompiled(monkeypatch, bias_dtype="float32")
    assert db == f4
    p, db = _precompiled(monkeypatch, w_dtype="bfloat16", weight_offset=True)
    assert p.w_dtype == f4 and db == bf  # the kernels read w + offset in float32; db is w's


def test_torch_cpu_fallback_raises_the_gpu_paths_errors():
    torch = pytest.importorskip("torch")
    clt = pytest.importorskip("cupyln.torch")
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight_offset needs a weight; got weight=None"):
        clt.rms_norm(x, (64,), None, weight_offset=1.0)
    with pytest.raises(ValueError, match=r"Given normalized_shape=\[32\]"):
        clt.add_rms_norm(x, r, (32,))
    with pytest.raises(ValueError, match="residual must have the shape of input"):
        clt.add_layer_norm(x, r[:2], (64,))
    with pytest.raises(TypeError, match="weight_offset must be a real number; got str"):
        clt.rms_norm(x, (64,), torch.ones(64), weight_offset="1.5")
    with pytest.raises(ValueError, match=r"weight must have shape \[64\]"):
        clt.add_layer_norm(x, r, (64,), torch.ones(32))


def test_torch_family_double_backward_is_refused():
    """Through the ops (meta tensors): a second backward through norm_bwd raises, as
    LayerNorm's always did, instead of returning None gradients."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupyln.torch")
    x = torch.empty(3, 40, device="meta", requires_grad=True)
    r = torch.empty(3, 40, device="meta", requires_grad=True)
    w = torch.empty(40, device="meta", requires_grad=True)
    dy = torch.empty(3, 40, device="meta")
    for residual in (None, r):
        y = torch.ops.cupyln.norm_fwd(x, residual, w, None, 1e-6, True, None, 0.0)[0]
        (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
        with pytest.raises(RuntimeError, match="backward is not differentiable"):
            gx.sum().backward()


# ------------------------------------------------------------------ on a GPU
@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jagged_with_no_sequence_over_rows_unchecked(dtype):
    """offsets [0] over 24 rows, unchecked: the rows belong to no sequence. Once an illegal
    address that left the context unusable; now y, dx, dw and db are zeros, and later calls
    run."""
    values = ref.sample((24, 16), dtype, seed=1)
    w = ref.sample((16,), "float32", seed=2)
    offsets = cupy.zeros(1, cupy.int64)
    y, mean, rstd = cupyln.jagged_forward(values, offsets, w, w, check_offsets=False)
    assert mean.shape == rstd.shape == (0,) and not bool(y.astype("f4").any())
    dy = ref.sample((24, 16), dtype, seed=3)
    dx, dw, db = cupyln.jagged_backward(dy, values, offsets, w, mean, rstd, check_offsets=False)
    cupy.cuda.runtime.deviceSynchronize()
    assert not any(bool(a.astype("f4").any()) for a in (dx, dw, db))
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal values.shape\[0\] = 24"):
        cupyln.jagged_forward(values, offsets)
    good = cupy.asarray([0, 10, 24])
    y = cupyln.jagged_forward(values, good, w, w)[0]
    want = ref.jagged_forward(values, good, w, w)[0]
    assert float(abs(y.astype("f8") - want).max()) < 0.1


@requires_gpu
@pytest.mark.gpu
def test_cupy_bad_keywords_are_named_before_anything_is_written():
    x = ref.sample((4, 32), "float32", seed=4)
    w = ref.sample((32,), "float32", seed=5)
    out = (cupy.full((4, 32), cupy.nan, "f4"), None)
    for kw, exc, match in (
        (dict(weight_offset=cupy.ones(2)), TypeError, "weight_offset must be a real number"),
        (dict(weight_offset=10**400), ValueError, "weight_offset must be finite"),
        (dict(residual=x, residual_dtype=["f4"]), TypeError, "residual_dtype must be one of"),
    ):
        with pytest.raises(exc, match=match):
            cupyln.rms_forward(x, w, out=out, **kw)
        assert bool(cupy.isnan(out[0]).all())
    offsets = cupy.asarray([0, 4])
    for bad in ("abc", 2.5):
        with pytest.raises(TypeError, match="max_seqlen must be a positive int"):
            cupyln.jagged_forward(x, offsets, max_seqlen=bad)


@requires_gpu
@pytest.mark.gpu
def test_torch_bad_arguments_on_the_gpu():
    torch = pytest.importorskip("torch")
    clt = pytest.importorskip("cupyln.torch")
    x = torch.randn(4, 2, 32, device="cuda")
    w = torch.ones(2, 32, device="cuda")
    permuted = torch.randn(2, 4, 32, device="cuda")  # x's element count, not its shape
    with pytest.raises(ValueError, match="residual must have the shape of input"):
        clt.add_rms_norm(x, permuted, (2, 32), w)
    with pytest.raises(TypeError, match="weight_offset must be a real number; got str"):
        clt.rms_norm(x, (2, 32), w, weight_offset="1.5")
    with pytest.raises(TypeError, match="weight_offset must be a real number; got bool"):
        clt.rms_norm(x, (2, 32), w, weight_offset=True)
    with pytest.raises(TypeError, match="residual_dtype must be a torch.dtype or None"):
        clt.add_rms_norm(x, x, (2, 32), w, residual_dtype=["bf16"])
    values, offsets = torch.randn(6, 8, device="cuda"), torch.tensor([0, 6], device="cuda")
    for bad in ("abc", 2.5):
        with pytest.raises(TypeError, match="max_seqlen must be a positive int"):
            clt.jagged_layer_norm(values, offsets, max_seqlen=bad)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["rms_norm", "add_rms_norm", "add_layer_norm"])
def test_torch_family_double_backward_raises_on_the_gpu(fn):
    torch = pytest.importorskip("torch")
    clt = pytest.importorskip("cupyln.torch")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    r = torch.randn(8, 64, device="cuda", requires_grad=True)
    w = torch.rand(64, device="cuda", requires_grad=True)
    if fn == "rms_norm":
        y = clt.rms_norm(x, (64,), w)
    else:
        y = getattr(clt, fn)(x, r, (64,), w)[0]
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        gx.sum().backward()
