"""The forward's plans: which kernel and launch shape a problem takes, tier by tier.

A tier is tried where the rows fit it, in this order (``forward_plan``):

==============  ==========================================================  ================
tier            rows                                                        kernel
==============  ==========================================================  ================
stream          sm_90, fast DRAM: 16-bit rows whose packs split evenly       ln_fwd_stream
reg (cluster)   sm_90: 16-byte rows past one block of FWD_REG_CLUSTER_BLOCK  ln_fwd_reg_cluster
cluster         sm_90: rows past one block's ring, split over a cluster      ln_fwd_cluster
reg             rows a block's registers hold                                ln_fwd_reg
ring            rows a block's shared memory holds                           ln_fwd_ring
row             the rest: one block a row, staged or re-read                 ln_fwd_row
==============  ==========================================================  ================

RMSNorm (``rms``) takes the same tiers but ring, whose rows go to row. A residual add
(``residual``: the dtypes of the residual and of h) is fused by the register rows (ln_fwd_reg),
and where x, the residual and h share a 16-bit dtype by the stream tier and the register
clusters; other rows take ``unfused`` plans: ln_fwd_add writes h first, then the norm of h runs
as a plan of h's dtype.

Every tuned constant below says in a line why it has its value; docs/tuning.md holds the A/B
that chose it. The kernels' headers (kernels/layer_norm_fwd*.cu) say what each template
argument does.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .._dtypes import acc_dtype
from .common import (
    MAX_GRID,
    REG_BLOCK_MAX,
    ROW_BLOCK,
    STATIC_SMEM_MARGIN,
    Plan,
    async_copyable,
    cdiv,
    grid_size,
    kernel,
    reg_shape,
    share,
    slice_packs,
    staged,
)

# ---------------------------------------------------------------- register rows (ln_fwd_reg)
FWD_REG_ITEMS = 8  # packs a thread keeps: 128 bytes in flight, no spills
FWD_REG_ITEMS_SHORT = 4  # short launches spread over more threads, so no SM idles
FWD_SHORT_WAVES = 12  # a launch under this many waves at FWD_REG_ITEMS is short
FWD_REG_THREADS = 1024  # launch bounds' threads an SM: registers do not cap occupancy
FWD_REG_BLOCK_MAX = 1024  # 16/32-bit rows kept as loaded fit a block of 1024 threads
FWD_CENTER_BYTES = 128  # centered copies (one instruction a pass): bytes of A a thread
FWD_CENTER_BLOCK = 128  # ...in blocks up to this size; wider ones lose to rows as loaded
FWD_CENTER_THREADS = 768  # ...at this many threads an SM (80 registers a thread)
FWD_CENTER_EXACT = True  # sm_90: rows of a warp whose packs fill 3 of 4 slots keep just 3
FWD_LEAN_FROM = 6144  # 16-bit rows from this width keep FWD_REG_ITEMS_SHORT packs...
FWD_LEAN_THREADS = 1536  # ...where their block divides this many threads an SM (40 registers)

FWD_QUANT_ITEMS = 4  # a quantized y: packs a thread keeps (at 8, ptxas spills the block formats)
FWD_RES_ITEMS = 4  # with a residual: x's and the residual's packs are in flight at once...
FWD_RES_THREADS = 768  # ...in 80 registers a thread: at 64, ptxas spills
FWD_RES_THREADS_FP16 = 512  # ...and float16's widenings in 128: at 80 it spills
FWD_RES_CLUSTER_SPLIT = 2  # rows past one block: cluster blocks an SM, at those threads

# ---------------------------------------------------- register clusters (ln_fwd_reg_cluster)
FWD_REG_CLUSTER_BLOCK = 512  # rows past one block this size split over a cluster (sm_90)
FWD_REG_CLUSTER_MAX = 8  # ...of at most this many blocks
FWD_STAGE_WB_SM = 200 * 1024  # w and b copied to shared memory where an SM's copies fit this
FWD_LAG_BLOCK = 384  # float32 cluster blocks this large hold two rows, one block an SM

# ------------------------------------------------------------------- stream (ln_fwd_stream)
FWD_STREAM_DRAM_PER_SM = 30e9  # peak DRAM bytes/s an SM from which streaming pays (H200)
FWD_STREAM_SHORT = True  # short launches stream where no register plan fits one wave
FWD_STREAM_PAIRS = 256  # narrow rows: two packs a thread in up to this many threads
FWD_STREAM_PARTIAL = 64  # ...rows of this many threads may leave some last packs empty
FWD_STREAM_FILL = 0.875  # ...where they fill at least this share of the packs
FWD_STREAM_SHAPES = ((512, (2,)),)  # (threads, packs a thread): N = 8192 over 512 x 2
FWD_STREAM_EVEN = ((3, 640), (4, 640), (2, 384))  # (packs a thread, most threads) in order
FWD_STREAM_EVEN_LEAST = 256  # ...over at least this many threads, a multiple of a warp
FWD_STREAM_RES_SHAPES = ((1024, (4,)),)  # a residual add's too: N = 32768 beats its clusters
FWD_STREAM_THREADS = 2048  # launch bounds' threads an SM (32 registers a thread)
FWD_STREAM_WARP_BLOCK = 256  # rows of a warp run eight to a block
FWD_STREAM_ROLL_THREADS = 128  # rows of 2 packs over 33 to this many threads loop pass 2
FWD_STREAM_COHERENT_WB = frozenset({"float16"})  # these dtypes read w, b coherently in pass 2
FWD_STREAM_RMS_STEPS = 3  # RMSNorm streams at most this many packs a thread (4 spill)

# ------------------------------------------------ staged tiers (ln_fwd_ring, _cluster, _row)
RING_SPLIT = 3  # ring blocks an SM where a row fits a third of the shared memory...
RING_BLOCK_SPLIT = 256  # ...of this many threads each
RING_BLOCK = 512  # else one or two blocks of this many threads
FWD_CLUSTER_BLOCK = 512  # cluster tier blocks, with FWD_CLUSTER_SPLIT = 1
FWD_CLUSTER_BLOCK_SPLIT = 256  # ...and with FWD_CLUSTER_SPLIT > 1
FWD_CLUSTER_SPLIT = 3  # cluster-tier blocks an SM
FWD_CLUSTER_ROWS = 1  # rows of slices each cluster-tier ring holds
ROW_BLOCK_ALONE = 512  # ...a block alone on its SM needs more threads


def forward_items(m: int, n: int, vec: int, sm_count: int) -> int:
    """Packs each register-tier thread keeps for M rows of N: FWD_REG_ITEMS, or
    FWD_REG_ITEMS_SHORT where the launch would run under FWD_SHORT_WAVES waves of
    FWD_REG_THREADS threads on every SM."""
    threads = m * cdiv(n, vec * FWD_REG_ITEMS)
    enough = threads >= FWD_SHORT_WAVES * sm_count * FWD_REG_THREADS
    return FWD_REG_ITEMS if enough else FWD_REG_ITEMS_SHORT


def forward_waves(m: int, plan: Plan, sm_count: int) -> float:
    """Waves of resident blocks the grid of a register plan (a block per group of rows) takes
    for M rows at its launch bounds' threads an SM; 0 for the persistent plans."""
    if plan.tier != "reg" or plan.cluster > 1 or not plan.threads:
        return 0.0
    return cdiv(m, plan.rows) / (sm_count * (plan.threads // plan.block))


def forward_launch_plan(m: int, n: int, x_dtype, w_dtype, b_dtype, vec: int, smem_limit: int,
                        max_cluster: int, sm_count: int, dram_per_sm: float = 0.0,
                        affine: tuple = (True, True), rms: bool = False,
                        residual: tuple | None = None, threads_sm: int = FWD_STREAM_THREADS,
                        y_dtype=None, quant=None) -> Plan:  # fmt: skip
    """The forward's plan for M rows of N: ``forward_plan`` at ``forward_items`` packs a
    thread. A short launch on a device with clusters takes instead, of the plans whose grid fits
    one wave of resident blocks, the one that fills it most, where that beats the first plan's
    fill of its waves; and streams where none fits one wave (FWD_STREAM_SHORT). Long launches
    stream where the device's DRAM feeds an SM at FWD_STREAM_DRAM_PER_SM or more and an SM holds
    FWD_STREAM_THREADS threads (``threads_sm``). ``affine``: (w given, b given); ``rms``,
    ``residual``, ``y_dtype``, ``quant``: as forward_plan."""
    items = forward_items(m, n, vec, sm_count)
    if quant is not None:
        return quant_plan(n, x_dtype, w_dtype, b_dtype, vec, items, rms=rms, residual=residual,
                          quant=quant)  # fmt: skip
    fast = dram_per_sm >= FWD_STREAM_DRAM_PER_SM and threads_sm >= FWD_STREAM_THREADS
    stream = fast and m <= MAX_GRID
    dtypes = (x_dtype, w_dtype, b_dtype)
    norm = dict(rms=rms, residual=residual, y_dtype=y_dtype)
    plan = forward_plan(n, *dtypes, vec, smem_limit, max_cluster, items, stream=stream,
                        affine=affine, **norm)  # fmt: skip
    if items == FWD_REG_ITEMS or max_cluster <= 1:
        return plan
    waves = forward_waves(m, plan, sm_count)
    if not waves:
        return plan
    best, fill = plan, waves / math.ceil(waves)
    for other in (
        forward_plan(n, *dtypes, vec, smem_limit, max_cluster, items, True, **norm),
        forward_plan(n, *dtypes, vec, smem_limit, max_cluster, **norm),
    ):
        w = forward_waves(m, other, sm_count)
        if 0 < w <= 1 and w > fill:
            best, fill = other, w
    if FWD_STREAM_SHORT and stream and best is plan and waves > 1:
        streamed = forward_plan(n, *dtypes, vec, smem_limit, max_cluster, stream=True,
                                affine=affine, **norm)  # fmt: skip
        if streamed.tier == "stream":
            return streamed
    return best


def forward_launch_plans(n: int, x_dtype, w_dtype, b_dtype, vec: int, smem_limit: int,
                         max_cluster: int, dram_per_sm: float = 0.0,
                         affine: tuple = (True, True), rms: bool = False,
                         residual: tuple | None = None, threads_sm: int = FWD_STREAM_THREADS,
                         y_dtype=None, quant=None) -> set:  # fmt: skip
    """Every plan forward_launch_plan can return for rows of N, whatever M (a few more: the
    plans it weighs), for compiling ahead of a CUDA-graph capture."""
    if quant is not None:
        q = dict(rms=rms, residual=residual, quant=quant)
        return {quant_plan(n, x_dtype, w_dtype, b_dtype, vec, items, **q)
                for items in (FWD_REG_ITEMS, FWD_REG_ITEMS_SHORT)}  # fmt: skip
    dtypes = (x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster)
    norm = dict(affine=affine, rms=rms, residual=residual, y_dtype=y_dtype)
    fast = dram_per_sm >= FWD_STREAM_DRAM_PER_SM and threads_sm >= FWD_STREAM_THREADS
    plans = set()
    for items in (FWD_REG_ITEMS, FWD_REG_ITEMS_SHORT):
        for stream in {False, fast}:
            plans.add(forward_plan(n, *dtypes, items, stream=stream, **norm))
    if max_cluster > 1:
        plans.add(forward_plan(n, *dtypes, FWD_REG_ITEMS_SHORT, True, rms=rms, residual=residual,
                               y_dtype=y_dtype))  # fmt: skip
    return plans


def forward_plan(n: int, x_dtype, w_dtype, b_dtype, vec: int, smem_limit: int,
                 max_cluster: int = 1, items: int = FWD_REG_ITEMS, one_wave: bool = False,
                 stream: bool = False, affine: tuple = (True, True), rms: bool = False,
                 residual: tuple | None = None, res_stream: bool = False,
                 y_dtype=None, quant=None) -> Plan:  # fmt: skip
    """The forward's kernel for rows of N elements of ``x_dtype`` in packs of ``vec``.

    ``smem_limit``: the device's opt-in shared bytes a block; ``max_cluster``: the largest
    thread-block cluster it runs (1: none); ``items``: packs a register-tier thread keeps
    (forward_items); ``one_wave``: centered rows ask for FWD_REG_THREADS an SM (sm_90 short
    launches); ``stream``: 16-bit rows of a streamable shape stream (sm_90, at FWD_REG_ITEMS);
    ``affine``: (w given, b given), compile-time flags of the stream kernel; ``rms``: RMSNorm;
    ``residual``: (residual dtype, h dtype) of a residual add in front, or None; ``res_stream``:
    the stream shapes of a residual add's rows (FWD_STREAM_RES_SHAPES besides); ``y_dtype``:
    y's dtype, where not x's (the Store's); ``quant``: a quantized y's spec (quant_plan)."""
    if quant is not None:
        return quant_plan(n, x_dtype, w_dtype, b_dtype, vec, items, rms=rms, residual=residual,
                          quant=quant)  # fmt: skip
    if residual is not None:
        return _residual_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster, items,
                              one_wave=one_wave, stream=stream, affine=affine, rms=rms,
                              residual=residual, y_dtype=y_dtype)  # fmt: skip
    dtypes = dict(T=x_dtype, TY=y_dtype or x_dtype, TW=w_dtype, TB=b_dtype)
    size = x_dtype.itemsize
    row_bytes = staged(n, size)
    widest = max(size, w_dtype.itemsize, b_dtype.itemsize)
    wide = widest > 4  # double x, w or b: 1024-thread blocks at 64 registers spill
    block_max = REG_BLOCK_MAX if wide else FWD_REG_BLOCK_MAX
    wide16 = vec * size == 16
    # 16-bit x, w and b in 16-byte packs on sm_90 (on sm_80 ptxas spills some of their blocks)
    sixteen = wide16 and widest == 2 and max_cluster > 1
    streamable = stream and sixteen and items == FWD_REG_ITEMS
    streamed = _stream_shape(n, vec, res_stream) if streamable else None
    if rms and streamed is not None and streamed[1] > FWD_STREAM_RMS_STEPS:
        streamed = None
    if streamed is not None and not one_wave:
        return _stream_plan(n, vec, dtypes, streamed, affine, rms)
    if sixteen and n >= FWD_LEAN_FROM:
        shape4 = reg_shape(n, vec, FWD_REG_ITEMS_SHORT * vec, block_max)
        if shape4 is not None and FWD_LEAN_THREADS % shape4[2] == 0:  # 192, 256, 384, 512
            items = FWD_REG_ITEMS_SHORT
    shape = reg_shape(n, vec, items * vec, block_max)
    if items != FWD_REG_ITEMS and (shape is None or shape[2] > FWD_REG_CLUSTER_BLOCK):
        items = FWD_REG_ITEMS
        shape = reg_shape(n, vec, items * vec, block_max)
    values = items * vec
    # register clusters take 16-byte packs only: narrower ones lost to one block or a ring
    split = _reg_cluster(n, vec, values, shape, max_cluster) if wide16 and not wide else None
    if split is not None:
        return _reg_cluster_plan(vec, dtypes, split, smem_limit, rms)
    ring_split = _cluster_shape(n, vec, size, row_bytes, smem_limit, max_cluster)
    if ring_split is not None:
        c, block, smem = ring_split
        k = kernel("ln_fwd_cluster", **dtypes, RMS=rms, VEC=vec, BLOCK=block, C=c)
        return Plan(k, "cluster", vec, 0, block, block, 1, smem=smem, cluster=c)
    if shape is not None:
        return _reg_plan(n, vec, dtypes, shape, values, block_max, sixteen=sixteen,
                         one_wave=one_wave, max_cluster=max_cluster, rms=rms)  # fmt: skip
    copyable = async_copyable(vec, size) and not rms  # ring_forward.cuh is LayerNorm's only
    ring = _ring_shape(row_bytes, smem_limit) if copyable else None
    if ring is not None:
        block, smem = ring
        k = kernel("ln_fwd_ring", **dtypes, RMS=False, VEC=vec, BLOCK=block, GROUP=block)
        return Plan(k, "ring", vec, 0, block, block, 1, smem)
    stage = row_bytes <= smem_limit - STATIC_SMEM_MARGIN
    alone = not stage or 2 * (row_bytes + STATIC_SMEM_MARGIN) > smem_limit
    block = ROW_BLOCK_ALONE if alone else ROW_BLOCK
    k = kernel("ln_fwd_row", **dtypes, RMS=rms, VEC=vec, BLOCK=block, STAGE=stage)
    return Plan(k, "row", vec, 0, block, block, 1, row_bytes if stage else 0)


def quant_plan(n, x_dtype, w_dtype, b_dtype, vec, items, *, rms=False, residual=None,
               quant) -> Plan:  # fmt: skip
    """ln_fwd_reg with a quantizing Store (``quant``: a checked _formats.Spec): the register rows
    hold every value of a scale's block until its max is known, so y is quantized in the norm's
    one pass. A residual add is fused where one block of REG_BLOCK_MAX threads holds the row at
    FWD_RES_ITEMS packs a thread, else ln_fwd_add runs first (``unfused``). ValueError where no
    block holds the row (the other tiers keep no block's values to quantize them)."""
    from .._dtypes import BYTES
    from .._formats import store_args

    h_dtype = x_dtype if residual is None else residual[1]
    items = min(items, FWD_QUANT_ITEMS)
    wide = max(h_dtype.itemsize, w_dtype.itemsize, b_dtype.itemsize) > 4
    block_max = REG_BLOCK_MAX if wide or residual is not None else FWD_REG_BLOCK_MAX
    if residual is not None:
        items = min(items, FWD_RES_ITEMS)
    shape = reg_shape(n, vec, items * vec, block_max)
    if shape is None and items != FWD_REG_ITEMS:
        items = FWD_REG_ITEMS if residual is None else FWD_RES_ITEMS
        shape = reg_shape(n, vec, items * vec, block_max)
    if shape is None and residual is not None:
        h_plan = quant_plan(n, h_dtype, w_dtype, b_dtype, vec, FWD_REG_ITEMS, rms=rms, quant=quant)
        return replace(h_plan, unfused=True)
    limit = FWD_REG_ITEMS * vec * block_max
    if shape is None:
        raise ValueError(f"quant={quant.name!r} takes rows of at most {limit} elements of "
                         f"{h_dtype.name} here; got N = {n}")  # fmt: skip
    dtypes = dict(T=x_dtype, TY=BYTES, TW=w_dtype, TB=b_dtype, **store_args(quant))
    plan = _reg_plan(n, vec, dtypes, shape, items * vec, block_max, sixteen=False,
                     one_wave=False, max_cluster=1, rms=rms, residual=residual)  # fmt: skip
    pb = (quant.block or 0) // vec  # packs a block scale covers (0: no blocks)
    tpr = plan.tpr
    # a block's packs within a warp, whole rows' lanes, or whole warps of a block's row
    # (policy.cuh); fp4 elements in pairs
    warps = pb > 32 and tpr == plan.block and tpr % pb == 0 and tpr // pb <= 15  # named barriers
    if (pb and not (pb <= 32 or pb % tpr == 0 or warps)) or (quant.name == "nvfp4" and vec % 2):
        raise ValueError(f"quant={quant.name!r} needs rows whose packs fill its blocks: x, "
                         f"the residual and N aligned to 16 bytes; got N = {n} in packs of "
                         f"{vec}")  # fmt: skip
    return plan


def _residual_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster, items, *,
                   one_wave, stream, affine, rms, residual, y_dtype=None) -> Plan:  # fmt: skip
    """The plan of a residual add in front of the norm: the stream tier where x, the residual
    and h share a dtype, else the register rows where one block holds the row; else the plan of
    h's norm, ``unfused`` (ln_fwd_add writes h first)."""
    r_dtype, h_dtype = residual
    same = x_dtype == r_dtype == h_dtype
    # the stream tier's shapes as LayerNorm's (FWD_STREAM_RMS_STEPS is RMSNorm's alone: with a
    # residual, 4 packs a thread stream faster than the register rows)
    plain = forward_plan(n, x_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster, items,
                         one_wave=one_wave, stream=stream and same, affine=affine,
                         res_stream=True)  # fmt: skip
    dtypes = dict(T=x_dtype, TY=y_dtype or x_dtype, TW=w_dtype, TB=b_dtype)
    if plain.tier == "stream":
        shape = (plain.tpr, plain.items, plain.arg("PARTIAL"))
        return _stream_plan(n, vec, dtypes, shape, affine, rms, residual)
    block_max = REG_BLOCK_MAX  # (1024-thread blocks cap a thread at 64 registers: spills)
    items = min(items, FWD_RES_ITEMS)
    shape = reg_shape(n, vec, items * vec, block_max)
    if shape is not None:
        return _reg_plan(n, vec, dtypes, shape, items * vec, block_max, sixteen=False,
                         one_wave=one_wave, max_cluster=max_cluster, rms=rms,
                         residual=residual)  # fmt: skip
    # rows past one block: 16-bit ones (16-byte packs of one dtype) split over a cluster of
    # blocks that share an SM FWD_RES_CLUSTER_SPLIT or more at a time
    sixteen = same and x_dtype.itemsize == 2 and vec == 8 and w_dtype.itemsize <= 4
    sixteen = sixteen and b_dtype.itemsize <= 4
    threads = _residual_threads(x_dtype, h_dtype)
    cap = threads // FWD_RES_CLUSTER_SPLIT
    split = _reg_cluster(n, vec, items * vec, None, max_cluster, cap) if sixteen else None
    if split is not None:
        return _reg_cluster_plan(vec, dtypes, split, smem_limit, rms, residual, threads)
    h_plan = forward_plan(n, h_dtype, w_dtype, b_dtype, vec, smem_limit, max_cluster, items,
                          one_wave=one_wave, affine=affine, rms=rms,
                          y_dtype=y_dtype or x_dtype)  # fmt: skip
    return replace(h_plan, unfused=True)


def _residual_threads(x_dtype, h_dtype) -> int:
    """Launch bounds' threads an SM of the kernels that fuse a residual add (FWD_RES_THREADS;
    float16's widenings take FWD_RES_THREADS_FP16)."""
    fp16 = "float16" in (x_dtype.name, h_dtype.name)
    return FWD_RES_THREADS_FP16 if fp16 else FWD_RES_THREADS


def _reg_plan(n, vec, dtypes, shape, values, block_max, *, sixteen, one_wave, max_cluster,
              rms=False, residual=None) -> Plan:  # fmt: skip
    """ln_fwd_reg: the row as loaded (``shape``) or, for 16-bit rows in blocks of up to
    FWD_CENTER_BLOCK threads and double rows, centered copies in the arithmetic type. With a
    ``residual`` the row held is h's."""
    x_dtype = dtypes["T"] if residual is None else residual[1]
    size = x_dtype.itemsize
    acc = acc_dtype(x_dtype).itemsize
    centered = reg_shape(n, vec, min(values, FWD_CENTER_BYTES // acc), block_max)
    exact = False  # a row of a warp or less in the slots its packs fill (FWD_CENTER_EXACT)
    if FWD_CENTER_EXACT and sixteen and centered and centered[0] <= 32:
        tpr, slots, block = centered
        if n % (tpr * vec) == 0 and n // (tpr * vec) < slots:
            centered, exact = (tpr, n // (tpr * vec), block), True
    in_place = acc == size  # double: centered in the loaded registers
    center = (
        size != 4
        and not rms  # RMSNorm's y adds the mean back to centered values: a register more
        and residual is None  # (x's and the residual's packs are in flight besides)
        and centered is not None
        and (in_place or centered[2] <= FWD_CENTER_BLOCK)
        and cdiv(n, centered[0] * vec) == centered[1]  # every slot holds a pack
    )
    tpr, items, block = centered if center else shape
    lean = sixteen and not center and items == FWD_REG_ITEMS_SHORT and tpr > 32
    if center:
        wave = exact or (one_wave and max_cluster > 1)  # sm_90: 1024 threads an SM
        threads = FWD_REG_THREADS if wave else FWD_CENTER_THREADS
    else:
        threads = FWD_LEAN_THREADS if lean else FWD_REG_THREADS
    if residual is not None:
        threads = _residual_threads(dtypes["T"], x_dtype)
    wide = max(size, dtypes["TW"].itemsize, dtypes["TB"].itemsize) > 4
    minb = 1 if wide else max(1, threads // block)
    whole = min(items, n // (tpr * vec)) if center and acc > size else 0
    tr, th = residual if residual is not None else (None, None)
    k = kernel("ln_fwd_reg", **dtypes, RMS=rms, TR=tr, TH=th, VEC=vec, ITEMS=items, TPR=tpr,
               BLOCK=block, MINB=minb, CENTER=center, WHOLE=whole)  # fmt: skip
    return Plan(k, "reg", vec, items, tpr, block, block // tpr, 0,
                threads=0 if wide else minb * block)  # fmt: skip


def _stream_plan(n, vec, dtypes, shape, affine, rms=False, residual=None) -> Plan:
    """ln_fwd_stream for a ``_stream_shape``: a block a row, or eight rows of a warp. Its
    Store's w and b are void where not given (``affine``): known when compiling."""
    tpr, steps, partial = shape
    block = tpr if tpr > 32 else FWD_STREAM_WARP_BLOCK
    minb = FWD_STREAM_THREADS // block
    roll = steps == 2 and not partial and 32 < tpr <= FWD_STREAM_ROLL_THREADS
    names = {dtypes[p].name for p in ("T", "TW", "TB")}
    tw = dtypes["TW"] if affine[0] else None
    tb = dtypes["TB"] if affine[1] else None
    res = dtypes["T"] if residual is not None else None
    k = kernel("ln_fwd_stream", T=dtypes["T"], TR=res, TH=res, RMS=rms, TY=dtypes["TY"], TW=tw,
               TB=tb, VEC=vec, TPR=tpr, BLOCK=block, NCH=steps, MINB=minb, PARTIAL=partial,
               ROLL=roll, COHERENT_WB=bool(names & FWD_STREAM_COHERENT_WB))  # fmt: skip
    return Plan(k, "stream", vec, steps, tpr, block, block // tpr, 0, threads=minb * block)


def _stream_shape(n: int, vec: int, residual: bool = False):
    """(threads a row, packs a thread, partial) of the stream tier, or None: two packs a
    thread in the fewest warps up to FWD_STREAM_PAIRS threads where the row fills them
    (partial: FWD_STREAM_FILL of FWD_STREAM_PARTIAL threads' packs); else the first of
    FWD_STREAM_SHAPES (with a ``residual`` add, FWD_STREAM_RES_SHAPES too), then of
    FWD_STREAM_EVEN, that splits the row's packs evenly."""
    packs, rest = divmod(n, vec)
    if rest:
        return None
    tpr = 32 * cdiv(packs, 64)
    if packs > 32 and tpr <= FWD_STREAM_PAIRS:
        if packs == 2 * tpr:
            return tpr, 2, False
        if tpr == FWD_STREAM_PARTIAL and packs >= FWD_STREAM_FILL * 2 * tpr:
            return tpr, 2, True
    for tpr, steps in FWD_STREAM_SHAPES + (FWD_STREAM_RES_SHAPES if residual else ()):
        if packs % tpr == 0 and packs // tpr in steps:
            return tpr, packs // tpr, False
    for steps, most in FWD_STREAM_EVEN:
        tpr, left = divmod(packs, steps)
        if not left and tpr % 32 == 0 and FWD_STREAM_EVEN_LEAST <= tpr <= most:
            return tpr, steps, False
    return None


def _reg_cluster(n: int, vec: int, values: int, shape, max_cluster: int,
                 block_max: int = FWD_REG_CLUSTER_BLOCK):  # fmt: skip
    """(blocks a cluster, items, threads) of a register row split over a cluster: None where
    one block of at most ``block_max`` threads holds it (``shape``), else the fewest blocks (up
    to FWD_REG_CLUSTER_MAX) whose slices fit such blocks at ``values`` a thread."""
    if shape is not None and shape[2] <= block_max:
        return None
    cluster = 2
    while cluster <= min(max_cluster, FWD_REG_CLUSTER_MAX):
        got = reg_shape(slice_packs(n, vec, cluster) * vec, vec, values, block_max)
        if got is not None and got[0] == got[2] > 32:  # a block per slice
            return cluster, got[1], got[2]
        cluster *= 2
    return None


def _reg_cluster_plan(vec: int, dtypes: dict, split, smem_limit: int, rms: bool = False,
                      residual: tuple | None = None,
                      threads: int = FWD_REG_THREADS) -> Plan:  # fmt: skip
    """ln_fwd_reg_cluster at ``threads`` an SM (launch bounds), w's and b's slices staged in
    shared memory where the SM's blocks' copies fit FWD_STAGE_WB_SM (float32 rows: two rows a
    block in blocks of FWD_LAG_BLOCK threads or more; else fewer blocks an SM, or twice the
    blocks of half the threads). ``residual``: (residual dtype, h dtype) of an add in front."""
    x, w, b = dtypes["T"], dtypes["TW"], dtypes["TB"]
    cluster, items, block = split
    minb = max(1, threads // block)
    smem = items * block * vec * (w.itemsize + b.itemsize)
    room = min(FWD_STAGE_WB_SM, smem_limit)
    fits = room // (smem + STATIC_SMEM_MARGIN)  # blocks an SM whose copies fit
    f32 = x.itemsize == 4
    lag = False
    if f32 and block >= FWD_LAG_BLOCK and fits >= 1:
        minb, lag = 1, True
    elif fits >= minb:
        pass
    elif f32 and fits >= 2:
        minb = fits
    elif f32 and cluster == 2 and block % 64 == 0 and room // (smem // 2 + STATIC_SMEM_MARGIN) >= 2:
        half = smem // 2
        cluster, block, smem = 4, block // 2, half
        minb = min(2 * minb, room // (half + STATIC_SMEM_MARGIN))
    else:
        smem = 0  # w and b read through L1
    tr, th = residual if residual is not None else (None, None)
    k = kernel("ln_fwd_reg_cluster", **dtypes, RMS=rms, TR=tr, TH=th, VEC=vec, ITEMS=items,
               BLOCK=block, C=cluster, MINB=minb, STAGE_WB=smem > 0, LAG=lag)  # fmt: skip
    return Plan(k, "reg", vec, items, block, block, 1, smem, cluster=cluster)


def _cluster_shape(n, vec, itemsize, row_bytes, smem_limit, max_cluster):
    """(blocks a cluster, threads, shared bytes) of the cluster tier: None while one block's
    ring holds the row (or cp.async cannot copy the packs, or no cluster fits), else the
    fewest blocks whose rings hold FWD_CLUSTER_ROWS rows of slices at FWD_CLUSTER_SPLIT
    blocks an SM."""
    ring = share(smem_limit, FWD_CLUSTER_SPLIT)
    if not async_copyable(vec, itemsize) or row_bytes <= share(smem_limit):
        return None
    block = FWD_CLUSTER_BLOCK if FWD_CLUSTER_SPLIT == 1 else FWD_CLUSTER_BLOCK_SPLIT
    cluster = 2
    while cluster <= max_cluster:
        slice_bytes = staged(slice_packs(n, vec, cluster) * vec, itemsize)
        if FWD_CLUSTER_ROWS * slice_bytes <= ring:
            return cluster, block, ring
        cluster *= 2
    return None


def _ring_shape(nbytes: int, smem_limit: int):
    """(threads, shared bytes) of a ring block holding one row of ``nbytes``: the most blocks
    an SM (up to RING_SPLIT) whose shares hold it; None when not even one block's does."""
    for k in range(RING_SPLIT, 0, -1):
        if nbytes <= share(smem_limit, k):
            return (RING_BLOCK_SPLIT if k == RING_SPLIT else RING_BLOCK), nbytes
    return None


ADD_BLOCK = 256  # ln_fwd_add's threads a block (a grid-stride walk: any size keeps up)


def add_kernel(x_dtype, r_dtype, h_dtype, vec: int):
    """ln_fwd_add: h = x + residual, for the unfused plans."""
    return kernel("ln_fwd_add", T=x_dtype, TR=r_dtype, TH=h_dtype, VEC=vec)


def forward_grid(m: int, plan: Plan, capacity: int) -> int:
    """Blocks of a forward launch: a block per group of rows for the register and stream
    tiers' single blocks (the hardware starts them as others finish); a persistent grid of
    ``capacity`` resident blocks (or clusters) for the clusters and the staged tiers."""
    if plan.tier in ("reg", "stream") and plan.cluster == 1:
        return max(1, min(cdiv(m, plan.rows), MAX_GRID))
    return grid_size(m, plan.rows, capacity) * plan.cluster
