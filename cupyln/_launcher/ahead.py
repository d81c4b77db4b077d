"""Compiling ahead: every kernel that rows of N of one problem can take, at any number of rows,
so that a later CUDA-graph capture (which cannot load a module) compiles nothing."""

from __future__ import annotations

from .._plans import backward as bwd
from .._plans import forward as fwd
from .._plans.common import vector_width
from .._problem import Problem
from .device import capacity, device, function


def precompile(device_id: int, p: Problem, db_dtype, backward: bool = True) -> set:
    """Compile every kernel that rows of ``p.n`` (contiguous, pointers 16-byte aligned) of
    problem ``p`` can take at any M, forward and (``backward``) backward; ``db_dtype``: the
    backward's db. The backward of a residual add is the one of h, with and without dh.
    Returns the kernel records."""
    dev = device(device_id)
    done = set()
    for max_cluster in (dev.max_cluster, 1):
        fits = True
        for item in _ahead(dev, max_cluster, p, db_dtype, backward):
            if not hasattr(item, "kernel"):  # a kernel record of its own, no shared memory
                function(item, device_id, 0)
                done.add(item)
                continue
            f = function(item.kernel, device_id, item.smem)
            done.add(item.kernel)
            if item.cluster > 1:
                fits = fits and capacity(f, item.block, item.smem, device_id, item.cluster) > 0
        if fits:  # else the launches that find no cluster fitting take the plans without
            break
    return done


def _ahead(dev, max_cluster: int, p: Problem, db_dtype, backward: bool) -> set:
    """precompile's plans and kernel records at clusters of up to ``max_cluster`` blocks."""
    out = set()
    n, w_dtype, b_dtype = p.n, p.tw, p.tb

    def forward(x, res):
        widest = max([x.itemsize, p.ty.itemsize] + [d.itemsize for d in res or ()])
        vec = vector_width(widest, n, (n,))
        plans = fwd.forward_launch_plans(
            n, x, w_dtype, b_dtype, vec, dev.smem_block, max_cluster, dram_per_sm=dev.dram_per_sm,
            affine=p.affine, rms=p.rms, residual=res, threads_sm=dev.threads_sm,
            y_dtype=p.ty, quant=p.quant,
        )  # fmt: skip
        for plan in plans:
            out.add(plan)
            if plan.unfused:  # ln_fwd_add, then the norm of h as a problem of its own
                out.add(fwd.add_kernel(x, *res, vec))
                forward(res[1], None)

    forward(p.dtype, p.residual)
    if not backward:
        return out
    h = p.dtype if p.residual is None else p.residual[1]
    vec = vector_width(h.itemsize, n, (n,))
    for short in (False, True):
        for dh in {False, p.residual is not None}:
            plan = bwd.backward_plan(n, h, w_dtype, vec, dev.smem_block, max_cluster,
                                     short=short, rms=p.rms, dh=dh)  # fmt: skip
            out.add(plan)
            if plan.tier == "row":
                out.add(bwd.dwdb_cols_kernel(h, p.rms))
    db = w_dtype if p.rms else db_dtype  # as the launches instantiate the reduce
    for slices in (1, bwd.PARTIAL_REDUCE_FEW):
        out.add(bwd.reduce_kernel(n, slices, dev.sm_count, h, w_dtype, db)[0])
    return out
