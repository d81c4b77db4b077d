"""The jagged kernels (kernels/jagged.cu) of one problem on one device, compiled and ready to
launch by role, and the offsets' check and clamp."""

from __future__ import annotations

from .._driver import Launcher
from .._plans import jagged as jag
from .._plans.common import grid_size
from .cache import cached
from .dense import dwdb_cols, fmt
from .device import capacity, device, function

# Parameter formats of the jagged kernels (kernels/jagged.cu), by role; every kernel but
# expand and check ends with has_long.
JAGGED_ARGS = {
    "partition": "QqqQQ",  # off, B, G, parts
    "fwd_short": "QQiQQQQQ{a}qiQiQ",  # x, off, D, y, w, b, mean, rstd, eps, cap, ring, parts, long
    "fwd_partial": "QQqiqqQQ",  # x, off, B, D, R, cap, part
    "fwd_combine": "QqiqqQQQQ{a}Q",  # off, B, D, R, cap, part, o1, o2, mean64, eps
    "bwd_combine": "QqiqqQQQQ{a}Q",
    "fwd_apply": "QQqiqqQQQQQQ",  # x, off, B, D, R, cap, y, w, b, mean64, rstd
    "bwd_short": "QQQqiQQQQqQ",  # dy, x, off, B, D, w, mean, rstd, dx, cap
    "bwd_partial": "QQQqiqqQQQQQ",  # dy, x, off, B, D, R, cap, w, mean, rstd, part
    "bwd_apply": "QQQqiqqQQQQQQQ",  # dy, x, off, B, D, R, cap, w, mean, rstd, c1, c2, dx
    "expand": "QqQQQQ",  # off, B, mean, rstd, row_mean, row_rstd
}
JAGGED_CHECK_ARGS = "QqqQ"  # off, B, total, flags (the clamp: off, B, total, out)


class JaggedKernels:
    """The jagged kernels of one problem on one device: ``self(role, work, stream, *args)``
    launches a role's kernel on a grid for ``work`` items, at most its resident blocks."""

    def __init__(self, dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen):
        info = device(dev)
        self.fwd = jag.jagged_plan(d, x_dtype, vec, info.smem_block, max_seqlen, False)
        self.bwd = jag.jagged_plan(d, x_dtype, vec, info.smem_block, max_seqlen, True)
        kernels = jag.jagged_kernels(x_dtype, w_dtype, b_dtype, o_dtype, vec, self.fwd, self.bwd)
        self.launch, self.capacity = {}, {}
        for role, (k, block, smem) in kernels.items():
            f = function(k, dev, smem)
            self.launch[role] = Launcher(f, fmt(JAGGED_ARGS[role], x_dtype))
            self.capacity[role] = (capacity(f, block, smem, dev), block, smem)
        # the forward short kernel is persistent: every resident block, each with its groups
        self.fwd_blocks = self.capacity["fwd_short"][0]
        self.fwd_groups = self.fwd_blocks * (self.fwd.block // self.fwd.group)
        self.cols = dwdb_cols(dev, x_dtype)  # dw/db: the dense backward's column kernel
        self.dtypes = x_dtype, w_dtype, b_dtype
        self.sm_count = info.sm_count

    def __call__(self, role, work, stream, *args):
        cap, block, smem = self.capacity[role]
        self.launch[role](grid_size(work, 1, cap), block, smem, stream, *args)


@cached(maxsize=1024)
def jagged(dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen) -> JaggedKernels:
    return JaggedKernels(dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen)


@cached(maxsize=64)
def jagged_clamp(dev, o_dtype) -> Launcher:
    """The offsets' clamp (one block of jag.JAG_CLAMP_BLOCK threads)."""
    return Launcher(function(jag.clamp_kernel(o_dtype), dev, 0), JAGGED_CHECK_ARGS)


@cached(maxsize=64)
def jagged_check(dev, o_dtype):
    """(launcher, resident blocks) of the offsets check."""
    f = function(jag.check_kernel(o_dtype), dev, 0)
    return Launcher(f, JAGGED_CHECK_ARGS), capacity(f, jag.JAG_SMALL_BLOCK, 0, dev)
