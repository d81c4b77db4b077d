"""Beyond the bandwidth sweep: host time per call (the CuPy API and the torch bridge), a
training step with either layer norm, and the JAX bridge under jax.jit against pure JAX.
``python -m cupyln bench --overhead / --train / --jax`` print them."""

from __future__ import annotations

import math
import statistics

from . import _api
from . import reference as ref


def cpu_us_per_call(fn, sync, calls: int, repeats: int = 5) -> float:
    """CPU time of the process per call of ``fn`` (warm), the least over ``repeats`` runs of
    ``calls`` calls: interference from the rest of the machine only ever adds time."""
    import time

    for _ in range(100):
        fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        t = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t) / calls * 1e6)
        sync()
    return best


def host_overhead_us(calls: int = 2000) -> dict:
    """CPU microseconds per call of forward / backward on tiny arrays (4 x 64 float32), warm:
    what the Python layer costs on top of the launch, measured over many calls."""
    import cupy

    x = ref.sample((4, 64), "float32", seed=0)
    w = ref.sample((64,), "float32", seed=1)
    dy = ref.sample((4, 64), "float32", seed=2)
    _, mean, rstd = _api.forward(x, w, w)
    sync = cupy.cuda.get_current_stream().synchronize
    return {
        "forward": cpu_us_per_call(lambda: _api.forward(x, w, w), sync, calls),
        "backward": cpu_us_per_call(lambda: _api.backward(dy, x, w, mean, rstd), sync, calls),
    }


def _python_function(torch):
    """F.layer_norm's signature over torch's native kernels in a Python autograd.Function."""

    class Native(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], w, b, 1e-5)
            ctx.save_for_backward(x, w, b, mean, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, b, mean, rstd = ctx.saved_tensors
            return torch.ops.aten.native_layer_norm_backward(
                dy, x, x.shape[-1:], mean, rstd, w, b, [True, True, True]
            )

    return lambda x, shape, w, b: Native.apply(x, w, b)


def torch_overhead_us(calls: int = 1000) -> dict:
    """CPU microseconds per call on tiny CUDA tensors (4 x 64 float32), warm: torch's
    F.layer_norm against cupyln.torch.layer_norm, inference (no grad) and a training step
    (forward + backward of one layer norm). Empty dict without torch/CUDA."""
    try:
        import torch

        import cupyln.torch as clt
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    f = torch.nn.functional.layer_norm
    x = torch.randn(4, 64, device="cuda")
    w = torch.randn(64, device="cuda", requires_grad=True)
    b = torch.randn(64, device="cuda", requires_grad=True)
    xg = x.clone().requires_grad_()
    dy = torch.randn(4, 64, device="cuda")

    def step(fn):
        def run():
            fn(xg, (64,), w, b).backward(dy)

        return run

    cases = {
        "torch F.layer_norm, no grad": lambda: f(x, (64,), w.detach(), b.detach()),
        "cupyln.torch.layer_norm, no grad": lambda: clt.layer_norm(
            x, (64,), w.detach(), b.detach()
        ),  # fmt: skip
        # the forward call of a training step: the graph is recorded (then dropped)
        "torch F.layer_norm, forward with grad": lambda: f(xg, (64,), w, b),
        "cupyln.torch.layer_norm, forward with grad": lambda: clt.layer_norm(xg, (64,), w, b),
        "torch F.layer_norm, fwd+bwd": step(f),
        "cupyln.torch.layer_norm, fwd+bwd": step(clt.layer_norm),
        # the floor of any bridge with a Python backward: torch's own kernels, called from a
        # Python autograd.Function
        "torch kernels in a Python autograd.Function, fwd+bwd": step(_python_function(torch)),
    }
    return {name: cpu_us_per_call(fn, torch.cuda.synchronize, calls) for name, fn in cases.items()}


# ------------------------------------------------------------------ training step
def gpt_block(norm, d: int = 128, heads: int = 4, layers: int = 1):
    """A small pre-LN transformer (attention + MLP per layer, then a linear head) whose layer
    norms are ``norm(d)``: the tests' and the training-step benchmark's model."""
    import torch

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = norm(d), norm(d)
            self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                           torch.nn.Linear(4 * d, d))  # fmt: skip

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*(Layer() for _ in range(layers)))
            self.head = torch.nn.Linear(d, 1)

        def forward(self, x):
            return self.head(self.layers(x)).squeeze(-1)

    return Model()


def training_step_ms(steps: int = 30, batch: int = 8, seq: int = 1024, d: int = 1024,
                     layers: int = 4, dtype: str = "bfloat16") -> dict:  # fmt: skip
    """Milliseconds per optimizer step of ``gpt_block`` (``layers`` layers, width ``d``) with
    torch.nn.LayerNorm and with cupyln.torch.LayerNorm, same seed, parameters in ``dtype``
    (no autocast, so the layer norms run in that dtype). Median over ``steps`` after warm-up."""

    import torch

    import cupyln.torch as clt

    out = {}
    dt = getattr(torch, dtype)
    for name, norm in (("torch.nn.LayerNorm", torch.nn.LayerNorm), ("cupyln", clt.LayerNorm)):
        torch.manual_seed(0)
        model = gpt_block(norm, d, d // 64, layers).cuda().to(dt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, seq, d, device="cuda", dtype=dt)
        target = torch.randn(batch, seq, device="cuda", dtype=dt)
        times = []
        for i in range(steps + 5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = torch.nn.functional.mse_loss(model(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            end.record()
            end.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end))
        out[name] = statistics.median(times)
    return out


# ------------------------------------------------------------------ JAX
def jax_bandwidth(ns=(1024, 4096, 16384), dtype: str = "bfloat16", elements: int = 2**27,
                  reps: int = 30) -> list[dict]:  # fmt: skip
    """Jitted ``cupyln.jax.layer_norm`` against a jitted pure-JAX layer norm (float32
    arithmetic, as cupyln's): forward GB/s (2 * M * N * itemsize per call) and the time of a
    jitted forward + backward (``jax.vjp``: dx, dw, db). Calls are queued back to back and
    timed together, so XLA's dispatch overlaps the GPU work; tensors of 2**27 elements are
    far larger than L2. Empty list without JAX."""
    import os
    import time

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp

        import cupyln.jax as cj
    except ImportError:
        return []

    def pure(x, w, b, eps=1e-5):
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32)
        return (y + b.astype(jnp.float32)).astype(x.dtype)

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            out = [fn(*args) for _ in range(reps)]
            jax.block_until_ready(out)
            runs.append((time.perf_counter() - t) / reps * 1e3)
            del out
        return statistics.median(runs)

    dt = jnp.dtype(dtype)
    rows = []
    for n in ns:
        m = elements // n
        keys = jax.random.split(jax.random.PRNGKey(n), 3)
        x = (-2.3 + 0.5 * jax.random.normal(keys[0], (m, n))).astype(dt)
        dy = jax.random.normal(keys[1], (m, n)).astype(dt)
        w = (1 + 0.2 * jax.random.normal(keys[2], (n,))).astype(dt)
        b = jnp.zeros((n,), dt)
        for name, ln in (("cupyln.jax", cj.layer_norm), ("pure JAX", pure)):
            fwd = jax.jit(ln)

            def step(x, w, b, dy, ln=ln):
                return jax.vjp(ln, x, w, b)[1](dy)

            f_ms = timed(fwd, x, w, b)
            s_ms = timed(jax.jit(step), x, w, b, dy)
            gbs = 2 * x.size * dt.itemsize / f_ms * 1e-6
            rows.append(dict(provider=name, dtype=dt.name, M=m, N=n, fwd_ms=f_ms, fwd_GBs=gbs,
                             fwd_bwd_ms=s_ms))  # fmt: skip
        del x, dy
    return rows
