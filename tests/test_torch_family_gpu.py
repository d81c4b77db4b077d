"""GPU tier of the torch bridge's norm family: rms_norm / RMSNorm against F.rms_norm in float64,
add_rms_norm / add_layer_norm against the add then torch's norm in float64 (values and the
gradients of input, residual, weight and bias, through y and h), opcheck, torch.compile
(fullgraph=True), CUDA graph replay, the module swap and the CPU fallback."""

import math

import pytest

from .conftest import requires_gpu
from .test_torch_gpu import close

torch = pytest.importorskip("torch")
clt = pytest.importorskip("cupyln.torch")

TORCH_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    requires_gpu,
    pytest.mark.skipif(TORCH_GPUS == 0, reason="torch has no CUDA here"),
]
F = torch.nn.functional
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NS = [1, 3, 769, 1024, 4096, 16384, 65536]


def rand(shape, dtype, seed, loc=-2.3, scale=0.5):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (loc + scale * torch.randn(shape, generator=g, device="cuda")).to(dtype)


def grads(out, inputs, grad_outs):
    got = torch.autograd.grad(out, [t for t in inputs if t is not None], grad_outs)
    return list(got)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("xdt", DTYPES)
def test_rms_norm_matches_f_rms_norm(xdt, n):
    m = 67
    x = rand((m, n), xdt, 1).requires_grad_()
    w = rand((n,), xdt, 2, 1.0, 0.3).requires_grad_()
    dy = rand((m, n), xdt, 3, 0.0, 1.0)
    y = clt.rms_norm(x, (n,), w, 1e-6)
    gx, gw = grads(y, (x, w), dy)
    xs, ws = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = F.rms_norm(xs, (n,), ws, 1e-6)
    gxr, gwr = torch.autograd.grad(yr, (xs, ws), dy.double())
    assert y.dtype == xdt and gw.dtype == xdt
    close(y.detach(), yr.detach(), "y")
    close(gx, gxr, "dx")
    close(gw, gwr, "dw", rows=math.sqrt(m))


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_eps_none_as_torch(xdt):
    x = rand((8, 512), xdt, 4, 0.0, 1e-4)  # tiny values: eps decides
    want = F.rms_norm(x.double(), (512,), None, torch.finfo(torch.float32).eps)
    close(clt.rms_norm(x, (512,)), want, "y")
    close(clt.RMSNorm(512, device="cuda", dtype=xdt)(x).detach(), want, "y (module)")


ADD_DTYPES = [(torch.bfloat16, None), (torch.float16, None), (torch.float32, None),
              (torch.bfloat16, torch.float32)]  # fmt: skip


@pytest.mark.parametrize("n", [127, 1024, 4096, 16384, 32768])
@pytest.mark.parametrize("xdt,hdt", ADD_DTYPES)
@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_add_norm_values_and_grads(kind, xdt, hdt, n):
    m = 51
    x = rand((m, n), xdt, 5).requires_grad_()
    r = rand((m, n), xdt if hdt is None else hdt, 6, 0.3, 1.0).requires_grad_()
    w = rand((n,), xdt, 7, 1.0, 0.3).requires_grad_()
    b = rand((n,), xdt, 8, 0.0, 0.3).requires_grad_()
    dy = rand((m, n), xdt, 9, 0.0, 1.0)
    hd = r.dtype if hdt is None else hdt
    dh = rand((m, n), hd, 10, 0.0, 0.5)
    if kind == "rms":
        y, h = clt.add_rms_norm(x, r, (n,), w, 1e-6, residual_dtype=hdt)
        inputs = (x, r, w)
    else:
        y, h = clt.add_layer_norm(x, r, (n,), w, b, 1e-5, residual_dtype=hdt)
        inputs = (x, r, w, b)
    got = grads((y, h), inputs, (dy, dh))
    want_h = (x.detach().float() + r.detach().float()).to(hd)
    assert h.dtype == hd and torch.equal(h.detach(), want_h)
    # the norm is of h as stored (rounded to its dtype), in the forward and the backward alike:
    # the reference differentiates it at that h, and dh reaches x and residual unchanged
    hs = want_h.double().requires_grad_()
    params = [t.detach().double().requires_grad_() for t in inputs[2:]]
    if kind == "rms":
        ys = F.rms_norm(hs, (n,), params[0], 1e-6)
    else:
        ys = F.layer_norm(hs, (n,), params[0], params[1], 1e-5)
    gh, *gparams = torch.autograd.grad(ys, [hs, *params], dy.double())
    gref = [gh + dh.double(), gh + dh.double(), *gparams]
    close(y.detach(), ys.detach(), "y")
    for name, g, gr, t in zip(("dx", "dresidual", "dw", "db"), got, gref, inputs):
        assert g.dtype == t.dtype, name
        close(g, gr, name, rows=math.sqrt(m) if name in ("dw", "db") else 1)


def test_weight_offset_is_gemmas_one_plus_w():
    n, m = 2048, 33
    x = rand((m, n), torch.bfloat16, 11).requires_grad_()
    w = rand((n,), torch.bfloat16, 12, 0.0, 0.1).requires_grad_()
    dy = rand((m, n), torch.bfloat16, 13, 0.0, 1.0)
    y = clt.rms_norm(x, (n,), w, 1e-6, weight_offset=1.0)
    gx, gw = grads(y, (x, w), dy)
    xs, ws = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = F.rms_norm(xs, (n,), 1.0 + ws, 1e-6)
    gxr, gwr = torch.autograd.grad(yr, (xs, ws), dy.double())
    close(y.detach(), yr.detach(), "y")
    close(gx, gxr, "dx")
    close(gw, gwr, "dw", rows=math.sqrt(m))


def test_family_opcheck():
    x = rand((5, 64), torch.float32, 14).requires_grad_()
    r = rand((5, 64), torch.float32, 15).requires_grad_()
    w = rand((64,), torch.float32, 16).requires_grad_()
    b = rand((64,), torch.float32, 17).requires_grad_()
    op = torch.ops.cupyln.norm_fwd.default
    torch.library.opcheck(op, (x, None, w, None, 1e-6, True, None, 0.0))
    torch.library.opcheck(op, (x, r, w, b, 1e-5, False, None, 0.0))
    torch.library.opcheck(op, (x, r, w, None, 1e-6, True, None, 1.0))


def test_family_compile_fullgraph_and_module_swap():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.RMSNorm(256),
                                torch.nn.GELU(), torch.nn.LayerNorm(256)).cuda()  # fmt: skip
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    out_t = model(x)
    out_t.sum().backward()
    grad_t = x.grad.clone()
    x.grad = None
    clt.replace_norms(model)
    assert isinstance(model[1], clt.RMSNorm) and isinstance(model[3], clt.LayerNorm)
    compiled = torch.compile(model, fullgraph=True)
    out_c = compiled(x)
    out_c.sum().backward()
    torch.testing.assert_close(out_c, out_t, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad, grad_t, rtol=1e-4, atol=1e-4)

    def block(a, res, w):
        y, h = clt.add_rms_norm(a, res, (256,), w)
        return (y * 2 + h).sum()

    a = torch.randn(8, 256, device="cuda", requires_grad=True)
    res = torch.randn(8, 256, device="cuda", requires_grad=True)
    w = torch.rand(256, device="cuda", requires_grad=True)
    ge = torch.autograd.grad(block(a, res, w), (a, res, w))
    gc = torch.autograd.grad(torch.compile(block, fullgraph=True)(a, res, w), (a, res, w))
    for e, c in zip(ge, gc):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


def test_family_cuda_graph_replay():
    n = 1024
    sx = rand((64, n), torch.bfloat16, 18).requires_grad_()
    sr = rand((64, n), torch.bfloat16, 19).requires_grad_()
    w = rand((n,), torch.float32, 20, 1.0, 0.3).requires_grad_()
    sdy = rand((64, n), torch.bfloat16, 21, 0.0, 1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels before capture
        for _ in range(2):
            y, h = clt.add_rms_norm(sx, sr, (n,), w)
            torch.autograd.backward((y, h), (sdy, sdy))
    torch.cuda.current_stream().wait_stream(side)
    sx.grad = sr.grad = w.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sy, sh = clt.add_rms_norm(sx, sr, (n,), w)
        torch.autograd.backward((sy, sh), (sdy, sdy))
    x2 = rand((64, n), torch.bfloat16, 22)
    with torch.no_grad():
        sx.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    ex, er = x2.clone().requires_grad_(), sr.detach().clone().requires_grad_()
    ew = w.detach().clone().requires_grad_()
    ey, eh = clt.add_rms_norm(ex, er, (n,), ew)
    torch.autograd.backward((ey, eh), (sdy, sdy))
    assert torch.equal(sy, ey) and torch.equal(sh, eh)
    assert torch.equal(sx.grad, ex.grad) and torch.equal(w.grad, ew.grad)


def test_family_cpu_fallback_and_bad_input():
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64)
    torch.testing.assert_close(clt.rms_norm(x, (64,), w), F.rms_norm(x, (64,), w))
    y, h = clt.add_layer_norm(x, r, (64,), w, None)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (64,), w, None))
    xc = x.cuda()
    with pytest.raises(ValueError, match="residual must have the shape"):
        clt.add_rms_norm(xc, torch.randn(4, 32, device="cuda"), (64,))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        clt.add_rms_norm(xc, 3.0, (64,))
    with pytest.raises(ValueError, match="weight must have shape"):
        clt.rms_norm(xc, (64,), torch.rand(32, device="cuda"))
