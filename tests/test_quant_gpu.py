"""quant=: the norm quantized in its own pass (CuPy API).

CPU tier: the plans give a quantized y the register rows with the Store's format codes, fuse or
unfuse a residual add as for a plain y, and refuse rows no block holds; the checks refuse bad
operands by name. GPU tier: LayerNorm and RMSNorm, with a residual add and a weight offset, in
each format against the float64 reference quantized at the kernel's own scales (every element
within one code of it, nearly all equal), the scales against the reference's, into a NaN-
poisoned pool; the cuBLAS layout as the rows layout tiled; fp8's amax; the statistics as the
plain call's.
"""

import itertools

import ml_dtypes
import numpy as np
import pytest

from cupyln import _formats as Q
from cupyln import reference as ref
from cupyln._plans import forward as F

from .conftest import requires_gpu
from .test_plans import SMEM_H100

BF16, F16, F32, F64 = ref.BFLOAT16, np.dtype(np.float16), np.dtype(np.float32), np.dtype("f8")
_seed = itertools.count(9700)


# ------------------------------------------------------------------------------- CPU tier
def test_plans_quantize_in_the_register_rows():
    for quant, block in (("fp8", None), ("fp8_row", None), ("fp8_block", 64), ("mxfp8", None),
                         ("nvfp4", None)):  # fmt: skip
        for n in (128, 1024, 4096, 16384, 65536):
            s = Q.spec(quant, n, block=block) if block else Q.spec(quant, n)
            p = F.forward_launch_plan(100, n, BF16, BF16, BF16, 8, SMEM_H100, 8, 132, 40e9,
                                      quant=s)  # fmt: skip
            codes = Q.store_args(s)
            assert p.tier == "reg" and p.cluster == 1 and not p.unfused, (quant, n, p)
            assert p.arg("TY") == np.uint8 and all(p.arg(k) == v for k, v in codes.items())
            if s.block:  # a block's packs inside a warp, or spread over whole rows' lanes
                pb = s.block // 8
                assert pb <= 32 or pb % p.tpr == 0
    # a residual add: fused where a block of 512 holds the row at 4 packs a thread, else first
    s = Q.spec("mxfp8", 8192)
    p = F.forward_launch_plan(100, 8192, BF16, BF16, BF16, 8, SMEM_H100, 8, 132, 40e9,
                              residual=(BF16, BF16), quant=s)  # fmt: skip
    assert p.arg("TR") == BF16 and not p.unfused
    s = Q.spec("mxfp8", 32768)
    p = F.forward_launch_plan(100, 32768, BF16, BF16, BF16, 8, SMEM_H100, 8, 132, 40e9,
                              residual=(BF16, BF16), quant=s)  # fmt: skip
    assert p.unfused and p.arg("TR") is None and p.arg("QF") == Q.CODES["mxfp8"]
    with pytest.raises(ValueError, match="at most 32768 elements of float32"):
        F.forward_plan(65536, F32, F32, F32, 4, SMEM_H100, 8, quant=Q.spec("fp8_row", 65536))


def test_precompile_plans_the_quantized_store():
    from cupyln._problem import for_precompile

    s = Q.spec("nvfp4", 4096, scale_layout="cublas")
    p, _ = for_precompile(4096, BF16, rms=True, quant="nvfp4", scale_layout="cublas")
    assert p.ty == np.uint8 and p.quant == s
    plans = F.forward_launch_plans(4096, BF16, BF16, BF16, 8, SMEM_H100, 8, rms=True, y_dtype=p.ty,
                                   quant=s)  # fmt: skip
    assert {pl.arg("QF") for pl in plans} == {Q.CODES["nvfp4"]}
    for m in (1, 1 << 20):  # a short launch and a long one
        launched = F.forward_launch_plan(m, 4096, BF16, BF16, BF16, 8, SMEM_H100, 8, 132, 40e9,
                                         rms=True, y_dtype=p.ty, quant=s)  # fmt: skip
        assert launched in plans
    with pytest.raises(ValueError, match="out_dtype does not apply"):
        for_precompile(4096, BF16, out_dtype=F32, quant="nvfp4")
    with pytest.raises(TypeError, match="precompile takes no scale="):
        for_precompile(4096, BF16, quant="fp8", scale=1.0)


def test_store_args_and_outputs():
    s = Q.spec("fp8_block", 200, block=64, pow2_scale=True, fp8_dtype="e5m2")
    assert Q.store_args(s) == {"QF": 3, "QB": 64, "QO": Q.E5M2_BIT | Q.POW2_BIT}
    assert Q.outputs(s, (2, 3, 200)) == (((2, 3, 200), np.uint8), ((2, 3, 4), np.float32))
    s = Q.spec("nvfp4", 64, scale_layout="cublas")
    assert Q.outputs(s, (5, 64)) == (((5, 32), np.uint8), ((128, 4), np.uint8))
    assert Q.outputs(Q.spec("fp8", 8), (2, 8))[1] is None  # the caller's scale


def test_operands_are_checked_by_name():
    with pytest.raises(TypeError, match="unexpected keyword argument 'scales'"):
        Q.split_options({"scales": 1.0})
    opts, ops = Q.split_options({"block": 64, "scale": 2.0})
    assert opts == {"block": 64} and ops == {"scale": 2.0}
    with pytest.raises(ValueError, match="quant='fp8' needs scale="):
        Q.needed(Q.spec("fp8", 8), {})
    with pytest.raises(ValueError, match="quant='nvfp4' needs global_amax="):
        Q.needed(Q.spec("nvfp4", 16), {"global_amax": None})
    with pytest.raises(ValueError, match="scale= applies to quant='fp8' only"):
        Q.needed(Q.spec("mxfp8", 32), {"scale": 1.0})
    with pytest.raises(ValueError, match="amax= applies to quant='fp8' only"):
        Q.needed(Q.spec("fp8_row", 32), {"amax": object()})


def test_scalar_operands_are_checked_by_name():
    """The one check of scale=, global_amax= and amax= every front end calls, with NumPy arrays
    standing for the front end's: a number or a 0-d float32 array, by name."""

    def is_array(a):
        return isinstance(a, np.ndarray)

    s = Q.spec("fp8", 8)
    assert Q.scalar_operand(s, {"scale": 2}, is_array, "array") == ("scale", None, 2.0)
    a = np.zeros((), np.float32)
    assert Q.scalar_operand(s, {"scale": a}, is_array, "array")[1] is a
    assert Q.scalar_operand(Q.spec("mxfp8", 32), {}, is_array, "array") == (None, None, 0.0)
    with pytest.raises(ValueError, match=r"scale must be a float or a 0-d float32 array; got "
                                         r"float64 of shape \(\)"):  # fmt: skip
        Q.scalar_operand(s, {"scale": np.zeros((), np.float64)}, is_array, "array")
    with pytest.raises(ValueError, match="global_amax must be a float or a 0-d float32 tensor"):
        Q.scalar_operand(Q.spec("nvfp4", 16), {"global_amax": np.zeros(2, np.float32)}, is_array,
                         "tensor")  # fmt: skip
    with pytest.raises(TypeError, match="scale must be a float"):
        Q.scalar_operand(s, {"scale": "1"}, is_array, "array")
    with pytest.raises(TypeError, match="amax must be a 0-d float32 cupy.ndarray; got float32"):
        Q.zero_d(np.float32(0), "amax", "cupy.ndarray", is_array, TypeError)
    Q.zero_d(a, "amax", "cupy.ndarray", is_array, TypeError)


# ------------------------------------------------------------------------------- GPU tier
def _signed(codes, sign_bit: int):
    """Sign-magnitude codes as signed ints: neighbours in value differ by one."""
    c = codes.astype(np.int32)
    return np.where(c & sign_bit, -(c & (sign_bit - 1)), c)


def _codes(values, s):
    """float64 values to the format's codes (nearest even, saturating), as uint8."""
    v = np.clip(values, -s.max, s.max).astype(s.dtype)
    if s.name == "nvfp4":
        return v.view(np.uint8) & 0xF
    return v.view(np.uint8)


def _unpack(data, s):
    """The kernel's element codes, fp4 ones unpacked (the first in the low nibble)."""
    if s.name != "nvfp4":
        return data
    out = np.empty((*data.shape[:-1], data.shape[-1] * 2), np.uint8)
    out[..., 0::2] = data & 0xF
    out[..., 1::2] = data >> 4
    return out


def _within_a_code(got, want, bit, what, near=None):
    """Codes of sign bit ``bit`` within one of each other (or, where ``near`` says so, close in
    value), and nearly all equal."""
    d = np.abs(_signed(got, bit) - _signed(want, bit))
    far = d > 1 if near is None else (d > 1) & ~near
    assert not far.any(), (what, int(d[far].max()), np.argwhere(far)[:5])
    assert (d == 0).mean() >= 0.99, (what, float((d == 0).mean()))


def _values(codes, s):
    """The kernel's element codes as float64 values."""
    dtype = ml_dtypes.float4_e2m1fn if s.name == "nvfp4" else s.dtype
    return codes.view(dtype).astype(np.float64)


def _bytes(a):
    """A CuPy, torch or JAX output on the host: float32 as it is, 1-byte dtypes as uint8."""
    h = ref._host(a)
    return h.view(np.uint8) if h.dtype.itemsize == 1 else h


def _rows_scales(sc, s, m, n):
    """The kernel's scales as [M, blocks], from either layout (cuBLAS padding checked zero)."""
    nb = s.blocks(n)
    if s.scale_layout == "rows":
        return sc.reshape(m, nb)
    r, c = np.meshgrid(np.arange(m), np.arange(nb), indexing="ij")
    flat = sc.reshape(-1)
    got = flat[Q.cublas_offset(r, c, nb)]
    mask = np.ones(flat.shape, bool)
    mask[Q.cublas_offset(r, c, nb).reshape(-1)] = False
    assert not flat[mask].any(), "the cuBLAS layout's padding is zero"
    return got


def _check_quantized(q, y64, s, what, given=None, global_amax=None):
    """q against the float64 y: scales as the reference forms them from max|y| (E8M0 and e4m3
    block scales within a code, float scales within float32 rounding), elements within one
    code of the reference's at the kernel's own scales."""
    m, n = int(np.prod(y64.shape[:-1])), y64.shape[-1]
    rows = y64.reshape(m, n)
    data = _unpack(_bytes(q.data), s).reshape(m, n)
    ref_data, ref_scale = ref.quantize(y64, s.name, scale=given, global_amax=global_amax,
                                       **_options(s))  # fmt: skip
    if s.name == "fp8":
        want = rows / float(np.float32(given))
    else:
        got_sc = _rows_scales(_bytes(q.scale), s, m, n)
        want_sc = _rows_scales(np.asarray(ref_scale), s, m, n)
        width = s.block or n
        pad = np.pad(rows, ((0, 0), (0, -n % width))).reshape(m, -1, width)
        if s.name == "mxfp8":
            d = np.abs(got_sc.astype(np.int32) - want_sc.astype(np.int32))
            assert d.max() <= 1 and (d == 0).mean() >= 0.999, (what, "scales")
            inv = np.ldexp(1.0, 127 - got_sc.astype(np.int32))
            want = (pad * inv[..., None]).reshape(m, -1)[:, :n]
        elif s.name == "nvfp4":
            _within_a_code(got_sc, want_sc.view(np.uint8), 0x80, what + " block scales")
            sv = got_sc.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            g = np.float32(global_amax)
            big = float(np.float32(2688.0) / g) if g else 1.0
            with np.errstate(divide="ignore", invalid="ignore"):
                v = np.where(sv[..., None] > 0, pad * big / sv[..., None], 0.0)
            want = v.reshape(m, -1)[:, :n]
        else:
            np.testing.assert_allclose(got_sc, want_sc, rtol=2e-6, err_msg=what + " scales")
            want = (pad / got_sc.astype(np.float64)[..., None]).reshape(m, -1)[:, :n]
    # y's float32 arithmetic (a few ulp of its terms, ~1e-6 of max|y|) in the scaled domain: e5m2
    # resolves 2^-16 near 0, so an element that cancels to near 0 may lie codes apart
    near = np.abs(_values(data, s) - np.clip(want, -s.max, s.max)) <= 1e-6 * np.abs(want).max()
    _within_a_code(data, _codes(want, s), 0x8 if s.name == "nvfp4" else 0x80, what, near)
    assert ref_data.shape[:-1] == y64.shape[:-1]


def _options(s):
    out = {}
    if s.name != "nvfp4" and s.dtype == Q.E5M2:
        out["fp8_dtype"] = "e5m2"
    if s.name == "fp8_block":
        out["block"] = s.block
        out["pow2_scale"] = s.pow2_scale
    if s.scale_ub is not None:
        out["scale_ub"] = s.scale_ub
    if s.scale_layout != "rows":
        out["scale_layout"] = s.scale_layout
    return out


CASES = [  # (quant, options, operands)
    ("fp8", {}, {"scale": 0.0125}),
    ("fp8", {"fp8_dtype": "e5m2"}, {"scale": 0.002}),
    ("fp8_row", {}, {}),
    ("fp8_row", {"scale_ub": 1.5}, {}),
    ("fp8_block", {}, {}),
    ("fp8_block", {"block": 64, "pow2_scale": True}, {}),
    ("mxfp8", {}, {}),
    ("mxfp8", {"fp8_dtype": "e5m2", "scale_layout": "cublas"}, {}),
    ("nvfp4", {}, {"global_amax": 9.0}),
    ("nvfp4", {"scale_layout": "cublas"}, {"global_amax": 0.0}),
]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n", [128, 1000, 4096, 16384])
@pytest.mark.parametrize("dtype", [BF16, F16, F32, F64], ids=lambda d: d.name)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_format_of_each_norm(case, dtype, n):
    import cupy

    import cupyln

    quant, opts, ops = CASES[case]
    if n % (Q.FORMATS[quant].block or 1) and Q.FORMATS[quant].divides:
        pytest.skip("N is not a multiple of the block")
    if dtype == F64 and n > 4096:
        pytest.skip("float64 rows of the register tier")
    seed = next(_seed)
    shape = (3, 43, n)  # 129 rows: the cuBLAS layout pads past 128
    x = ref.sample(shape, dtype, seed=seed)
    r = ref.sample(shape, dtype, seed=seed + 1)
    w = ref.sample((n,), dtype, loc=1.0, seed=seed + 2)
    b = ref.sample((n,), dtype, loc=0.1, seed=seed + 3)
    s = Q.spec(quant, n, **opts)
    h = ref.add(x, r, dtype)
    runs = {
        "ln": (lambda **k: cupyln.forward(x, w, b, **k), ref.forward(x, w, b)[0]),
        "rms+offset": (lambda **k: cupyln.rms_forward(x, w, weight_offset=1.0, **k),
                       ref.rms_forward(x, w, weight_offset=1.0)[0]),
        "add+rms": (lambda **k: cupyln.rms_forward(x, w, residual=r, **k),
                    ref.rms_forward(h, w)[0]),
        "add+ln": (lambda **k: cupyln.forward(x, w, b, residual=r, **k), ref.forward(h, w, b)[0]),
    }  # fmt: skip
    for name, (call, y64) in runs.items():
        what = f"{quant} {opts} {dtype.name} N={n} {name}"
        ref.poison_pool(x.size * 4)
        got = call(quant=quant, **opts, **ops)
        plain = call()
        q = got[0]
        assert isinstance(q, cupyln.Quantized)
        for a, want in zip(got[1:], plain[1:]):  # the statistics (and h) as the plain call's
            cupy.testing.assert_allclose(a.astype(cupy.float64), want.astype(cupy.float64),
                                         rtol=1e-5, atol=1e-6, err_msg=what)  # fmt: skip
        _check_quantized(q, cupy.asnumpy(y64), s, what, ops.get("scale"), ops.get("global_amax"))


@pytest.mark.gpu
@requires_gpu
def test_precompile_with_quant_leaves_nothing_to_compile():
    import cupyln
    from cupyln import _compile

    n = 4096
    assert cupyln.precompile(n, "bfloat16", rms=True, quant="mxfp8", scale_layout="cublas",
                             backward=False) > 0  # fmt: skip
    compiled = len(_compile._functions)
    w = ref.sample((n,), BF16, loc=1.0, seed=9670)
    for m in (1, 7, 1000, 20000):
        x = ref.sample((m, n), BF16, seed=9671 + m)
        cupyln.rms_forward(x, w, quant="mxfp8", scale_layout="cublas")
        assert len(_compile._functions) == compiled, f"M={m}: a kernel compiled"


@pytest.mark.gpu
@requires_gpu
def test_fp8_scale_as_an_array_and_the_amax_it_writes():
    import cupy

    import cupyln

    x = ref.sample((64, 2048), BF16, seed=9690)
    w = ref.sample((2048,), BF16, loc=1.0, seed=9691)
    scale = cupy.asarray(np.float32(0.01))
    amax = cupy.full((), 123.0, cupy.float32)  # overwritten, not maxed with
    q, _ = cupyln.rms_forward(x, w, quant="fp8", scale=scale, amax=amax)
    y64 = cupy.asnumpy(ref.rms_forward(x, w)[0])
    assert q.scale is scale
    np.testing.assert_allclose(float(amax), np.abs(y64).max(), rtol=1e-5)
    _check_quantized(q, y64, Q.spec("fp8", 2048), "fp8 array scale", given=0.01)


@pytest.mark.gpu
@requires_gpu
def test_bad_quant_calls_raise_before_writing():
    import cupy

    import cupyln

    x = ref.sample((4, 80), BF16, seed=9680)
    w = ref.sample((80,), BF16, seed=9681)
    cases = [
        (dict(quant="mxfp8"), ValueError, "multiple of 32; got N = 80"),
        (dict(quant="fp8"), ValueError, "needs scale="),
        (dict(quant="fp8", scale="1"), TypeError, "scale must be a float"),
        (dict(quant="fp8", scale=cupy.ones(2, cupy.float32)), ValueError, "0-d float32"),
        (dict(quant="fp8_row", out_dtype=F32), ValueError, "out_dtype does not apply"),
        (dict(quant="fp8_row", out=(None, None)), ValueError, "out= does not take"),
        (dict(block=64), TypeError, "block= needs quant="),
        (dict(quant="fp8_row", scales=1), TypeError, "unexpected keyword argument 'scales'"),
        (dict(quant="fp8", scale=1.0, amax=np.float32(0)), TypeError, "amax must be a 0-d"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=msg):
            cupyln.rms_forward(x, w, **kw)
    assert cupyln.rms_norm(x, w, quant="fp8_row").data.dtype == np.uint8


# ------------------------------------------------------------------------------- torch
def test_torch_op_fake_shapes_and_the_refusal_under_autograd():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import cupyln.torch  # noqa: F401 - defines the ops

    op = torch.ops.cupyln.norm_fwd_q.default
    with FakeTensorMode():
        x = torch.empty(4, 5, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.bfloat16)
        for quant, layout, data_shape, scale in (
            ("mxfp8", "rows", (4, 5, 64), ((4, 5, 2), torch.float8_e8m0fnu)),
            ("nvfp4", "cublas", (4, 5, 32), ((128, 4), torch.float8_e4m3fn)),
            ("fp8_row", "rows", (4, 5, 64), ((4, 5, 1), torch.float32)),
        ):
            got = op(x, None, w, None, 1e-6, True, None, 0.0, quant, 0, False, 0.0, layout,
                     "e4m3", None, 1.0, False)  # fmt: skip
            assert tuple(got[0].shape) == data_shape
            assert (tuple(got[1].shape), got[1].dtype) == scale
            assert got[2].numel() == 0 and got[3].shape == (4, 5)
    x = torch.ones(2, 64, requires_grad=True)
    with pytest.raises(ValueError, match="quant= is forward-only"):
        op(x, None, None, None, 1e-6, True, None, 0.0, "fp8_row", 0, False, 0.0, "rows", "e4m3",
           None, 0.0, False)  # fmt: skip
    with pytest.raises(ValueError, match="quant= needs CUDA tensors"):
        cupyln.torch.rms_norm(torch.ones(2, 64), (64,), quant="mxfp8")


@pytest.mark.gpu
@requires_gpu
def test_torch_quant_is_the_cupy_result():
    torch = pytest.importorskip("torch")
    import cupy

    import cupyln
    import cupyln.torch as ct

    n = 4096
    x = ref.sample((6, 50, n), BF16, seed=9650)
    r = ref.sample((6, 50, n), BF16, seed=9651)
    w = ref.sample((n,), BF16, loc=1.0, seed=9652)
    b = ref.sample((n,), BF16, seed=9653)
    tx, tr, tw, tb = (torch.from_dlpack(a) for a in (x, r, w, b))
    cases = [
        (lambda **k: ct.rms_norm(tx, (n,), tw, 1e-6, **k),
         lambda **k: cupyln.rms_norm(x, w, 1e-6, **k)),
        (lambda **k: ct.layer_norm(tx, (n,), tw, tb, **k),
         lambda **k: cupyln.layer_norm(x, w, b, **k)),
        (lambda **k: ct.add_rms_norm(tx, tr, (n,), tw, 1e-6, **k)[0],
         lambda **k: cupyln.rms_forward(x, w, 1e-6, residual=r, **k)[0]),
        (lambda **k: ct.add_layer_norm(tx, tr, (n,), tw, tb, **k)[0],
         lambda **k: cupyln.forward(x, w, b, residual=r, **k)[0]),
    ]  # fmt: skip
    for quant, kw in (("mxfp8", {"scale_layout": "cublas"}), ("nvfp4", {"global_amax": 8.0}),
                      ("fp8_row", {}), ("fp8_block", {"block": 64})):  # fmt: skip
        for ours, theirs in cases:
            got, want = ours(quant=quant, **kw), theirs(quant=quant, **kw)
            for a, c in ((got.data, want.data), (got.scale, want.scale)):
                a_bytes = a.view(torch.uint8) if a.dtype != torch.float32 else a
                assert torch.equal(a_bytes.reshape(-1), torch.from_dlpack(c).reshape(-1)), quant
    assert got.data.dtype == torch.float8_e4m3fn
    # fp8 with a tensor scale and amax; under torch.compile(fullgraph=True), as eagerly
    scale = torch.tensor(0.02, device="cuda")
    amax = torch.zeros((), device="cuda")
    q = ct.rms_norm(tx, (n,), tw, 1e-6, quant="fp8", scale=scale, amax=amax)
    y = torch.from_dlpack(cupyln.rms_norm(x, w, 1e-6)).float()
    assert q.scale is scale and abs(float(amax) - float(y.abs().max())) <= 1e-2 * float(amax)
    f = torch.compile(lambda a, c: ct.rms_norm(a, (n,), c, 1e-6, quant="mxfp8"), fullgraph=True)
    with torch.no_grad():
        g = f(tx, tw)
    want = cupyln.rms_norm(x, w, 1e-6, quant="mxfp8")
    assert torch.equal(g.data.view(torch.uint8), torch.from_dlpack(want.data))
    with pytest.raises(ValueError, match="quant= is forward-only"):
        ct.rms_norm(tx, (n,), tw.clone().requires_grad_(), quant="mxfp8")
    with torch.no_grad():
        q, rstd = ct.forward(tx, tw.clone().requires_grad_(), None, 1e-6, rms=True, quant="fp8_row")
    assert rstd.shape == (6, 50) and q.scale.shape == (6, 50, 1)
    cupy.cuda.Device().synchronize()


# ------------------------------------------------------------------------------- JAX
@pytest.mark.parametrize("dtype", [BF16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_jax_on_the_cpu_quantizes_as_the_kernels(case, dtype):
    """cupyln.jax on CPU arrays, eager and jitted: JAX's ops with the kernels' rules, against
    the float64 reference as the GPU tier checks the kernels; gradients refused by name."""
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cupyln.jax")
    quant, opts, ops = CASES[case]
    n = 256
    cpu = jax.devices("cpu")[0]
    x, r, w, b = (ref.sample(sh, dtype, loc=lc, seed=9600 + i, xp=np)
                  for i, (sh, lc) in enumerate((((3, 43, n), -2.3), ((3, 43, n), 0.3),
                                                ((n,), 1.0), ((n,), 0.1))))  # fmt: skip
    jx, jr, jw, jb = (jax.device_put(a, cpu) for a in (x, r, w, b))
    h = ref.add(x, r, dtype)
    s = Q.spec(quant, n, **opts)
    runs = {
        "rms+offset": (lambda *a: cj.rms_norm(a[0], a[2], weight_offset=1.0, quant=quant, **opts,
                                              **ops), ref.rms_forward(x, w, weight_offset=1.0)[0]),
        "add+ln": (lambda *a: cj.add_layer_norm(*a, quant=quant, **opts, **ops)[0],
                   ref.forward(h, w, b)[0]),
    }  # fmt: skip
    for name, (f, y64) in runs.items():
        for how, g in (("eager", f), ("jit", jax.jit(f))):
            q = g(jx, jr, jw, jb)
            _check_quantized(q, y64, s, f"jax cpu {how} {quant} {opts} {dtype.name} {name}",
                             ops.get("scale"), ops.get("global_amax"))  # fmt: skip
    with pytest.raises(ValueError, match="quant= is forward-only"):
        jax.grad(lambda a: cj.rms_norm(a, jw, quant="mxfp8").data.astype(np.float32).sum())(jx)


@pytest.mark.gpu
@requires_gpu
def test_torch_quant_in_a_cuda_graph():
    """After precompile, a quantized norm captured in a CUDA graph replays to the eager bytes
    on new data (the op's outputs allocated once, by the capture)."""
    torch = pytest.importorskip("torch")
    import cupyln.torch as ct

    n = 2048
    ct.precompile((n,), torch.bfloat16, rms=True, quant="nvfp4", backward=False)
    x = torch.randn(64, n, device="cuda", dtype=torch.bfloat16) - 2.3
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        ct.rms_norm(x, (n,), w, quant="nvfp4", global_amax=10.0)  # warm-up off the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        q = ct.rms_norm(x, (n,), w, quant="nvfp4", global_amax=10.0)
    x.copy_(torch.randn_like(x) * 3 + 1)
    g.replay()
    with torch.no_grad():
        want = ct.rms_norm(x, (n,), w, quant="nvfp4", global_amax=10.0)
    torch.cuda.synchronize()
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scale.view(torch.uint8), want.scale.view(torch.uint8))
