"""GPU tier of the JAX bridge: values and gradients against the float64 reference and a
pure-JAX layer norm, eager and under jax.jit; jit(grad) of a small MLP; vmap; XLA's stream.

Tolerances: cupyln.reference.TOLERANCE by output dtype at float32 arithmetic; dw/db allow
atol * sqrt(rows), as in the core tests. XLA_PYTHON_CLIENT_PREALLOCATE=false (conftest).
"""

import itertools
import math

import numpy as np
import pytest

from cupyln import reference as ref

from .conftest import GPU_COUNT, requires_gpu

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
cj = pytest.importorskip("cupyln.jax")


def _keep_current_device(fn):
    """Runs fn and restores the CUDA runtime's current device: XLA's start-up leaves its last
    GPU current on the calling thread, which the other test modules do not expect."""
    try:
        import cupy
    except ImportError:
        return fn()
    dev = cupy.cuda.runtime.getDevice() if GPU_COUNT else None
    try:
        return fn()
    finally:
        if dev is not None:
            cupy.cuda.runtime.setDevice(dev)


def _jax_gpus():
    def count():
        try:
            return len(jax.devices("gpu"))
        except RuntimeError:
            return 0

    return _keep_current_device(count) if GPU_COUNT else 0


pytestmark = [
    pytest.mark.gpu,
    requires_gpu,
    pytest.mark.skipif(GPU_COUNT and _jax_gpus() == 0, reason="JAX has no GPU backend here"),
]

NS = [1, 3, 64, 769, 1024, 4096, 8193, 16384, 65536]


@pytest.fixture(autouse=True)
def _restore_device():
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    yield
    cupy.cuda.runtime.setDevice(dev)


DTYPES = [jnp.float32, jnp.bfloat16]
_seed = itertools.count(5000)


def fresh(shape, dtype, loc=-2.3, scale=0.5):
    key = jax.random.PRNGKey(next(_seed))
    return (loc + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def check(out, want, what, rows=1):
    name = jnp.dtype(out.dtype).name
    atol, rtol = (max(p) for p in zip(ref.TOLERANCE[name], ref.TOLERANCE["float32"]))
    np.testing.assert_allclose(f64(out), want, atol=atol * rows, rtol=rtol, err_msg=what)


def pure_jax(x, w, b, eps=1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    if w is not None:
        y = y * w.astype(jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_values_and_grads(dtype, n, jit):
    m = max(1, min(300, 2**21 // n))
    x = fresh((3, m, n), dtype)
    w = fresh((n,), jnp.float32, 1.0, 0.3)
    b = fresh((n,), dtype, 0.0, 0.3)
    dy = fresh((3, m, n), dtype, 0.0, 1.0)

    def f(x, w, b):
        return cj.layer_norm(x, w, b)

    y, vjp = jax.vjp(jax.jit(f) if jit else f, x, w, b)
    dx, dw, db = vjp(dy)
    assert y.dtype == x.dtype and dw.dtype == w.dtype and db.dtype == b.dtype
    xs, ws, bs, dys = (np.asarray(f64(a)) for a in (x, w, b, dy))
    yr, mean, rstd = ref.forward(xs, ws, bs)
    # the backward runs at the forward's saved float32 statistics (as torch's does): for rows
    # of nearly equal values rstd amplifies their rounding, so the reference uses them too
    mean32, rstd32 = (v.astype(np.float32).astype(np.float64) for v in (mean, rstd))
    dxr, dwr, dbr = ref.backward(dys, xs, ws, 1e-5, mean32, rstd32)
    check(y, yr, "y")
    check(dx, dxr, "dx")
    rows = math.sqrt(3 * m)
    check(dw, dwr, "dw", rows)
    check(db, dbr, "db", rows)
    # and the pure-JAX layer norm agrees to the output dtype
    check(y, f64(pure_jax(x, w, b)), "y vs pure JAX")


@pytest.mark.parametrize("with_w,with_b", [(False, False), (True, False), (False, True)])
def test_optional_weight_and_bias(with_w, with_b):
    n = 512
    x = fresh((40, n), jnp.float32)
    w = fresh((n,), jnp.float32, 1.0, 0.3) if with_w else None
    b = fresh((n,), jnp.float32, 0.0, 0.3) if with_b else None
    dy = fresh((40, n), jnp.float32, 0.0, 1.0)
    y, vjp = jax.vjp(lambda x, w, b: cj.layer_norm(x, w, b), x, w, b)
    dx, dw, db = vjp(dy)
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    np.testing.assert_allclose(f64(y), f64(pure_jax(x, w, b)), atol=2e-5)
    _, vjp_r = jax.vjp(pure_jax, x, w, b)
    for got, want in zip((dx, dw, db), vjp_r(dy)):
        if got is not None:
            np.testing.assert_allclose(f64(got), f64(want), atol=2e-4, rtol=1e-4)


def test_jit_grad_of_an_mlp_matches_pure_jax():
    d, h = 256, 1024
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (d, h)) / math.sqrt(d),
        "w2": jax.random.normal(keys[1], (h, d)) / math.sqrt(h),
        "g": 1 + 0.1 * jax.random.normal(keys[2], (d,)),
        "beta": 0.1 * jax.random.normal(keys[3], (d,)),
    }
    x = fresh((64, d), jnp.float32)

    def loss(p, x, ln):
        h1 = ln(x, p["g"], p["beta"]) @ p["w1"]
        return jnp.mean((jax.nn.gelu(h1) @ p["w2"] + x) ** 2)

    got = jax.jit(jax.grad(lambda p, x: loss(p, x, cj.layer_norm)))(params, x)
    want = jax.jit(jax.grad(lambda p, x: loss(p, x, pure_jax)))(params, x)
    for k in params:
        np.testing.assert_allclose(f64(got[k]), f64(want[k]), atol=1e-5, rtol=1e-3, err_msg=k)


def test_vmap_runs_each_batch_element():
    x = fresh((3, 20, 256), jnp.bfloat16)
    w = fresh((3, 256), jnp.float32, 1.0, 0.3)
    y = jax.vmap(cj.layer_norm)(x, w)
    for i in range(3):
        check(y[i], ref.forward(f64(x[i]), f64(w[i]))[0], f"y[{i}]")


def test_ordered_after_the_producer_on_xlas_stream():
    """x comes from a long XLA computation; the kernels must see its finished values, eagerly
    and inside one jitted program."""
    big = fresh((4096, 4096), jnp.float32, 0.0, 1.0)

    def produce(big):
        for _ in range(8):
            big = jnp.tanh(big @ big.T * 1e-3) + big
        return big[:512, :2048] * 0.5 - 2.3

    x = produce(big)  # eager: queued, likely still running
    y = cj.layer_norm(x)
    check(y, ref.forward(f64(x))[0], "eager y")
    y2, x2 = jax.jit(lambda big: (cj.layer_norm(produce(big)), produce(big)))(big)
    check(y2, ref.forward(f64(x2))[0], "jitted y")


def test_empty_rows():
    x = jnp.zeros((0, 64), jnp.float32)
    assert cj.layer_norm(x).shape == (0, 64)
    assert jax.grad(lambda x: cj.layer_norm(x).sum())(x).shape == (0, 64)


def test_precompile_then_jit_at_new_row_counts_compiles_nothing():
    """After cupyln.jax.precompile, jitted forward and backward at row counts not run before
    build no kernel."""
    from cupyln import _compile

    n = 2048
    assert cj.precompile(n, jnp.bfloat16, w_dtype=jnp.float32, b_dtype=jnp.float32) > 0
    compiled = len(_compile._functions)
    w, b = jnp.ones(n, jnp.float32), jnp.zeros(n, jnp.float32)
    step = jax.jit(jax.grad(lambda x, w, b: cj.layer_norm(x, w, b).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2)))  # fmt: skip
    for m in (1, 300, 1024, 5000):
        x = jnp.asarray(ref.sample((m, n), "float32", seed=m, xp=np)).astype(jnp.bfloat16)
        jax.block_until_ready(step(x, w, b))
        assert len(_compile._functions) == compiled, f"M={m}: a kernel compiled"


# ------------------------------------------------------------------ the norm family
def _rms64(h, w, eps):
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w


def _ln64(h, w, b, eps):
    c = h - h.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * w + b


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("n", [64, 769, 4096, 16384])
@pytest.mark.parametrize("kind", ["rms", "add_rms", "add_ln"])
def test_family_values_and_grads(kind, n, jit):
    """Values against float64 NumPy, and gradients against jax.vjp of a pure-JAX float32 form
    of the same function (its own rounding sets the tolerance)."""
    m = 200
    x = fresh((m, n), jnp.bfloat16)
    r = fresh((m, n), jnp.float32, 0.3, 1.0)
    w = fresh((n,), jnp.float32, 1.0, 0.3)
    b = fresh((n,), jnp.bfloat16, 0.0, 0.3)
    dy = fresh((m, n), jnp.bfloat16, 0.0, 1.0)
    dh = fresh((m, n), jnp.float32, 0.0, 0.5)

    def ours(x, r, w, b):
        if kind == "rms":
            return cj.rms_norm(x, w, 1e-6), r
        if kind == "add_rms":
            return cj.add_rms_norm(x, r, w, 1e-6)
        return cj.add_layer_norm(x, r, w, b, 1e-5)

    def plain(x, r, w, b):
        h = x.astype(jnp.float32) + r if kind != "rms" else x.astype(jnp.float32)
        ms = (h * h).mean(-1, keepdims=True)
        if kind == "add_ln":
            c = h - h.mean(-1, keepdims=True)
            rs = jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5)
            y = c * rs * w + b.astype(jnp.float32)
        else:
            y = h * jax.lax.rsqrt(ms + 1e-6) * w
        return y.astype(x.dtype), (h if kind != "rms" else r)

    fn = jax.jit(ours) if jit else ours
    (y, h), vjp = jax.vjp(fn, x, r, w, b)
    h64 = f64(x) + (f64(r) if kind != "rms" else 0.0)
    if kind != "rms":
        np.testing.assert_array_equal(f64(h), np.asarray(x.astype(jnp.float32) + r, np.float64))
    want = _ln64(h64, f64(w), f64(b), 1e-5) if kind == "add_ln" else _rms64(h64, f64(w), 1e-6)
    check(y, want, "y")
    got = vjp((dy, dh))
    _, pvjp = jax.vjp(plain, x, r, w, b)
    exp = pvjp((dy, dh))
    names = ("dx", "dresidual", "dw", "db")
    for name, g, e, a in zip(names, got, exp, (x, r, w, b)):
        if kind == "rms" and name in ("dresidual", "db"):
            continue
        if kind == "add_rms" and name == "db":
            continue
        assert g.dtype == a.dtype, name
        check(g, f64(e), name, rows=math.sqrt(m) if name in ("dw", "db") else 4)


def test_family_weight_offset_and_bad_input():
    x = fresh((16, 256), jnp.float32)
    w = fresh((256,), jnp.float32, 0.0, 0.1)
    y = cj.rms_norm(x, w, weight_offset=1.0)
    check(y, _rms64(f64(x), f64(w) + 1.0, 1e-6), "y")
    with pytest.raises(ValueError, match="residual must have the shape"):
        cj.add_rms_norm(x, fresh((16, 128), jnp.float32))
    with pytest.raises(ValueError, match="weight_offset needs a weight"):
        cj.rms_norm(x, None, weight_offset=1.0)


FAMILY_CALLS = {
    "layer_norm": lambda x, r, w, b: cj.layer_norm(x, w, b),
    "rms_norm": lambda x, r, w, b: cj.rms_norm(x, w),
    "add_rms_norm": lambda x, r, w, b: cj.add_rms_norm(x, r, w),
    "add_layer_norm": lambda x, r, w, b: cj.add_layer_norm(x, r, w, b),
}


@pytest.mark.parametrize("name", list(FAMILY_CALLS))
def test_jit_over_a_mesh_of_every_gpu(name):
    """Under jax.jit with x (and the residual) split by rows over a mesh of every GPU here (one
    on a one-GPU machine: the partitioned call is then the plain call): the outputs stay split
    like x, and the outputs and the gradients of x, residual, w and b match the call on
    unsplit arrays (dw and db summed across devices in float32), and so do the gradients of
    the same loss under jax.shard_map; on two GPUs or more the compiled program gathers no
    activation."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    gpus = jax.devices("gpu")
    mesh = jax.make_mesh((len(gpus),), ("d",), devices=gpus)
    split = NamedSharding(mesh, P("d"))
    shape = (4 * len(gpus), 37, 1024)
    x, r = fresh(shape, jnp.bfloat16), fresh(shape, jnp.float32)
    w, b = fresh((1024,), jnp.float32, loc=1.0), fresh((1024,), jnp.float32, loc=0.0)
    f = FAMILY_CALLS[name]

    def loss(x, r, w, b):  # (sin: a cotangent that differs from row to row)
        return sum(jnp.sin(t.astype(jnp.float32)).sum() for t in jax.tree.leaves(f(x, r, w, b)))

    step = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))
    want_y, want_g = step(x, r, w, b)
    xs, rs = jax.device_put(x, split), jax.device_put(r, split)
    got_y, got_g = step(xs, rs, w, b)
    for got, want in zip(jax.tree.leaves(got_y), jax.tree.leaves(want_y)):
        assert got.sharding.is_equivalent_to(xs.sharding, got.ndim), got.sharding
        assert bool(jnp.array_equal(got, want)), name
    rows = math.prod(shape[:-1])
    for i, (got, want) in enumerate(zip(got_g, want_g)):
        check(got, f64(want), f"{name} grad {i}", rows=math.sqrt(rows) if i >= 2 else 1)
    if len(gpus) > 1:
        hlo = step.lower(xs, rs, w, b).compile().as_text()
        assert " all-gather(" not in hlo
    grads = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=mesh,
                                  in_specs=(P("d"), P("d"), P(), P()),
                                  out_specs=(P("d"), P("d"), P(), P())))  # fmt: skip
    for i, (got, want) in enumerate(zip(grads(xs, rs, w, b), want_g)):
        check(got, f64(want), f"{name} shard_map grad {i}", rows=math.sqrt(rows) if i >= 2 else 1)


def test_quant_is_the_cupy_result():
    """quant= through cupyln.jax on GPU arrays, eager and jitted: the bytes of CuPy's call (the
    same kernels), in JAX's float8 dtypes; a 0-d array scale as an input of the program."""
    import cupy

    import cupyln

    n = 4096
    x, r, w, b = (ref.sample(sh, ref.BFLOAT16, loc=lc, seed=9500 + i)
                  for i, (sh, lc) in enumerate((((4, 50, n), -2.3), ((4, 50, n), 0.3),
                                                ((n,), 1.0), ((n,), 0.1))))  # fmt: skip
    jx, jr, jw, jb = (jnp.asarray(cupy.asnumpy(a)) for a in (x, r, w, b))
    gamax = jnp.asarray(np.float32(8.0))
    for quant, kw in (("mxfp8", {"scale_layout": "cublas"}), ("nvfp4", {"global_amax": 8.0}),
                      ("nvfp4", {"global_amax": gamax}), ("fp8_row", {"scale_ub": 3.0}),
                      ("fp8_block", {"block": 64}), ("fp8", {"scale": 0.02})):  # fmt: skip
        ckw = {k: (cupy.asarray(np.float32(8.0)) if k == "global_amax" and not isinstance(v, float)
                   else v) for k, v in kw.items()}  # fmt: skip
        want = [cupyln.rms_forward(x, w, quant=quant, **ckw)[0],
                cupyln.forward(x, w, b, residual=r, quant=quant, **ckw)[0]]  # fmt: skip
        opts = dict(quant=quant, **kw)
        calls = [lambda a, c, d, e, o=opts: cj.rms_norm(a, d, **o),
                 lambda a, c, d, e, o=opts: cj.add_layer_norm(a, c, d, e, **o)[0]]  # fmt: skip
        for f, q in zip(calls, want):
            for g in (f, jax.jit(f)):
                got = g(jx, jr, jw, jb)
                for a, c in ((got.data, q.data), (got.scale, q.scale)):
                    ha = np.asarray(a)
                    ha = ha.view(np.uint8) if ha.dtype.itemsize == 1 else ha
                    # fp8's scale is the one given: CuPy's float, JAX's float32 array of it
                    hc = cupy.asnumpy(c).astype(ha.dtype, copy=False)
                    assert np.array_equal(ha.reshape(-1), hc.reshape(-1)), quant
    assert got.data.dtype == jnp.float8_e4m3fn
