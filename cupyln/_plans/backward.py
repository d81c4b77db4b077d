"""The backward's plans: dx and the dw/db partial rows, then their fixed-order reduce.

==============  ==========================================================  ==================
tier            rows                                                        kernel
==============  ==========================================================  ==================
reg             rows a block's registers hold (16-bit: up to 16K elements)   ln_bwd_reg
reg (cluster)   sm_90: 16-bit rows in 16-byte packs up to 64K, over blocks   ln_bwd_reg_cluster
ring            rows whose x and dy fit a block's shared memory              ln_bwd_ring
cluster         sm_90: wider rows, each block a column slice of a ring       ln_bwd_cluster
row             the rest: dx a block a row, dw/db by a column kernel         ln_bwd_row
==============  ==========================================================  ==================

Every tier but "row" writes one dw/db partial row per block (or cluster) of a persistent grid;
``ln_partial_reduce`` sums them in a fixed order (deterministic, no atomics). Every tuned
constant says in a line why it has its value; docs/tuning.md holds the A/B that chose it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .._dtypes import acc_dtype
from .common import (
    MAX_ITEMS,
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

# ------------------------------------------------------------------- register rows (ln_bwd_reg)
BWD_REG_VALUES = 16  # elements of x a thread keeps (x, dy and the dw/db sums share registers)
BWD_REG_THREADS = 768  # launch bounds' threads an SM, dw/db sums in registers
BWD_SHARED_SUMS_THREADS = 1024  # ...and with the sums in shared memory (64 registers)
BWD_REG_AHEAD_BLOCK = 256  # 16-bit blocks this large copy the next row's x, dy ahead
BWD_SHARED_SUMS_BLOCK = 448  # 16-bit blocks this large keep the dw/db sums in shared memory
BWD_SHARED_SUMS_BLOCK_MAX = 1024  # ...in blocks of up to this many threads
BWD_LONE_FROM = 640  # rows needing blocks past this many threads run instead...
BWD_LONE_BLOCK = 512  # ...blocks of this many threads...
BWD_LONE_ITEMS = 4  # ...of this many packs a thread: two such blocks share an SM
BWD_GROUP_BLOCK = 256  # rows of 64-128 threads share blocks this size: fewer partial rows
BWD_GROUP_VALUES = 12  # ...where a thread holds at most this many elements
BWD_GROUP_SHORT_VALUES = 16  # ...or this many in short launches

# -------------------------------------------------- register clusters (ln_bwd_reg_cluster)
BWD_REG_CLUSTER_BLOCK = 256  # the fewest blocks of at most this many threads...
BWD_REG_CLUSTER_LEAST = 128  # ...and at least this many...
BWD_REG_CLUSTER_ITEMS = 4  # ...of this many packs a thread...
BWD_REG_CLUSTER_MAX = 8  # ...in clusters of up to this many blocks
BWD_REG_CLUSTER_THREADS = 512  # launch bounds' threads an SM (two rows a block)

# ------------------------------------------------------------ staged tiers (ring, cluster, row)
BWD_RING_BLOCK = 512  # one block an SM, its whole shared memory a staging ring

# ------------------------------------------------------------------------ grid and reduce
BWD_MIN_STEPS = 8  # groups of rows each block walks at least: fewer partial rows
BWD_FILL = ((512, 3), (256, 1))  # (threads an SM, least steps a block) a short grid grows to
REDUCE_BLOCK = (32, 8)  # ln_bwd_dwdb_cols' threads (the row tier's dw/db)
PARTIAL_REDUCE_Y = 32  # ln_partial_reduce: blocks of (32, Y) threads...
PARTIAL_REDUCE_FEW = 256  # ...but under this many partial rows...
PARTIAL_REDUCE_FEW_Y = 8  # ...smaller blocks, more of them resident
REDUCE_AFTER_PRIOR = True  # sm_90: the reduce launches dependent on the partials' kernel


@dataclass(frozen=True)
class _Rows:
    """A backward register row's dtypes, pack width and device limit, and the shared-memory
    rules of its 16-bit form (``packs16``: 16-bit x planned in 16-byte packs; narrower packs,
    more of them, spill under the launch bounds)."""

    x_dtype: object
    w_dtype: object
    vec: int
    smem_limit: int
    packs16: bool

    def smem(self, block, items, shared, staged_w=False, tpr=None, ahead=None) -> int:
        """Dynamic shared bytes: x and dy of the next row (AHEAD: blocks of
        BWD_REG_AHEAD_BLOCK threads and up, or as ``ahead`` says), the dw/db sums (``shared``),
        w (``staged_w``: one copy a block, a row's worth of ``tpr`` threads)."""
        values = block * items * self.vec
        smem = 2 * values * acc_dtype(self.x_dtype).itemsize if shared else 0
        if ahead is None:
            ahead = block >= BWD_REG_AHEAD_BLOCK
        if ahead:
            smem += 2 * values * self.x_dtype.itemsize
        w_values = (tpr or block) * items * self.vec
        return smem + (w_values * self.w_dtype.itemsize if staged_w else 0)

    def stage_w(self, block, items, shared, threads=None) -> bool:
        """Whether the block copies its columns of w into shared memory once (STAGE_W): 16-bit
        rows with w of x's dtype; blocks that copy the next row ahead only where the SM still
        holds as many of them as ``threads`` an SM (the launch bounds') allow."""
        if not self.packs16 or self.w_dtype != self.x_dtype:
            return False
        if block < BWD_REG_AHEAD_BLOCK:
            return True

        def held(staged_w):  # blocks the SM's shared memory holds
            return self.smem_limit // (
                self.smem(block, items, shared, staged_w) + STATIC_SMEM_MARGIN
            )

        threads = threads or (BWD_SHARED_SUMS_THREADS if shared else BWD_REG_THREADS)
        return held(True) >= min(held(False), max(1, threads // block))

    def block_smem(self, block, items, shared) -> int:
        return self.smem(block, items, shared, self.stage_w(block, items, shared))

    def shared_sums(self, shape):
        """(shape, whether its dw/db sums go to shared memory): 16-bit rows in 16-byte packs,
        blocks of BWD_SHARED_SUMS_BLOCK threads and up that fit."""
        if shape is None or not self.packs16:
            return shape, False
        fits = self.smem(shape[2], shape[1], True) <= self.smem_limit - STATIC_SMEM_MARGIN
        return shape, shape[2] >= BWD_SHARED_SUMS_BLOCK and fits


def backward_plan(n: int, x_dtype, w_dtype, vec: int, smem_limit: int, max_cluster: int = 1,
                  short: bool = False, rms: bool = False, dh: bool = False) -> Plan:  # fmt: skip
    """The kernel computing dx (and, but in the row tier, the dw/db partial rows) for rows of
    N elements of ``x_dtype`` in packs of ``vec``, w of ``w_dtype``. ``max_cluster``: the
    largest thread-block cluster the device runs (1: none); ``short``: a launch whose grid
    stays short of the resident blocks (backward_short); ``rms``: RMSNorm's backward (the
    same tiers, no db); ``dh``: a gradient along the residual stream is added to dx."""
    rows = _Rows(x_dtype, w_dtype, vec, smem_limit, x_dtype.itemsize == 2 and vec == 8)
    dtypes = _policies(x_dtype, w_dtype, rms, dh)
    values = BWD_REG_VALUES * 4 // acc_dtype(x_dtype).itemsize
    shape = reg_shape(n, vec, values, REG_BLOCK_MAX)
    shared = False
    if rows.packs16:
        wide, wide_shared = rows.shared_sums(reg_shape(n, vec, values, BWD_SHARED_SUMS_BLOCK_MAX))
        if wide_shared:
            shape, shared = wide, True
            # (512 threads of 4 packs hold every row a block of 2 packs a thread does)
            lone, lone_fits = rows.shared_sums((BWD_LONE_BLOCK, BWD_LONE_ITEMS, BWD_LONE_BLOCK))
            if wide[2] > BWD_LONE_FROM and lone_fits:
                shape = lone
        elif wide is None:  # no block holds the row: a cluster of register blocks (sm_90)
            split = _reg_cluster(n, vec, min(max_cluster, BWD_REG_CLUSTER_MAX))
            if split is not None:
                c, (_, items, block) = split
                staged_w = rows.stage_w(block, items, True, BWD_REG_CLUSTER_THREADS)
                k = kernel("ln_bwd_reg_cluster", **dtypes, VEC=vec, ITEMS=items, BLOCK=block,
                           C=c, STAGE_W=staged_w)  # fmt: skip
                smem = rows.smem(block, items, True, staged_w, ahead=True)
                return Plan(k, "reg", vec, items, block, block, 1, smem, cluster=c)
    if shape is not None:
        return _reg_plan(n, rows, shape, values, shared, short, rms, dh)
    ring = _ring_shape(n, vec, x_dtype.itemsize, values, share(smem_limit), max_cluster)
    if ring is not None:
        c, items, lag, smem = ring
        b = BWD_RING_BLOCK
        if c == 1:
            k = kernel("ln_bwd_ring", **dtypes, VEC=vec, ITEMS=items, BLOCK=b)
        else:
            k = kernel("ln_bwd_cluster", **dtypes, VEC=vec, ITEMS=items, BLOCK=b, C=c, LAG=lag)
        return Plan(k, "ring" if c == 1 else "cluster", vec, items, b, b, 1, smem, cluster=c)
    row_bytes = 2 * staged(n, x_dtype.itemsize)
    stage = row_bytes <= smem_limit - STATIC_SMEM_MARGIN
    k = kernel("ln_bwd_row", **dtypes, VEC=vec, BLOCK=ROW_BLOCK, STAGE=stage)
    return Plan(k, "row", vec, 0, ROW_BLOCK, ROW_BLOCK, 1, row_bytes if stage else 0)


def _policies(x_dtype, w_dtype, rms: bool, dh: bool) -> dict:
    """The backward kernels' Load and Store: dx (and dy) of x's dtype, dh of it too where
    ``dh``; w's dtype, RMSNorm's or LayerNorm's math (kernels/policy.cuh)."""
    return dict(T=x_dtype, TR=x_dtype if dh else None, RMS=rms, TW=w_dtype, TB=None)


def _reg_plan(n: int, rows: _Rows, shape, values: int, shared: bool, short: bool,
              rms: bool = False, dh: bool = False) -> Plan:  # fmt: skip
    """ln_bwd_reg for ``shape`` (tpr, items, block): 16-bit rows of small blocks get blocks in
    steps of a warp (_small_block), rows of a block that shares its SM grow to split the SM's
    threads evenly (_fill_sm), and rows of 64-128 threads share blocks (_group_block)."""
    vec, packs16 = rows.vec, rows.packs16
    tpr, items, block = shape
    if packs16 and block < BWD_REG_AHEAD_BLOCK:
        vec, (tpr, items, block) = _small_block(n, vec, values)
        rows = replace(rows, vec=vec)
    if packs16 and tpr == block:
        tpr = block = _fill_sm(block, items, shared, rows.block_smem, rows.smem_limit)
    ahead = packs16 and block >= BWD_REG_AHEAD_BLOCK
    staged_w = rows.stage_w(block, items, shared)
    smem = rows.smem(block, items, shared, staged_w, tpr) if packs16 else 0
    if packs16 and not ahead and tpr > 32:
        block = _group_block(tpr, items * vec, short)
    k = kernel("ln_bwd_reg", **_policies(rows.x_dtype, rows.w_dtype, rms, dh), VEC=vec,
               ITEMS=items, TPR=tpr, BLOCK=block, AHEAD=ahead, SHARED_SUMS=shared,
               STAGE_W=staged_w)  # fmt: skip
    return Plan(k, "reg", vec, items, tpr, block, block // tpr, smem)


def _reg_cluster(n: int, vec: int, max_cluster: int):
    """(blocks a cluster, (tpr, items, block)) of a register row no block holds, split over a
    cluster a block per column slice: the fewest blocks (2, 4 or 8) of BWD_REG_CLUSTER_ITEMS
    packs a thread in BWD_REG_CLUSTER_LEAST to BWD_REG_CLUSTER_BLOCK threads (steps of a
    warp); None when none holds the row."""
    values = BWD_REG_CLUSTER_ITEMS * vec
    cluster = 2
    while cluster <= max_cluster:
        slice_n = slice_packs(n, vec, cluster) * vec
        got = reg_shape(slice_n, vec, values, BWD_REG_CLUSTER_BLOCK, step=32)
        if got is not None and got[0] == got[2] >= BWD_REG_CLUSTER_LEAST:
            return cluster, got
        cluster *= 2
    return None


def _small_block(n: int, vec: int, values: int):
    """(vec, (tpr, items, block)) of a 16-bit row whose block has fewer than
    BWD_REG_AHEAD_BLOCK threads: the fewest threads, in steps of a warp, each with only the
    packs the row needs, in packs of half the width where those leave fewer slots empty (ties
    keep the wider): more rows in flight, warps of equal work."""
    best = None
    for v in (vec, vec // 2):
        tpr, _, block = reg_shape(n, v, values, REG_BLOCK_MAX, step=32)
        items = cdiv(cdiv(n, v), tpr)  # the packs the row needs, not a power of two
        empty = tpr * items * v - n
        if best is None or empty < best[0]:
            best = empty, v, (tpr, items, block)
    return best[1:]


def _group_block(tpr: int, values: int, short: bool = False) -> int:
    """The block of 16-bit rows of ``tpr`` threads (more than a warp, under
    BWD_REG_AHEAD_BLOCK) of ``values`` elements a thread: BWD_GROUP_BLOCK threads, each row
    under its own named barrier, where ``tpr`` divides it and ``values`` is at most
    BWD_GROUP_VALUES (BWD_GROUP_SHORT_VALUES in a ``short`` launch); else a block a row."""
    most = BWD_GROUP_SHORT_VALUES if short else BWD_GROUP_VALUES
    return BWD_GROUP_BLOCK if BWD_GROUP_BLOCK % tpr == 0 and values <= most else tpr


def _fill_sm(block: int, items: int, shared: bool, smem, smem_limit: int) -> int:
    """The block of a 16-bit row that shares its SM: the smallest size that splits the launch
    bounds' threads an SM evenly among as many blocks, where the shared memory holds them
    (``smem(block, items, shared)`` bytes each); a lone block keeps its size."""
    threads = BWD_SHARED_SUMS_THREADS if shared else BWD_REG_THREADS
    blocks = threads // block
    if blocks < 2:
        return block
    grown = threads // blocks
    fits = blocks * (smem(grown, items, shared) + STATIC_SMEM_MARGIN) <= smem_limit
    return grown if fits else block


def _slice_rows(n: int, vec: int, itemsize: int, values: int, ring: int, cluster: int):
    """(items, rows, bytes) of a ring block whose cluster of ``cluster`` blocks shares each
    row: packs a thread, rows of x and dy slices its ring of ``ring`` bytes holds, bytes of one;
    None when the slice's dw/db sums do not fit the registers or no row fits."""
    packs = slice_packs(n, vec, cluster)
    items = cdiv(packs, BWD_RING_BLOCK)
    regs = items * vec <= 2 * values and items <= 2 * MAX_ITEMS  # 32 scalar slots spill
    row_bytes = 2 * staged(packs * vec, itemsize)
    fit = ring // row_bytes
    return (items, fit, row_bytes) if regs and fit >= 1 else None


def _ring_shape(n: int, vec: int, itemsize: int, values: int, ring: int, max_cluster: int):
    """(cluster, items, lag, shared bytes) of the ring tier (cluster 1) or the cluster tier:
    the smallest cluster whose blocks fit their slices, lag 1 (the next row's first pass
    overlaps the cluster's exchange) where the ring holds two rows of slices, the ring sized to
    whole rows of slices (what it leaves is L1, for w). None when no cluster fits or cp.async
    cannot copy the packs."""
    if not async_copyable(vec, itemsize):
        return None
    cluster = 1
    while cluster <= max_cluster:
        got = _slice_rows(n, vec, itemsize, values, ring, cluster)
        if got is not None:
            items, fit, row_bytes = got
            return cluster, items, int(cluster > 1 and fit >= 2), fit * row_bytes
        cluster *= 2
    return None


# ------------------------------------------------------------------------ grids and reduce
def backward_short(m: int, plan: Plan, capacity: int) -> bool:
    """Whether M rows in ``plan`` (``capacity`` resident blocks) make a short launch: blocks
    of BWD_MIN_STEPS groups of rows would not fill the resident blocks."""
    return m < plan.rows * BWD_MIN_STEPS * capacity


def backward_grid(m: int, plan: Plan, capacity: int, sm_count: int) -> int:
    """Blocks (clusters) of a backward, one dw/db partial row each: every block walks at least
    BWD_MIN_STEPS groups of rows. A grid of single blocks short of the resident capacity grows
    to the first of BWD_FILL (threads an SM, least steps a block) that its blocks still walk,
    then to whole blocks an SM where that shortens the most loaded SM's walk, then shrinks to
    the fewest blocks that walk as many steps."""
    g = grid_size(m, plan.rows * BWD_MIN_STEPS, capacity)
    if plan.cluster > 1 or g >= capacity:
        return g

    def steps(blocks):  # groups of rows the blocks that walk most take
        return cdiv(m, plan.rows * blocks)

    for threads, least in BWD_FILL:
        fill = min(capacity, sm_count * max(1, threads // plan.block))
        if steps(fill) >= least:
            break
    g = max(g, fill)
    whole = min(capacity, cdiv(g, sm_count) * sm_count)
    if cdiv(whole, sm_count) * steps(whole) < cdiv(g, sm_count) * steps(g):
        g = whole
    return max(1, cdiv(m, plan.rows * steps(g)))


def dwdb_slices(m: int, n: int, sm_count: int) -> tuple[int, int]:
    """(slices, rows a slice) of the row tier's ln_bwd_dwdb_cols: about 8 blocks an SM in all,
    each block walking at least 8 rows a thread-row."""
    col_blocks = cdiv(n, REDUCE_BLOCK[0])
    slices = max(1, min(cdiv(m, 64), cdiv(8 * sm_count, col_blocks)))
    per = cdiv(m, slices)
    return cdiv(m, per), per


def dwdb_cols_kernel(x_dtype, rms: bool = False):
    """The row tier's dw/db column kernel (also the jagged backward's)."""
    return kernel("ln_bwd_dwdb_cols", **_policies(x_dtype, x_dtype, rms, False))


def reduce_kernel(n: int, slices: int, sm_count: int, x_dtype, dw_dtype, db_dtype):
    """ln_partial_reduce summing ``slices`` partial rows of N columns, and its (32, Y) block:
    32 columns a block (a warp reads 128 bytes of one partial row), or 8 where even 4 times the
    blocks of 32 columns leave SMs idle; Y = PARTIAL_REDUCE_Y, or PARTIAL_REDUCE_FEW_Y under
    PARTIAL_REDUCE_FEW partial rows."""
    cols = 32 if 4 * cdiv(n, 32) > sm_count else 8
    y = PARTIAL_REDUCE_FEW_Y if slices < PARTIAL_REDUCE_FEW else PARTIAL_REDUCE_Y
    k = kernel("ln_partial_reduce", A=acc_dtype(x_dtype), TW=dw_dtype, TB=db_dtype, Y=y, C=cols)
    return k, cols, y
