"""What changes how later calls plan and compile: ``precompile`` (every kernel of a problem,
before a CUDA-graph capture), ``emulate`` (another GPU's plans), ``set_plan_constant`` (A/B
runs of a tuned constant) and ``forget_plans``.

One vocabulary of dtype keywords across the CuPy API, ``precompile`` and both bridges: a
keyword names the dtype of the call's argument of the same name — ``w_dtype``/``b_dtype``
(torch: ``weight_dtype``/``bias_dtype``) the weight's and bias's, ``db_dtype`` db's,
``residual_dtype`` h's (the residual stream as stored), and ``precompile``'s ``residual`` the
residual's own dtype.
"""

from __future__ import annotations

import warnings

from . import _checks, _launcher, _runtime
from ._problem import for_precompile


def forget_plans() -> None:
    """Drop every cached plan, kernel and call (after a plan constant changes: the tests and
    tuning scripts)."""
    _launcher.forget_plans()


def set_plan_constant(name: str, value):
    """Set the tuned constant ``name`` of the plans (cupyln/_plans) to ``value`` and drop every
    cached plan and call, so the next calls plan with it; returns the value it had. For A/B
    runs (scripts/tune.py)."""
    return _launcher.set_plan_constant(name, value)


def emulate(profile: str | None) -> None:
    """Plan as on the GPU of ``_plans.devices.PROFILES[profile]`` (None: as on the device in
    use), for the tests and the benchmark; drops every cached plan, kernel and call."""
    _launcher.emulate(profile)


def precompile(
    n: int,
    dtype,
    *,
    w_dtype=None,
    b_dtype=None,
    db_dtype=None,
    affine: tuple = (True, True),
    rms: bool = False,
    residual=None,
    residual_dtype=None,
    weight_offset: bool = False,
    out_dtype=None,
    backward: bool = True,
    device: int | None = None,
    bias_dtype=None,
    h_dtype=None,
    quant: str | None = None,
    **quant_options,
) -> int:
    """Compile ahead every kernel that rows of ``n`` elements of ``dtype`` can take, at any
    number of rows, so that later calls compile nothing: warm up with it before capturing a
    CUDA graph (a capture cannot load a module), whatever M the capture uses.

    Covers contiguous rows at 16-byte aligned addresses (what the allocators return); other
    layouts may need other kernels. The keywords are the dtypes of a call's arguments:
    ``w_dtype`` (w's, default ``dtype``), ``b_dtype`` (b's, default w's), ``db_dtype`` (the
    backward's db, default w's), ``affine`` (w given, b given), ``rms`` (RMSNorm),
    ``residual`` (a residual add in front: the residual's dtype) and ``residual_dtype`` (h's,
    as the forward's keyword; default the residual's, and alone it stands for both),
    ``weight_offset`` (whether the calls pass one: the kernels then read a float32 scale),
    ``out_dtype`` (y's, as the forward's keyword), ``backward`` (the backward's kernels too),
    ``device`` (default CuPy's current device), ``quant`` (y quantized: the format and its
    options ``fp8_dtype``, ``block``, ``pow2_scale``, ``scale_layout``, as the forward's).
    ``bias_dtype`` and ``h_dtype`` are deprecated names (of ``db_dtype``; of h's dtype beside
    ``residual_dtype`` as the residual's). Returns the number of kernels, compiled or already
    there."""
    if bias_dtype is not None:
        db_dtype = _checks.renamed("bias_dtype", bias_dtype, "db_dtype", db_dtype)
    if h_dtype is not None:  # the old vocabulary: residual_dtype was the residual's
        if residual is not None:
            raise TypeError("h_dtype is the old name of residual_dtype; pass residual and "
                            "residual_dtype alone")  # fmt: skip
        warnings.warn("h_dtype is deprecated: pass residual= (the residual's dtype) and "
                      "residual_dtype= (h's)", DeprecationWarning, 2)  # fmt: skip
        if residual_dtype is None:
            raise ValueError("h_dtype needs a residual_dtype; got residual_dtype=None")
        residual, residual_dtype = residual_dtype, h_dtype
    p, db = for_precompile(n, dtype, w_dtype=w_dtype, b_dtype=b_dtype, db_dtype=db_dtype,
                           affine=affine, rms=rms, residual=residual,
                           residual_dtype=residual_dtype, weight_offset=weight_offset,
                           out_dtype=out_dtype, quant=quant, **quant_options)  # fmt: skip
    dev = _runtime.cupy().cuda.runtime.getDevice() if device is None else int(device)
    with _runtime.OnDevice(dev):
        done = _launcher.precompile(dev, p, db, bool(backward))
    return len(done)
