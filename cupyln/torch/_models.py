"""Norm modules of models as people load them (Hugging Face transformers' Llama, Qwen, Gemma,
OLMo2, Phi-3, DeepSeek-V3, T5...), recognised by what they compute, not by their class.

A leaf module with a 1-D ``weight`` (and perhaps a ``bias``) of N and an epsilon attribute is
norm-like. A copy of it, with random parameters and no hooks, is run on a probe: its float32
output says which norm it is (LayerNorm with w; RMSNorm with w or with 1 + w), and its
bfloat16 output how it rounds ("none": y rounded once, as Gemma and OLMo2; "llama": the
normalized x rounded to x's dtype, then times w, as Llama, Mistral, Qwen, Phi-3 and
DeepSeek-V3; "t5": rounded to the weight's 16-bit dtype, then times w). Each module taken gets
a subclass of its own class whose forward calls cupyln with the same rounding: parameters,
buffers, hooks, ``state_dict`` keys and ``isinstance`` stay.
"""

from __future__ import annotations

import copy
import logging
from typing import NamedTuple

import torch

from . import layer_norm, rms_norm  # this module is imported once the package is

log = logging.getLogger("cupyln")

EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


class Norm(NamedTuple):
    """What a norm module computes: ``rms`` or LayerNorm, the scale's offset (1: 1 + w), the
    attribute its epsilon lives in, and how it rounds ("none", "llama" or "t5")."""

    rms: bool
    offset: float
    eps_name: str
    casting: str


def norm_like(m: torch.nn.Module) -> bool:
    """A leaf with a 1-D weight (and a bias of its size, if any) and an epsilon attribute."""
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    return (
        not any(True for _ in m.children())
        and isinstance(w, torch.Tensor)
        and w.dim() == 1
        and (b is None or (isinstance(b, torch.Tensor) and b.shape == w.shape))
        and any(isinstance(getattr(m, e, None), float) for e in EPS_NAMES)
    )


def _probe_copy(m: torch.nn.Module, gen: torch.Generator) -> torch.nn.Module:
    """A copy of ``m`` without hooks, its weight and bias random (away from 0 and 1, so that
    each candidate computes something else)."""
    c = copy.deepcopy(m)
    for hooks in (c._forward_hooks, c._forward_pre_hooks, c._forward_hooks_with_kwargs):
        hooks.clear()
    with torch.no_grad():
        for name in ("weight", "bias"):
            p = getattr(c, name, None)
            if isinstance(p, torch.Tensor):
                r = torch.rand(p.shape, generator=gen) * 0.5 + 0.25
                p.copy_(r.to(p.dtype))
    return c


def identify(m: torch.nn.Module) -> Norm | None:
    """What norm-like ``m`` computes, or None where it is none of them."""
    eps_name = next(e for e in EPS_NAMES if isinstance(getattr(m, e, None), float))
    eps = getattr(m, eps_name)
    gen = torch.Generator().manual_seed(0)
    c = _probe_copy(m, gen)
    w = c.weight.detach()
    b = getattr(c, "bias", None)
    b = b.detach() if isinstance(b, torch.Tensor) else None
    n = w.numel()
    dev = w.device
    x = (torch.randn(8, n, generator=gen) * 0.5 - 2.3).to(dev)
    with torch.no_grad():
        got = type(m).forward(c, x)
        low = got.dtype in (torch.float16, torch.bfloat16)  # T5 with a 16-bit weight rounds to it
        tol = 2e-2 if low else 1e-3
        got = got.double()
        xd, wd = x.double(), w.double()
        rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        dev_ = xd - xd.mean(-1, keepdim=True)
        ln = dev_ * torch.rsqrt(dev_.pow(2).mean(-1, keepdim=True) + eps)
        shift = 0 if b is None else b.double()
        candidates = [
            (True, 0.0, rms * wd),
            (True, 1.0, rms * (1 + wd)),
            (False, 0.0, ln * wd + shift),
        ]
        found = [(r, o) for r, o, want in candidates if torch.allclose(got, want, tol, tol)]
        if len(found) != 1:
            return None
        is_rms, offset = found[0]
        if is_rms and b is not None:
            return None  # an RMSNorm with a shift: none of cupyln's
        return Norm(is_rms, offset, eps_name, "t5" if low else _casting(c, x, is_rms, offset, eps))


def _casting(c, x, rms: bool, offset: float, eps: float) -> str:
    """How module copy ``c`` rounds bfloat16 input: the casting whose rounding its output
    matches in the most elements (all but a few, which float32's rsqrt may round otherwise).
    Its float32 output was float32, so a 16-bit weight's "t5" rounding is ruled out."""
    xb = x.bfloat16()
    w = c.weight.detach()
    b = getattr(c, "bias", None)
    with torch.no_grad():
        got = type(c).forward(c, xb)
        v = xb.float()
        if rms:
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        else:
            v = v - v.mean(-1, keepdim=True)
            v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        scale = w.float() + offset
        shift = 0 if b is None else b.float()
        w32 = w.dtype not in (torch.float16, torch.bfloat16)
        w = w + offset if offset else w
        rounded = {
            "none": (v * scale + shift).to(xb.dtype),
            "llama": w * v.to(xb.dtype),
        }
        if w32:  # T5 with a float32 weight: the normalized x kept in float32
            rounded["t5"] = w * v
    score = {
        k: int((r == got).sum()) if r.dtype == got.dtype and r.shape == got.shape else -1
        for k, r in rounded.items()
    }
    best = max(score, key=score.get)
    # a rounding of its own (none of these): y rounded once, the nearest to its exact value
    return best if score[best] >= 0.98 * got.numel() else "none"


# one subclass a (norm class, what it computes), made once
_classes: dict = {}


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    s = self._cupyln_norm
    eps = getattr(self, s.eps_name)
    w = self.weight
    n = (w.numel(),)
    if s.casting == "none":
        if s.rms:
            return rms_norm(x, n, w, eps, weight_offset=s.offset)
        return layer_norm(x, n, w, self.bias, eps)
    # the normalized x rounded (to x's dtype; T5: to its 16-bit weight's, else kept in float32),
    # then times the weight
    out = None
    if s.casting == "t5":
        half = w.dtype in (torch.float16, torch.bfloat16)
        out = w.dtype if half else torch.promote_types(x.dtype, torch.float32)
        out = None if out == x.dtype else out
    if s.rms:
        v = rms_norm(x, n, None, eps, out_dtype=out)
    else:
        v = layer_norm(x, n, None, None, eps, out_dtype=out)
    y = (w + s.offset if s.offset else w) * v
    bias = getattr(self, "bias", None)
    return y if bias is None or s.rms else y + bias


def take(m: torch.nn.Module, norm: Norm) -> None:
    """Make ``m`` compute with cupyln, in place (its class becomes a subclass of its own)."""
    cls = type(m)
    key = (cls, norm)
    sub = _classes.get(key)
    if sub is None:
        sub = type(f"Cupyln{cls.__name__}", (cls,), {"forward": _forward})
        _classes[key] = sub
    m._cupyln_norm = norm
    m.__class__ = sub


def replace_model_norms(module: torch.nn.Module, strict: bool = False) -> dict:
    """Take every norm-like module of ``module`` that ``identify`` recognises; {"swapped": their
    names, "left": the norm-like ones it could not take}; ``strict`` raises on any left."""
    swapped, left = [], []
    for name, m in module.named_modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or hasattr(m, "_cupyln_norm"):
            continue  # torch's own classes: swapped for cupyln's by class
        if not norm_like(m):
            continue
        try:
            norm = identify(m)
        except Exception:  # noqa: BLE001 - a forward that takes other arguments: not a norm
            norm = None
        if norm is None:
            left.append(name)
            continue
        take(m, norm)
        swapped.append(name)
    if left and strict:
        raise ValueError(f"replace_norms: norm-like modules cupyln cannot take: {left}")
    if swapped:
        log.info("replace_norms took %d norm modules: %s", len(swapped), swapped)
    if left:
        log.warning("replace_norms left %d norm-like modules: %s", len(left), left)
    return {"swapped": swapped, "left": left}
