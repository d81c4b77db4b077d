"""The peer comparison behind BENCHMARKS.md's tables (``python -m cupyln bench --peers``): each
norm of the family through torch's autograd, as a training step calls it, for cupyln.torch and
the peers installed: torch's own functions, torch.compile of them, and Liger-Kernel's RMSNorm
and fused add+RMSNorm (``pip install liger-kernel``). A peer that is missing is reported, not
skipped silently.

Forward under ``torch.no_grad``; backward ``torch.autograd.grad`` of the outputs (y, and h
with a residual add) with ``retain_graph``. Bytes and timing as the sweep's (``bench``): the
contract's bytes (``bench.NORMS``), the median of CUDA-event timings with L2 flushed. Each
provider's y and dx are checked against a float64 reference (relative Frobenius norm; past 2e-2
the row says WRONG).
"""

from __future__ import annotations

from collections.abc import Callable

from . import bench

EPS = {"ln": 1e-5, "rms": 1e-6, "add_rms": 1e-6, "add_ln": 1e-5}


def _torch_calls(torch):
    """{norm: f(x, r, w, b, eps) -> y or (y, h)} of torch's own functions."""
    F = torch.nn.functional

    def ln(x, r, w, b, eps):
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    def rms(x, r, w, b, eps):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def add_rms(x, r, w, b, eps):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), w, eps), h

    def add_ln(x, r, w, b, eps):
        h = x + r
        return F.layer_norm(h, (h.shape[-1],), w, b, eps), h

    return {"ln": ln, "rms": rms, "add_rms": add_rms, "add_ln": add_ln}


def providers(norm: str, log: Callable[[str], None] = print) -> dict:
    """{name: f(x, r, w, b, eps)} of cupyln and every peer installed for ``norm``."""
    import torch

    import cupyln.torch as clt

    n = lambda x: (x.shape[-1],)  # noqa: E731
    out = {
        "cupyln": {
            "ln": lambda x, r, w, b, eps: clt.layer_norm(x, n(x), w, b, eps),
            "rms": lambda x, r, w, b, eps: clt.rms_norm(x, n(x), w, eps),
            "add_rms": lambda x, r, w, b, eps: clt.add_rms_norm(x, r, n(x), w, eps),
            "add_ln": lambda x, r, w, b, eps: clt.add_layer_norm(x, r, n(x), w, b, eps),
        }[norm]
    }
    plain = _torch_calls(torch)[norm]
    out["torch"] = plain
    out["torch.compile"] = torch.compile(plain, dynamic=False)
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        if norm == "rms":
            out["liger"] = lambda x, r, w, b, eps: LigerRMSNormFunction.apply(
                x, w, eps, 0.0, "llama", False
            )
        elif norm == "add_rms":
            out["liger"] = lambda x, r, w, b, eps: LigerFusedAddRMSNormFunction.apply(
                x, r, w, eps, 0.0, "llama", False
            )
    except ImportError as err:
        log(f"liger: not installed ({err.name})")
    return out


def _reference(norm, x, r, w, b, eps):
    """The float64 outputs of ``norm`` (y, and h with a residual add)."""
    import torch

    F = torch.nn.functional
    src = x + r if norm.startswith("add") else x
    if norm in ("rms", "add_rms"):
        y = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps) * w
    else:
        y = F.layer_norm(src, (src.shape[-1],), w, b, eps)
    return (y, src) if norm.startswith("add") else (y,)


def _rel(a, ref) -> float:
    return float((a.detach().double() - ref).norm() / ref.norm())


def run_peers(norm: str = "rms", dtype="bfloat16", elements: int = 2**27, ns=bench.DEFAULT_NS,
              progress: Callable[[bench.Row], None] | None = None,
              log: Callable[[str], None] = print):  # fmt: skip
    """(copy GB/s, [bench.Row]) of every provider at each width (M = elements // N)."""
    import torch

    if norm not in bench.NORMS:
        raise ValueError(f"norm: one of {tuple(bench.NORMS)}, got {norm!r}")
    torch._dynamo.config.recompile_limit = 512  # a graph per width and grad mode
    torch._dynamo.config.accumulated_recompile_limit = 4096
    dt = getattr(torch, dtype)
    copy = bench.copy_bandwidth()
    calls = providers(norm, log)
    fwd_bytes, bwd_bytes = bench.NORMS[norm]
    eps = EPS[norm]
    rows = []
    for n in ns:
        m = max(1, elements // n)
        g = torch.Generator(device="cuda").manual_seed(n)
        x = -2.3 + 0.5 * torch.randn(m, n, generator=g, device="cuda").to(dt)
        r = 0.3 + torch.randn(m, n, generator=g, device="cuda").to(dt)
        w = 1.0 + 0.2 * torch.randn(n, generator=g, device="cuda").to(dt)
        b = 0.2 * torch.randn(n, generator=g, device="cuda").to(dt)
        dy = torch.randn(m, n, generator=g, device="cuda").to(dt)
        args = (x, r, w, b)
        check = m * n <= 2**24  # the float64 reference's memory
        ref = None
        if check:
            leaves = [a.double().requires_grad_() for a in args]
            outs = _reference(norm, *leaves, eps)
            ref = (outs[0].detach(), torch.autograd.grad(outs[0], leaves[0], dy.double())[0])
        nbytes = m * n * x.element_size()
        for name, f in calls.items():
            try:
                with torch.no_grad():
                    f_ms = bench.time_ms(lambda f=f, a=args: f(*a, eps))
                leaves = [a.detach().clone().requires_grad_() for a in args]
                out = f(*leaves, eps)
                outs = out if isinstance(out, tuple) else (out,)
                grads = (dy,) + tuple(torch.zeros_like(o) for o in outs[1:])
                used = leaves[:3] if norm.startswith("add") else [leaves[0], leaves[2]]

                def backward(outs=outs, used=used, grads=grads):
                    return torch.autograd.grad(outs, used, grads, retain_graph=True)

                b_ms = bench.time_ms(backward)
            except Exception as err:  # noqa: BLE001 - a peer's failure is reported, not fatal
                log(f"{name:14s} N={n}: failed ({type(err).__name__}: {str(err)[:120]})")
                continue
            kernels = ""
            if ref is not None:
                dx = backward()[0]
                errs = (_rel(outs[0], ref[0]), _rel(dx, ref[1]))
                kernels = "WRONG" if max(errs) > 2e-2 else ""
            fg, bg = fwd_bytes * nbytes / f_ms * 1e-6, bwd_bytes * nbytes / b_ms * 1e-6
            row = bench.Row(name, dtype, m, n, f_ms, b_ms, fg, bg, fg / copy, bg / copy, kernels)
            rows.append(row)
            if progress is not None:
                progress(row)
        args = ref = None  # the width's tensors back to torch's allocator
        torch.cuda.empty_cache()
    return copy, rows


# ------------------------------------------------------------------ the quantized forward
def _torch_quantize(torch, quant: str):
    """f(y) -> (elements, scales) in torch's ops, by cupyln's rules (for torch.compile to fuse
    after the norm, as the peers quantize): fp8_row, fp8_block (1x128) and mxfp8, e4m3."""

    def fp8(v):
        return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def blocks(y, width):
        m, n = y.shape
        return y.float().reshape(m, n // width, width)

    if quant == "fp8_row":

        def q(y):
            s = y.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
            return fp8(y.float() * (1.0 / s)), s

    elif quant == "fp8_block":

        def q(y):
            b = blocks(y, 128)
            s = b.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
            return fp8(b * (1.0 / s)).reshape(y.shape), s.squeeze(-1)

    elif quant == "mxfp8":

        def q(y):
            b = blocks(y, 32)
            amax = b.abs().amax(-1, keepdim=True)
            mant, exp = torch.frexp(amax / 448.0)
            e = torch.where(mant == 0.5, exp - 1, exp).clamp(-127, 127)
            inv = torch.ldexp(torch.ones_like(amax), -e)
            byte = torch.where(amax > 0, e + 127, 0).to(torch.uint8)
            return fp8(b * inv).reshape(y.shape), byte.squeeze(-1)

    else:
        raise ValueError(f"the peers quantize fp8_row, fp8_block and mxfp8; got {quant!r}")
    return q


def run_quant_peers(quant: str, dtype="bfloat16", elements: int = 2**27, ns=bench.DEFAULT_NS,
                    progress: Callable[[bench.Row], None] | None = None):  # fmt: skip
    """RMSNorm with y quantized, forward only, at M = elements // N: cupyln's one pass against
    torch.compile of RMSNorm then the quantization (which inductor fuses into one kernel), and
    cupyln's plain norm followed by the compiled quantization (two passes). (copy GB/s,
    [bench.Row]) with the bytes of bench.quant_bytes."""
    import numpy
    import torch

    import cupyln.torch as clt

    torch._dynamo.config.recompile_limit = 512
    q = _torch_quantize(torch, quant)
    F = torch.nn.functional
    fused = torch.compile(lambda x, w: q(F.rms_norm(x, (x.shape[-1],), w, 1e-6)), dynamic=False)
    after = torch.compile(q, dynamic=False)
    calls = {
        f"cupyln {quant}": lambda x, w: clt.rms_norm(x, (x.shape[-1],), w, 1e-6, quant=quant),
        "torch.compile": fused,
        "cupyln + compiled quant": lambda x, w: after(clt.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    }
    dt = getattr(torch, dtype)
    copy = bench.copy_bandwidth()
    rows = []
    for n in ns:
        if n % (32 if quant == "mxfp8" else 128 if quant == "fp8_block" else 1):
            continue
        m = max(1, elements // n)
        g = torch.Generator(device="cuda").manual_seed(n)
        x = -2.3 + 0.5 * torch.randn(m, n, generator=g, device="cuda").to(dt)
        w = 1.0 + 0.2 * torch.randn(n, generator=g, device="cuda").to(dt)
        nbytes = bench.quant_bytes("rms", m, n, numpy.dtype(dtype), quant)
        for name, f in calls.items():
            with torch.no_grad():
                ms = bench.time_ms(lambda f=f, x=x, w=w: f(x, w))
            gbs = nbytes / ms * 1e-6
            row = bench.Row(name, dtype, m, n, ms, None, gbs, None, gbs / copy, None)
            rows.append(row)
            if progress is not None:
                progress(row)
        x = w = None
        torch.cuda.empty_cache()
    return copy, rows
