"""out_dtype: y written in a dtype other than x's (of x's precision) by the norm's Store, in
the same pass, through the CuPy API and both bridges.

CPU tier: the plans name y's dtype in the kernels' Store; the checks refuse other precisions
and non-dtypes by name; the torch CPU fallback returns y in out_dtype. GPU tier: every tier of
both norms, with and without a residual add, against the float64 reference into NaN-poisoned
outputs; float32 rows written as 16-bit y are bitwise the plain call's y rounded once; the
backward takes dy in y's dtype; torch (eager, autograd, torch.compile) and JAX (eager, jit,
grad) agree with their plain calls rounded to out_dtype.
"""

import itertools

import numpy as np
import pytest

from cupyln import _checks
from cupyln import reference as ref
from cupyln._plans import forward as F
from cupyln._plans.common import MAX_CLUSTER

from .conftest import GPU_COUNT, requires_gpu
from .test_plans import SMEM_H100

BF16, F16, F32, F64 = ref.BFLOAT16, np.dtype(np.float16), np.dtype(np.float32), np.dtype("f8")
# every forward tier: sub-warp rows, the scalar path, stream widths, register clusters, the
# ring and cluster tiers, the row tier (and the unfused residual)
NS = [3, 769, 1024, 8192, 32768, 65536, 262144]
PAIRS = [(F32, BF16), (F32, F16), (BF16, F32), (F16, BF16)]  # (x, y)
_seed = itertools.count(9100)


# ------------------------------------------------------------------------------- CPU tier
def test_plans_name_y_dtype_in_the_store():
    for n in NS:
        for x, y in PAIRS:
            for rms in (False, True):
                vec = 16 // max(x.itemsize, y.itemsize)
                if n % vec:
                    vec = 1
                plain = F.forward_plan(n, x, x, x, vec, SMEM_H100, MAX_CLUSTER, rms=rms)
                p = F.forward_plan(n, x, x, x, vec, SMEM_H100, MAX_CLUSTER, rms=rms, y_dtype=y)
                assert (p.arg("TY"), plain.arg("TY")) == (y, x), (n, p)
                assert p.tier == plain.tier, (n, p, plain)  # y's dtype does not move the tier
                rvec = vec if vec == 1 else 4  # h of float32: 16-byte packs of it
                res = F.forward_plan(n, x, x, x, rvec, SMEM_H100, MAX_CLUSTER, rms=rms,
                                     residual=(x, F32), y_dtype=y)  # fmt: skip
                assert res.arg("TY") == y and res.arg("T") in (x, F32), (n, res)


def test_out_dtype_kernels_compile():
    """NVRTC builds a kernel of each forward tier with y of another dtype than x (sm_90): the
    Store's y in the register rows, clusters, stream, ring, cluster and row tiers."""
    from cupyln import _compile

    one = {}
    # (N, pack width): None, the widest; in packs of 2 elements, 24000 takes the ring tier
    # and 65536 the cluster tier
    for n, packs in ((769, 1), (4096, None), (8192, None), (24000, 2), (65536, None),
                     (65536, 2), (262144, None)):  # fmt: skip
        for x, y in ((F32, BF16), (BF16, F16)):
            for rms in (False, True):
                for res in (None, (x, F32)):
                    vec = packs or 16 // max(x.itemsize, y.itemsize, 4 if res else 1)
                    p = F.forward_plan(n, x, x, x, vec, SMEM_H100, MAX_CLUSTER, stream=True,
                                       rms=rms, residual=res, y_dtype=y)  # fmt: skip
                    one.setdefault((p.kernel.name, rms, res is None), p.kernel)
    names = {k.name for k in one.values()}
    assert names >= {"ln_fwd_reg", "ln_fwd_reg_cluster", "ln_fwd_ring", "ln_fwd_cluster",
                     "ln_fwd_row", "ln_fwd_stream"}, names  # fmt: skip
    files: dict = {}
    for k in one.values():
        files.setdefault(_compile.source_of(k.name), []).append(k)
    for kernels in files.values():
        _, _, lowered = _compile.compile_cubin(kernels, 90, verbose=False)
        assert set(lowered) == set(kernels)


def test_out_dtype_is_checked_by_name():
    assert _checks.out_dtype(None, F32) is None
    assert _checks.out_dtype("float32", F32) is None  # x's own: the plain problem
    assert _checks.out_dtype("bfloat16", F32) == BF16
    with pytest.raises(TypeError, match="out_dtype must be of x's precision"):
        _checks.out_dtype(F64, F32)
    with pytest.raises(TypeError, match="out_dtype must be of x's precision"):
        _checks.out_dtype(F32, F64)
    with pytest.raises(TypeError, match="out_dtype"):
        _checks.out_dtype(np.int32, F32)
    with pytest.raises(TypeError, match="out_dtype"):
        _checks.out_dtype([1], F32)


def test_torch_cpu_fallback_returns_out_dtype():
    torch = pytest.importorskip("torch")
    clt = pytest.importorskip("cupyln.torch")
    x = torch.randn(3, 64)
    w = torch.rand(64)
    y = clt.layer_norm(x, (64,), w, None, out_dtype=torch.bfloat16)
    want = torch.nn.functional.layer_norm(x, (64,), w).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    y = clt.rms_norm(x, (64,), w, out_dtype=torch.float16)
    assert y.dtype == torch.float16
    y, h = clt.add_rms_norm(x, x, (64,), w, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32


def test_precompile_takes_out_dtype(monkeypatch):
    from .test_edge_cases import _precompiled

    p, _ = _precompiled(monkeypatch, out_dtype="float16")  # of bfloat16 rows
    assert p.y_dtype == F16 and p.ty == F16
    p, _ = _precompiled(monkeypatch, out_dtype="bfloat16")  # x's own: the plain problem
    assert p.y_dtype is None and p.ty == BF16
    with pytest.raises(TypeError, match="out_dtype must be of x's precision"):
        _precompiled(monkeypatch, out_dtype="float64")


# ------------------------------------------------------------------------------- GPU tier
if GPU_COUNT:
    import cupy

    import cupyln


def fresh(shape, dtype):
    return ref.sample(shape, dtype, loc=-2.3, scale=0.5, seed=next(_seed))


def poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("residual", [False, True], ids=["x", "add"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0].name}-{p[1].name}")
@pytest.mark.parametrize("n", NS)
def test_cupy_y_in_out_dtype(n, pair, rms, residual):
    x_dt, y_dt = pair
    m = 37
    x = fresh((m, n), x_dt)
    w, b = fresh((n,), x_dt), fresh((n,), x_dt)
    r = fresh((m, n), x_dt) if residual else None
    acc = np.float32
    kw = dict(residual=r, residual_dtype=F32 if residual else None)
    if rms:
        out = (poisoned((m, n), y_dt), poisoned((m,), acc))
        got = cupyln.rms_forward(x, w, out_dtype=y_dt, out=out, **kw)
        plain = cupyln.rms_forward(x, w, **kw)
    else:
        out = (poisoned((m, n), y_dt), poisoned((m,), acc), poisoned((m,), acc))
        got = cupyln.forward(x, w, b, out_dtype=y_dt, out=out, **kw)
        plain = cupyln.forward(x, w, b, **kw)
    y = got[0]
    assert y is out[0] and y.dtype == y_dt
    src = got[-1] if residual else x  # what was normalized: h with a residual
    if residual:
        assert bool((got[-1] == plain[-1]).all())  # h as the plain call's
    yr = ref.rms_forward(src, w)[0] if rms else ref.forward(src, w, b)[0]
    ref.assert_close(y, yr, f"y ({x_dt} -> {y_dt})")
    if x_dt == F32 and not residual:  # one rounding of the same float32 value as the plain y's
        assert bool((y == plain[0].astype(y_dt)).all()), "y is the plain y rounded once"
    # the backward takes dy in y's dtype and rounds it to the input's dtype first, as the
    # reference's dy is
    dy = fresh((m, n), y_dt)
    dyr = dy.astype(src.dtype)
    if rms:
        dx, dw = cupyln.rms_backward(dy, src, w, got[1])
        dxr, dwr = ref.rms_backward(dyr, src, w, got[1])
    else:
        dx, dw, _ = cupyln.backward(dy, src, w, got[1], got[2])
        dxr, dwr, _ = ref.backward(dyr, src, w, mean=got[1], rstd=got[2])
    assert dx.dtype == src.dtype
    ref.assert_close(dx, dxr, "dx")
    ref.assert_close(dw, dwr, "dw", atol_scale=m**0.5)


@pytest.mark.gpu
@requires_gpu
def test_cupy_out_dtype_checks_before_writing():
    x = fresh((4, 64), F32)
    y = poisoned((4, 64), F32)
    with pytest.raises((TypeError, ValueError), match="y"):  # out's y must be of out_dtype
        cupyln.forward(x, out_dtype=BF16, out=(y, None, None))
    assert bool(cupy.isnan(y).all())
    with pytest.raises(TypeError, match="out_dtype must be of x's precision"):
        cupyln.layer_norm(x, out_dtype=F64)
    assert cupyln.layer_norm(x, out_dtype=BF16).dtype == BF16
    assert cupyln.rms_norm(x, out_dtype=F16).dtype == F16
    assert cupyln.forward(x[:0], out_dtype=BF16)[0].dtype == BF16  # no rows


@pytest.mark.gpu
@requires_gpu
def test_precompile_with_out_dtype_leaves_nothing_to_compile():
    from cupyln import _compile

    n = 4096
    assert cupyln.precompile(n, "float32", out_dtype="bfloat16", rms=True) > 0
    compiled = len(_compile._functions)
    w = fresh((n,), F32)
    for m in (1, 7, 1000, 3001, 20000):
        x = fresh((m, n), F32)
        y, rstd = cupyln.rms_forward(x, w, out_dtype=BF16)
        cupyln.rms_backward(y, x, w, rstd)  # dy of y's dtype
        assert len(_compile._functions) == compiled, f"M={m}: a kernel compiled"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n", [1024, 4096, 65536])
def test_torch_out_dtype(n):
    torch = pytest.importorskip("torch")
    clt = pytest.importorskip("cupyln.torch")
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (-2.3 + 0.5 * torch.randn(8, n, generator=g, device="cuda")).requires_grad_()
    w = torch.rand(n, generator=g, device="cuda").requires_grad_()
    b = torch.rand(n, generator=g, device="cuda")
    y = clt.layer_norm(x, (n,), w, b, out_dtype=torch.bfloat16)
    plain = clt.layer_norm(x, (n,), w, b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, plain.to(torch.bfloat16))
    dy = torch.randn(8, n, generator=g, device="cuda").to(torch.bfloat16)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    wx, ww = torch.autograd.grad(plain, (x, w), dy.float())
    assert gx.dtype == torch.float32 and torch.equal(gx, wx) and torch.equal(gw, ww)
    for fn in (clt.rms_norm, torch.compile(clt.rms_norm, fullgraph=True)):
        yr = fn(x, (n,), w, out_dtype=torch.float16)
        assert yr.dtype == torch.float16
        assert torch.equal(yr, clt.rms_norm(x, (n,), w).to(torch.float16))
    h_in = x.detach().to(torch.bfloat16)
    ya, h = clt.add_layer_norm(h_in, h_in, (n,), w, b, residual_dtype=torch.float32,
                               out_dtype=torch.float32)  # fmt: skip
    assert ya.dtype == torch.float32 and h.dtype == torch.float32
    want = torch.nn.functional.layer_norm(h.double(), (n,), w.double(), b.double())
    assert float((ya.double() - want).abs().max()) < 1e-4
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype"):
        clt.rms_norm(x, (n,), w, out_dtype="bfloat16")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_out_dtype(jit):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    cj = pytest.importorskip("cupyln.jax")
    n = 4096
    key = jax.random.PRNGKey(7)
    x = -2.3 + 0.5 * jax.random.normal(key, (16, n), jnp.float32)
    w = jax.random.uniform(key, (n,), jnp.float32)

    def f(x, w):
        return cj.layer_norm(x, w, None, out_dtype=jnp.bfloat16)

    def plain(x, w):
        return cj.layer_norm(x, w, None)

    if jit:
        f, plain = jax.jit(f), jax.jit(plain)
    y = f(x, w)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain(x, w).astype(jnp.bfloat16)))

    def loss(fn):
        return lambda x, w: (fn(x, w).astype(jnp.float32) ** 2).sum()

    gx, gw = jax.grad(loss(f), (0, 1))(x, w)
    assert gx.dtype == jnp.float32 and gw.dtype == jnp.float32
    y2 = cj.rms_norm(x, w, out_dtype=jnp.float16)
    assert y2.dtype == jnp.float16
