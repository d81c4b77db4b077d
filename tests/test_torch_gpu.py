"""GPU tier of the torch bridge: values and gradients against torch.nn.functional.layer_norm in
float64, gradcheck, opcheck, torch.compile(fullgraph=True), CUDA graph replay, streams,
autocast, devices, and a short training run against nn.LayerNorm.

Tolerances: cupyln.reference.TOLERANCE by output dtype, at float32 arithmetic (float64 for
float64 input); dw/db allow atol * sqrt(rows), as in the core tests.
"""

import itertools
import math

import pytest

from cupyln import reference as ref
from cupyln._problem import Problem
from cupyln.bench_frameworks import gpt_block

from .conftest import GPU_COUNT, requires_gpu

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
# tiny, odd (scalar path), tier edges, shared-memory tier
NS = [1, 3, 64, 769, 1024, 4096, 8193, 16384, 65536]


def close(out, want, what, rows=1):
    """|out - want| <= atol * rows + rtol * |want| elementwise, NaN where want has NaN only."""
    arithmetic = "float64" if out.dtype == torch.float64 else "float32"
    atol, rtol = (max(p) for p in zip(ref.TOLERANCE[str(out.dtype)[6:]], ref.TOLERANCE[arithmetic]))
    assert torch.equal(torch.isnan(out), torch.isnan(want)), f"{what}: NaN where none expected"
    err = (out.double() - want).abs().nan_to_num()
    allow = atol * rows + rtol * want.abs()
    bad = err > allow
    assert not bool(bad.any()), (
        f"{what} ({out.dtype}): {int(bad.sum())} of {out.numel()} off, worst "
        f"{float(err.max()):.3g}"
    )  # fmt: skip


def reference(x, w, b, dy, shape, eps=1e-5):
    """y and grads of F.layer_norm evaluated in float64 on copies of the inputs."""
    xs = x.detach().double().requires_grad_()
    ws = None if w is None else w.detach().double().requires_grad_()
    bs = None if b is None else b.detach().double().requires_grad_()
    y = F.layer_norm(xs, shape, ws, bs, eps)
    y.backward(dy.double())
    return y.detach(), xs.grad, None if ws is None else ws.grad, None if bs is None else bs.grad


def make(shape, xdt, wdt, n_shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (-2.3 + 0.5 * torch.randn(shape, generator=g, device="cuda")).to(xdt)
    w = None if wdt is None else (1 + 0.3 * torch.randn(n_shape, generator=g, device="cuda"))
    b = None if wdt is None else 0.3 * torch.randn(n_shape, generator=g, device="cuda")
    w = None if w is None else w.to(wdt)
    b = None if b is None else b.to(wdt)
    dy = torch.randn(shape, generator=g, device="cuda").to(xdt)
    return x, w, b, dy


PAIRS = [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32), (torch.float16, None)]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("xdt,wdt", PAIRS)
def test_values_and_grads_match_torch(xdt, wdt, n):
    shape = (2, 19, n)
    x, w, b, dy = make(shape, xdt, wdt, (n,), seed=n)
    x.requires_grad_()
    for t in (w, b):
        if t is not None:
            t.requires_grad_()
    y = clt.layer_norm(x, (n,), w, b)
    y.backward(dy)
    yr, dxr, dwr, dbr = reference(x, w, b, dy, (n,))
    close(y, yr, "y")
    close(x.grad, dxr, "dx")
    if w is not None:
        close(w.grad, dwr, "dw", rows=math.sqrt(38))
        close(b.grad, dbr, "db", rows=math.sqrt(38))


@pytest.mark.parametrize("n", [64, 1000, 8192])
@pytest.mark.parametrize("xdt,wdt", PAIRS)
def test_functional_forward_and_backward(xdt, wdt, n):
    """forward / backward on torch tensors: y, mean, rstd and dx, dw, db against float64, no
    autograd recorded, and the same results as layer_norm's."""
    shape = (3, 7, n)
    x, w, b, dy = make(shape, xdt, wdt, (n,), seed=n + 1)
    x.requires_grad_()
    y, mean, rstd = clt.forward(x, w, b, 1e-5)
    assert not (y.requires_grad or mean.requires_grad or rstd.requires_grad)
    acc = torch.float64 if xdt == torch.float64 else torch.float32
    assert (mean.shape, mean.dtype, rstd.shape, rstd.dtype) == (shape[:-1], acc, shape[:-1], acc)
    xd = x.detach().double()
    close(mean, xd.mean(-1), "mean")
    close(rstd, 1 / torch.sqrt(xd.var(-1, unbiased=False) + 1e-5), "rstd")
    yr, dxr, dwr, dbr = reference(x, w, b, dy, (n,))
    close(y, yr, "y")
    dx, dw, db = clt.backward(dy, x, w, mean, rstd)
    assert not (dx.requires_grad or dw.requires_grad or db.requires_grad)
    close(dx, dxr, "dx")
    if w is None:
        assert dw.numel() == 0 and db.dtype == xdt
    else:
        close(dw, dwr, "dw", rows=math.sqrt(21))
        close(db, dbr, "db", rows=math.sqrt(21))
    y2 = clt.layer_norm(x, (n,), w, b)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(dx, x.grad)


@pytest.mark.parametrize("layout", ["one row", "no rows", "strided rows", "transposed"])
def test_functional_layouts(layout):
    """forward / backward at any leading shape and layout: y and dx contiguous in x's shape,
    mean and rstd in its rows' shape (0-d for one row), every value against float64."""
    n = 96
    big, w, b, dy = make((6, 2 * n), torch.bfloat16, torch.float32, (n,), seed=21)
    x = {
        "one row": big[2, :n],
        "no rows": big[:0, :n],
        "strided rows": big[:, n:],  # rows 2n apart, read in place
        "transposed": big[:, :n].t().contiguous().t(),  # columns 6 apart: copied
    }[layout]
    dy = dy[: x.shape[0], :n] if x.dim() == 2 else dy[0, :n]
    y, mean, rstd = clt.forward(x, w, b)
    assert y.shape == x.shape and y.is_contiguous() and y.dtype == x.dtype
    assert mean.shape == rstd.shape == x.shape[:-1] and mean.dtype == torch.float32
    yr, dxr, dwr, dbr = reference(x, w, b, dy, (n,))
    close(y, yr, "y")
    xd = x.double()
    close(mean, xd.mean(-1), "mean")
    close(rstd, 1 / torch.sqrt(xd.var(-1, unbiased=False) + 1e-5), "rstd")
    dx, dw, db = clt.backward(dy, x, w, mean, rstd)
    assert dx.shape == x.shape and dx.is_contiguous()
    close(dx, dxr, "dx")
    zeros = torch.zeros(n, dtype=torch.float64, device="cuda")  # (no rows: no gradient at all)
    close(dw, zeros if dwr is None else dwr, "dw", rows=math.sqrt(6))
    close(db, zeros if dbr is None else dbr, "db", rows=math.sqrt(6))


def test_functional_under_compile():
    """Compiled, forward and backward are the ops, on detached inputs: the eager results."""
    x, w, b, dy = make((5, 1000), torch.bfloat16, torch.float32, (1000,), seed=12)
    x.requires_grad_()

    @torch.compile(fullgraph=True)
    def both(x, w, b, dy):
        y, mean, rstd = clt.forward(x, w, b)
        return (y, *clt.backward(dy, x, w, mean, rstd))

    got = both(x, w, b, dy)
    y, mean, rstd = clt.forward(x, w, b)
    want = (y, *clt.backward(dy, x, w, mean, rstd))
    for g, e, name in zip(got, want, ("y", "dx", "dw", "db")):
        assert not g.requires_grad and torch.equal(g, e), name


def test_functional_bad_input_is_refused():
    x, w, b, dy = make((4, 8), torch.float32, torch.float32, (8,), seed=11)
    y, mean, rstd = clt.forward(x, w, b)
    with pytest.raises(ValueError, match="input must have at least one dimension"):
        clt.forward(x[0, 0], None, None)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\); got \(7,\)"):
        clt.forward(x, w[:7], b)
    with pytest.raises(ValueError, match="eps must be finite and >= 0; got -1.0"):
        clt.forward(x, w, b, -1.0)
    with pytest.raises(TypeError, match="eps must be a real number; got str"):
        clt.forward(x, w, b, "1e-5")
    with pytest.raises(ValueError, match=r"mean must have shape input.shape\[:-1\] = \(4,\)"):
        clt.backward(dy, x, w, mean[:3], rstd)
    with pytest.raises(ValueError, match="rstd must be a CUDA tensor; got a tensor on cpu"):
        clt.backward(dy, x, w, mean, rstd.cpu())
    with pytest.raises(ValueError, match=r"grad_output must have the shape of input \(4, 8\)"):
        clt.backward(dy[:3], x, w, mean, rstd)


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
def test_inputs_at_any_alignment_after_aligned_ones(xdt):
    """Launches are remembered by problem and pointer alignment: the same shape and strides at
    16-, 8-, 4- and 2-byte offsets (narrower vector loads) after an aligned call, and back."""
    m, n = 37, 1024
    x, w, b, _ = make((m, n), xdt, xdt, (n,), seed=7)
    buf = torch.empty(m * n + 8, dtype=xdt, device="cuda")
    step = 16 // buf.element_size()
    for offset in (0, step, 1, 2, 4, 0):
        xo = buf[offset : offset + m * n].view(m, n)
        xo.copy_(x)
        assert xo.data_ptr() % 16 == (offset * buf.element_size()) % 16
        with torch.no_grad():
            y = clt.layer_norm(xo, (n,), w, b)
        close(y, reference(x, w, b, torch.zeros_like(x), (n,))[0], f"y at offset {offset}")


def test_multi_dim_normalized_shape_and_module():
    m = clt.LayerNorm((6, 50), device="cuda")
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-1, 1)
    x, _, _, dy = make((7, 6, 50), torch.float32, None, None, seed=1)
    x.requires_grad_()
    y = m(x)
    y.backward(dy)
    yr, dxr, dwr, dbr = reference(x, m.weight, m.bias, dy, (6, 50))
    close(y, yr, "y")
    close(x.grad, dxr, "dx")
    close(m.weight.grad, dwr, "dw", rows=3)
    close(m.bias.grad, dbr, "db", rows=3)


def test_gradcheck_float64():
    x, w, b, _ = make((3, 4, 17), torch.float64, torch.float64, (17,), seed=2)
    args = tuple(t.requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: clt.layer_norm(x, (17,), w, b), args)


@pytest.mark.parametrize("mask", list(itertools.product([False, True], repeat=3)))
def test_requires_grad_on_any_subset(mask):
    x, w, b, dy = make((8, 96), torch.float32, torch.float32, (96,), seed=3)
    for t, r in zip((x, w, b), mask):
        t.requires_grad_(r)
    y = clt.layer_norm(x, (96,), w, b)
    assert y.requires_grad == any(mask)
    if any(mask):
        y.backward(dy)
    for t, r in zip((x, w, b), mask):
        assert (t.grad is not None) == r


def test_runs_on_torchs_current_stream_after_a_producer():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(10):
            a = torch.tanh(a @ a.T / 64)  # keep the stream busy (values stay in [-1, 1])
        x = a[:1024, :2048].contiguous()
        y = clt.layer_norm(x, (2048,))
        want = F.layer_norm(x, (2048,))
    s.synchronize()
    close(y, want.double(), "y")


def test_double_backward_is_refused():
    """A gradient of the gradient raises instead of leaving cupyln's part out of it."""
    x, w, b, dy = make((2, 3, 128), torch.float32, torch.float32, (128,), seed=9)
    x.requires_grad_()
    w.requires_grad_()
    y = clt.layer_norm(x, (128,), w, b)
    gx, gw = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    _, dxr, dwr, _ = reference(x, w, b, dy, (128,))
    close(gx.detach(), dxr, "dx")
    close(gw.detach(), dwr, "dw", rows=math.sqrt(6))
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        (gx * gx).sum().backward()


def test_opcheck():
    x, w, b, dy = make((5, 64), torch.float32, torch.float32, (64,), seed=4)
    for t in (x, w, b):
        t.requires_grad_()
    ln = (False, None, 0.0)  # LayerNorm: not RMSNorm, no residual dtype, no offset
    torch.library.opcheck(torch.ops.cupyln.norm_fwd.default, (x, None, w, b, 1e-5, *ln))
    y, mean, rstd, _ = torch.ops.cupyln.norm_fwd(x.detach(), None, w.detach(), b.detach(), 1e-5,
                                                 *ln)  # fmt: skip
    torch.library.opcheck(
        torch.ops.cupyln.norm_bwd.default,
        (dy, None, x.detach(), w.detach(), mean, rstd, False, 0.0),
    )


def test_compile_fullgraph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), clt.LayerNorm(256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()  # fmt: skip
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    out_c = compiled(x)
    out_c.sum().backward()
    grad_c = x.grad.clone()
    x.grad = None
    out_e = model(x)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_c, x.grad, rtol=1e-4, atol=1e-4)


def test_cuda_graph_replay_matches_eager():
    n = 1024
    sx, w, b, sdy = make((64, n), torch.bfloat16, torch.float32, (n,), seed=5)
    w.requires_grad_()
    sx.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels before capture
        for _ in range(2):
            clt.layer_norm(sx, (n,), w, b).backward(sdy)
    torch.cuda.current_stream().wait_stream(side)
    sx.grad = w.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sy = clt.layer_norm(sx, (n,), w, b)
        sy.backward(sdy)
    x2, _, _, dy2 = make((64, n), torch.bfloat16, None, None, seed=6)
    with torch.no_grad():
        sx.copy_(x2)
        sdy.copy_(dy2)
    g.replay()
    torch.cuda.synchronize()
    ex = x2.clone().requires_grad_()
    ew = w.detach().clone().requires_grad_()
    ey = clt.layer_norm(ex, (n,), ew, b)
    ey.backward(dy2)
    assert torch.equal(sy, ey)
    assert torch.equal(sx.grad, ex.grad) and torch.equal(w.grad, ew.grad)


def test_autocast_behaves_as_f_layer_norm():
    x, w, b, _ = make((16, 512), torch.bfloat16, torch.float32, (512,), seed=7)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = clt.layer_norm(x, (512,), w, b)
        want = F.layer_norm(x, (512,), w, b)
    assert y.dtype == want.dtype == torch.float32
    close(y, want.double(), "y")


def test_bad_input_is_refused():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"expected input with shape \[\*, 6\]"):
        clt.layer_norm(x, (6,))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]; got \[7\]"):
        clt.layer_norm(x, (8,), torch.ones(7, device="cuda"))
    with pytest.raises(ValueError, match="weight must be a CUDA tensor; got a tensor on cpu"):
        clt.layer_norm(x, (8,), torch.ones(8))
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        clt.layer_norm(x, (8,), eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a real number; got str"):
        clt.layer_norm(x, (8,), eps="1e-5")
    assert torch.equal(clt.layer_norm(x, (8,), eps=1), clt.layer_norm(x, (8,), eps=1.0))
    wide = torch.zeros(1, device="cuda").expand(2, 2**31)  # no memory behind the rows
    with pytest.raises(ValueError, match="normalized_shape must hold at most 2147418112"):
        clt.layer_norm(wide, (2**31,))


@pytest.mark.skipif(TORCH_GPUS < 2 or GPU_COUNT < 2, reason="needs two GPUs")
def test_second_device():
    x, w, b, dy = make((9, 300), torch.float32, torch.float32, (300,), seed=8)
    x, w, b, dy = (t.to("cuda:1") for t in (x, w, b, dy))
    x.requires_grad_()
    y = clt.layer_norm(x, (300,), w, b)
    y.backward(dy)
    assert y.device == x.grad.device == torch.device("cuda:1")
    yr, dxr, _, _ = reference(x, w, b, dy, (300,))
    close(y, yr, "y")
    close(x.grad, dxr, "dx")


def test_training_matches_nn_layer_norm():
    losses = {}
    for name, norm in (("torch", torch.nn.LayerNorm), ("cupyln", clt.LayerNorm)):
        torch.manual_seed(0)
        model = gpt_block(norm).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator(device="cuda").manual_seed(1)
        out = []
        for _ in range(100):
            x = torch.randn(8, 64, 128, device="cuda", generator=g)
            target = x[..., :8].sum(-1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses[name] = out
    a, b = torch.tensor(losses["cupyln"]), torch.tensor(losses["torch"])
    assert a[-10:].mean() < 0.7 * a[:10].mean()  # it trains
    assert bool(((a - b).abs() <= 0.02 * b.abs() + 1e-3).all()), (a - b).abs().max()


@pytest.mark.skipif(TORCH_GPUS < 2, reason="needs two GPUs")
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_gpus_train_as_one(tmp_path, wrap, norm):
    """tests/ddp_worker.py under torchrun (NCCL, one process a GPU, half the batch each), three
    SGD steps of the pre-LN block with cupyln.torch's LayerNorm or RMSNorm under
    DistributedDataParallel or FSDP2: the losses, the last gradients and the trained parameters
    match torch's own norms trained on the whole batch on one GPU, and each rank's norms ran
    on its own GPU."""
    from .ddp_worker import check_against_one_process, launch

    got = launch(tmp_path / "run.pt", wrap, norm)
    assert got["on_gpu"] and got["devices"] == [["cuda:0"], ["cuda:1"]], got["devices"]
    check_against_one_process(got, norm, torch.device("cuda"))


# ------------------------------------------------------------------ jagged
def _jagged_reference(values, offsets, w, b, eps=1e-6):
    """The Helion example's reference in float64: layer_norm of each sequence's whole block,
    then the per-feature affine."""
    out = []
    for i in range(offsets.numel() - 1):
        blk = values[offsets[i] : offsets[i + 1]].double()
        y = F.layer_norm(blk, blk.shape, eps=eps) if blk.numel() else blk
        if w is not None:
            y = y * w.double()
        if b is not None:
            y = y + b.double()
        out.append(y)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_seqlen", [None, 2])
def test_jagged_values_and_offsets_with_grads(dtype, max_seqlen):
    g = torch.Generator(device="cuda").manual_seed(11)
    lengths = torch.randint(0, 60, (40,), generator=g, device="cuda")
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), lengths.cumsum(0)])
    total, d = int(offsets[-1]), 96
    x = (-2.3 + 0.5 * torch.randn(total, d, generator=g, device="cuda")).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g, device="cuda")).requires_grad_()
    b = (0.3 * torch.randn(d, generator=g, device="cuda")).requires_grad_()
    x.requires_grad_()
    y = clt.jagged_layer_norm(x, offsets, w, b, max_seqlen=max_seqlen)
    dy = torch.randn(total, d, generator=g, device="cuda").to(dtype)
    y.backward(dy)
    xs, ws, bs = (t.detach().double().requires_grad_() for t in (x, w, b))
    yr = _jagged_reference(xs, offsets, ws, bs)
    yr.backward(dy.double())
    close(y, yr.detach(), "y")
    close(x.grad, xs.grad, "dx")
    close(w.grad, ws.grad, "dw", rows=math.sqrt(total))
    close(b.grad, bs.grad, "db", rows=math.sqrt(total))


def test_jagged_nested_tensor_in_and_out():
    g = torch.Generator(device="cuda").manual_seed(12)
    parts = [torch.randn(n, 64, generator=g, device="cuda") - 2.3 for n in (5, 1, 17, 3)]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    out = clt.jagged_layer_norm(nt)
    assert out.is_nested and out.layout == torch.jagged
    want = _jagged_reference(nt.values().detach(), nt.offsets(), None, None)
    close(out.values(), want, "y")
    out.values().sum().backward()
    assert nt.grad is not None


def test_jagged_bad_offsets_are_refused():
    x = torch.ones(6, 4, device="cuda")
    with pytest.raises(ValueError, match="non-decreasing"):
        clt.jagged_layer_norm(x, torch.tensor([0, 4, 3, 6], device="cuda"))
    with pytest.raises(ValueError, match="offsets"):
        clt.jagged_layer_norm(x)


def test_jagged_compiles_fullgraph_and_captures():
    """The jagged op under torch.compile(fullgraph=True), and captured in a CUDA graph after
    one eager call (offsets clamped on the GPU in the capture, no synchronization): both as
    eager, gradients included."""
    g = torch.Generator(device="cuda").manual_seed(13)
    lengths = torch.randint(1, 50, (30,), generator=g, device="cuda")
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), lengths.cumsum(0)])
    total, d = int(offsets[-1]), 64
    x = (-2.3 + 0.5 * torch.randn(total, d, generator=g, device="cuda")).requires_grad_()
    w = (1 + 0.3 * torch.randn(d, generator=g, device="cuda")).requires_grad_()
    dy = torch.randn(total, d, generator=g, device="cuda")

    def norm(x, w):
        return clt.jagged_layer_norm(x, offsets, w, None, 1e-6, 64)

    want = torch.autograd.grad(norm(x, w), (x, w), dy)
    got = torch.autograd.grad(torch.compile(norm, fullgraph=True)(x, w), (x, w), dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = clt.jagged_layer_norm(x.detach(), offsets, w.detach(), None, 1e-6, 64)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, clt.jagged_layer_norm(x.detach(), offsets, w.detach(), None, 1e-6, 64))


def test_precompile_then_capture_at_another_m():
    """After precompile, CUDA graphs captured at row counts never run before compile nothing
    (a capture cannot load a module) and replay what eager calls compute; the plans do change
    with M across these row counts."""
    from cupyln import _compile, _launcher
    from cupyln.torch._glue import _NP

    n = 4096
    assert clt.precompile((n,), torch.bfloat16, weight_dtype=torch.float32) > 0
    x, w, b, dy = make((8192, n), torch.bfloat16, torch.float32, (n,), seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up at one M: torch's own first-call work
        clt.layer_norm(x.requires_grad_(), (n,), w.requires_grad_(), b).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    seen = set()
    for m in (3, 1000, 1024, 2048, 5000):
        sx, w, b, sdy = make((m, n), torch.bfloat16, torch.float32, (n,), seed=m)
        w.requires_grad_()
        sx.requires_grad_()
        bf, f4 = _NP[torch.bfloat16], _NP[torch.float32]
        p = Problem(m, n, bf, f4, f4, x_stride=n)
        seen.add(_launcher.forward_launch(sx.device.index, p, 8)[1].kernel)
        compiled = len(_compile._functions)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sy = clt.layer_norm(sx, (n,), w, b)
            sy.backward(sdy)
        assert len(_compile._functions) == compiled, f"M={m}: a kernel compiled in the capture"
        g.replay()
        torch.cuda.synchronize()
        ex = sx.detach().clone().requires_grad_()
        ew = w.detach().clone().requires_grad_()
        ey = clt.layer_norm(ex, (n,), ew, b)
        ey.backward(sdy)
        assert torch.equal(sy, ey), m
        assert torch.equal(sx.grad, ex.grad) and torch.equal(w.grad, ew.grad), m
    if _launcher.emulated() is None:  # (other GPUs' profiles may keep one plan here)
        assert len(seen) > 1, "the forward's plan is the same at every M: nothing was tested"
