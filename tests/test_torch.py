"""CPU tier of the torch bridge: the module is nn.LayerNorm's twin (constructor, parameters,
state_dict), the custom ops' fake implementations give the right shapes and dtypes, and bad
input is refused clearly."""

import pytest

torch = pytest.importorskip("torch")
clt = pytest.importorskip("cupyln.torch")


@pytest.mark.parametrize("shape", [8, (4, 8)])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_module_matches_nn_layer_norm(shape, affine, bias):
    a = clt.LayerNorm(shape, eps=1e-6, elementwise_affine=affine, bias=bias, dtype=torch.float64)
    b = torch.nn.LayerNorm(shape, eps=1e-6, elementwise_affine=affine, bias=bias,
                           dtype=torch.float64)  # fmt: skip
    assert isinstance(a, torch.nn.LayerNorm)
    assert a.normalized_shape == b.normalized_shape and a.eps == b.eps
    assert [(k, v.shape, v.dtype) for k, v in a.state_dict().items()] == [
        (k, v.shape, v.dtype) for k, v in b.state_dict().items()
    ]
    if affine:
        with torch.no_grad():
            b.weight.uniform_()
        a.load_state_dict(b.state_dict())
        assert torch.equal(a.weight, b.weight)
        b.load_state_dict(a.state_dict())


def test_replace_layer_norms_keeps_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.Sequential(torch.nn.LayerNorm(8)))  # fmt: skip
    w = model[1].weight
    clt.replace_layer_norms(model)
    assert type(model[1]) is clt.LayerNorm and type(model[2][0]) is clt.LayerNorm
    assert model[1].weight is w
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias",
                                       "2.0.weight", "2.0.bias"}  # fmt: skip


@pytest.mark.parametrize("xdt", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("wdt", [None, torch.float32, torch.bfloat16])
def test_fake_shapes_and_dtypes(xdt, wdt):
    x = torch.empty(3, 5, 40, device="meta", dtype=xdt)
    w = None if wdt is None else torch.empty(40, device="meta", dtype=wdt)
    y, mean, rstd, h = torch.ops.cupyln.norm_fwd(x, None, w, w, 1e-5, False, None, 0.0)
    assert h.shape == (0,)  # no residual
    acc = torch.float64 if xdt == torch.float64 else torch.float32
    assert (y.shape, y.dtype, y.is_contiguous()) == (x.shape, xdt, True)
    assert (mean.shape, mean.dtype, rstd.shape, rstd.dtype) == ((3, 5), acc, (3, 5), acc)
    dx, dw, db = torch.ops.cupyln.norm_bwd(x, None, x, w, mean, rstd, False, 0.0)
    assert (dx.shape, dx.dtype) == (x.shape, xdt)
    assert dw.shape == ((40,) if w is not None else (0,)) and db.shape == (40,)
    assert db.dtype == (xdt if w is None else wdt)


def test_ops_autograd_traced_without_a_gpu():
    """The ops' autograd on meta tensors: gradients of the inputs' shapes, db in the bias's
    dtype, a graph of the two ops, and a second backward through norm_bwd refused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.empty(3, 5, 40, device="meta", requires_grad=True)
    w = torch.empty(40, device="meta", requires_grad=True)
    b = torch.empty(40, device="meta", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.empty(3, 5, 40, device="meta")

    def grads(x, w, b, dy):
        y, mean, rstd, _ = torch.ops.cupyln.norm_fwd(x, None, w, b, 1e-5, False, None, 0.0)
        assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
        return torch.autograd.grad(y, (x, w, b), dy)

    gx, gw, gb = grads(x, w, b, dy)
    assert (gx.shape, gx.dtype, gw.shape, gw.dtype) == (x.shape, x.dtype, (40,), torch.float32)
    assert (gb.shape, gb.dtype) == ((40,), torch.bfloat16)
    ops = [n.target for n in make_fx(grads)(x, w, b, dy).graph.nodes if n.op == "call_function"]
    assert torch.ops.cupyln.norm_fwd.default in ops
    assert torch.ops.cupyln.norm_bwd.default in ops
    y = torch.ops.cupyln.norm_fwd(x, None, w, b, 1e-5, False, None, 0.0)[0]
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        gx.sum().backward()


def test_cpu_tensors_are_refused_by_the_statistics_functions():
    with pytest.raises(ValueError, match="input must be a CUDA tensor; got a tensor on cpu"):
        clt.forward(torch.ones(2, 8))
    with pytest.raises(ValueError, match="input must be a CUDA tensor; got a tensor on cpu"):
        clt.backward(torch.ones(2, 8), torch.ones(2, 8), None, torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="input must have dtype .*; got torch.int64"):
        clt.forward(torch.ones(2, 8, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(8,), (5, 8)])
def test_cpu_tensors_fall_back_to_torch(dtype, shape):
    """layer_norm and LayerNorm on CPU tensors are torch's own layer norm, gradients included,
    so a model after replace_layer_norms still runs on the CPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(shape)).to(dtype)
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(shape)).to(dtype)
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    twin.load_state_dict(model.state_dict())
    clt.replace_layer_norms(model)
    assert type(model[1]) is clt.LayerNorm
    x = torch.randn(3, 5, 8, dtype=dtype)
    y, want = model(x), twin(x)
    assert torch.equal(y, want)
    y.sum().backward()
    want.sum().backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
    w = torch.rand(shape, dtype=dtype)
    got = clt.layer_norm(x, shape, w, None, 1e-3)
    assert torch.equal(got, torch.nn.functional.layer_norm(x, shape, w, None, 1e-3))


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_two_process_training_harness_on_the_cpu(tmp_path, wrap):
    """The two-GPU training test's harness (tests/ddp_worker.py) run on the CPU: two gloo
    ranks, where cupyln.torch's norms take torch's own ops; DDP's and FSDP2's losses, gradients
    and trained parameters match one process's, as the GPU run checks for cupyln's kernels."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built here")
    from .ddp_worker import check_against_one_process, launch

    got = launch(tmp_path / "run.pt", wrap, "rms", cuda_devices="")
    assert not got["on_gpu"] and got["devices"] == [["cpu"], ["cpu"]]
    check_against_one_process(got, "rms", torch.device("cpu"))
