"""CPU tier: the plans return a valid kernel and launch shape for every N they claim (any
N >= 1), and the helpers around them (vector width, grid, dw/db slices) keep their limits.
Plans are checked by their fields and their kernels' named template arguments."""

import ctypes

import numpy as np
import pytest

from cupyln import _driver
from cupyln import reference as ref
from cupyln._dtypes import TABLE
from cupyln._plans import backward as B
from cupyln._plans import common as C
from cupyln._plans import forward as F
from cupyln._plans import jagged as J
from cupyln._plans.common import kernel
from cupyln._plans.devices import ARCHS, PROFILES, unsupported

SMEM_H100 = 232448  # sm_90 opt-in shared memory per block
SMEM_A100 = 166912  # sm_80
CLUSTERS = {SMEM_H100: C.MAX_CLUSTER, SMEM_A100: 1}  # sm_80 has no thread-block clusters
DTYPES = list(TABLE)

# Every vector count of the register tiers, then rows that need the shared-memory and re-read
# tiers; 760/769/1128/8193/65537 are the non-power-of-two widths users hit.
NS = sorted(set(range(1, 17000)) | {32768, 65536, 65537, 131072, 262144, 10**6, 2**24 + 3})


def _vecs(dtype):
    return [v for v in (8, 4, 2, 1) if v * dtype.itemsize <= 16]


def _reg_block_max(forward: bool, dtype, vec: int) -> int:
    """The register tier's largest block: 1024 threads for the forward of 16/32-bit rows
    (with w and b of the same dtype) and the backward of 16-bit rows in 16-byte packs."""
    if forward:
        return 1024 if dtype.itemsize <= 4 else 512
    return 1024 if dtype.itemsize == 2 and vec == 8 else 512


def _reg_tail(plan) -> tuple:
    """ln_fwd_reg's (ITEMS, TPR, BLOCK, MINB, CENTER, WHOLE)."""
    return tuple(plan.arg(k) for k in ("ITEMS", "TPR", "BLOCK", "MINB", "CENTER", "WHOLE"))


def _check_fwd_reg(plan, n, dtype, clusters):
    """The forward register tier's template tail (..., BLOCK, MINB, CENTER, WHOLE): rows kept
    centered in the arithmetic type fit 128 bytes a thread, in blocks of at most 128 threads
    unless centered in place (double);
    the WHOLE slots every thread reads unchecked lie inside the row; launch bounds ask for
    1024 threads per SM (16/32-bit rows; none for double), 768 for centered ones (1024 for
    16-bit rows of a warp or less centered in 3 slots, sm_90 only), 1536 for
    16-bit rows in 16-byte vectors kept as loaded at 4 vectors a thread in a block of their own
    (sm_90, with clusters)."""
    block, minb, center, whole = (plan.arg(k) for k in ("BLOCK", "MINB", "CENTER", "WHOLE"))
    assert block == plan.block and plan.smem == 0, plan
    if center:
        assert dtype.itemsize != 4, plan  # float32 rows stay as loaded
        acc = 8 if dtype.itemsize == 8 else 4
        assert plan.items * plan.vec * acc <= 128, plan
        assert plan.block <= 128 or dtype.itemsize == 8, plan  # double: centered in place
        assert -(-n // (plan.tpr * plan.vec)) == plan.items, plan  # every slot holds a pack
    assert 0 <= whole <= plan.items and whole * plan.tpr * plan.vec <= n, plan
    assert whole == 0 or (center and dtype.itemsize == 2), plan
    lean = dtype.itemsize == 2 and plan.vec == 8 and plan.items == 4 and plan.tpr > 32
    lean = lean and clusters > 1
    if dtype.itemsize == 8:
        assert minb == 1 and plan.threads == 0, plan
    else:
        # centered 16-bit rows of a warp or less in 3 slots (FWD_CENTER_EXACT): 1024 on sm_90
        exact = center and dtype.itemsize == 2 and plan.items == 3 and plan.tpr <= 32
        assert not exact or (clusters > 1 and plan.vec == 8), plan
        threads = 1024 if exact else 768 if center else 1536 if lean else 1024
        assert minb == max(1, threads // block) and plan.threads == minb * block, plan


def _check_fwd_reg_cluster(plan, n, dtype, vec, clusters):
    """A forward row over a register cluster: the fewest blocks of at most
    FWD_REG_CLUSTER_BLOCK threads whose slices hold it; w and b (of x's dtype here) copied into
    shared memory where the SM's blocks' copies fit FWD_STAGE_WB_SM at the launch bounds' blocks
    per SM; float32 rows in blocks of FWD_LAG_BLOCK threads or more at one block an SM, holding
    two rows, the others also at fewer blocks (two or more) or over twice the blocks of half
    the threads; else read through L1."""
    c, limit, packs = plan.cluster, F.FWD_REG_CLUSTER_BLOCK, n // vec
    assert vec * dtype.itemsize == 16 and 1 < c <= clusters
    assert plan.tpr == plan.block <= limit and plan.items == F.FWD_REG_ITEMS
    assert -(-packs // c) <= plan.block * plan.items, (plan, n)  # the slices fit
    assert packs > limit * plan.items  # no one block of the limit holds the row
    assert plan.kernel.name == "ln_fwd_reg_cluster"
    assert (plan.arg("BLOCK"), plan.arg("C")) == (plan.block, c)
    minb, staged, lag = plan.arg("MINB"), plan.arg("STAGE_WB"), plan.arg("LAG")
    copies = plan.items * plan.block * vec * 2 * dtype.itemsize  # a block's slices of w and b
    bounds = max(1, 1024 // plan.block)
    per_sm = F.FWD_STAGE_WB_SM // (copies + C.STATIC_SMEM_MARGIN)
    assert plan.smem == (copies if staged else 0), plan
    split = dtype.itemsize == 4 and c == 4 and 2 * plan.block <= limit and not lag
    split = split and -(-packs // 2) <= 2 * plan.block * plan.items
    if not split:
        assert c == 2 or -(-packs // (c // 2)) > limit * plan.items, plan  # the fewest
    wide = dtype.itemsize == 4 and plan.block >= F.FWD_LAG_BLOCK
    assert lag == (wide and per_sm >= 1), plan
    if lag:  # two rows a block, one block an SM, w and b copied
        assert staged and minb == 1, plan
    elif dtype.itemsize != 4:  # 16-bit rows: staged only at the launch bounds' blocks per SM
        assert minb == bounds and staged == (per_sm >= bounds), plan
    elif split:  # float32 over two blocks whose copies fit no two blocks per SM
        assert staged and minb == min(2 * (1024 // (2 * plan.block)), per_sm) >= 2, plan
        assert 2 * (2 * copies + C.STATIC_SMEM_MARGIN) > F.FWD_STAGE_WB_SM, plan
    else:
        assert staged == (per_sm >= 2 or per_sm >= bounds), plan
        assert minb == (min(bounds, per_sm) if staged else bounds), plan
        assert staged or c > 2 or plan.block % 64, plan  # (else split over four blocks)


def test_residual_rows_past_one_block_split_over_a_cluster():
    """With a residual add, 16-bit rows past one block (x, residual and h of one dtype) take a
    register cluster that fuses the add: FWD_RES_ITEMS packs a thread in the fewest blocks of at
    most the residual's threads an SM over FWD_RES_CLUSTER_SPLIT, that many blocks an SM (launch
    bounds), no LAG; mixed dtypes, float32 rows and devices without clusters run unfused."""
    bf16, f16, f32 = ref.BFLOAT16, np.dtype(np.float16), np.dtype(np.float32)
    for dt, threads in ((bf16, F.FWD_RES_THREADS), (f16, F.FWD_RES_THREADS_FP16)):
        cap = threads // F.FWD_RES_CLUSTER_SPLIT
        for n in range(16384 + 1024, 131072 + 1, 4096):
            for rms in (False, True):
                p = F.forward_plan(n, dt, dt, dt, 8, SMEM_H100, C.MAX_CLUSTER, rms=rms,
                                   residual=(dt, dt))  # fmt: skip
                if p.tier == "stream":
                    continue
                packs, c = n // 8, p.cluster
                if -(-packs // C.MAX_CLUSTER) > cap * F.FWD_RES_ITEMS:  # no cluster holds it
                    assert p.unfused, (n, p)
                    continue
                assert not p.unfused and p.kernel.name == "ln_fwd_reg_cluster", (n, p)
                assert (p.arg("TR"), p.arg("TH"), p.arg("RMS")) == (dt, dt, rms)
                assert p.items == F.FWD_RES_ITEMS and p.block <= cap and not p.arg("LAG")
                assert -(-packs // c) <= p.block * p.items, (n, p)  # the slices fit
                assert -(-packs // (c // 2)) > cap * p.items, (n, p)  # the fewest blocks
                assert p.arg("MINB") == threads // p.block, (n, p)
        a100 = F.forward_plan(32768, dt, dt, dt, 8, SMEM_A100, 1, residual=(dt, dt))
        assert a100.unfused
        mixed = F.forward_plan(32768, dt, dt, dt, 8, SMEM_H100, C.MAX_CLUSTER, residual=(f32, f32))
        assert mixed.unfused
    wide = F.forward_plan(32768, f32, f32, f32, 4, SMEM_H100, C.MAX_CLUSTER, residual=(f32, f32))
    assert wide.unfused


def test_forward_cluster_copies_fit_the_device():
    """The register clusters' copies of w and b never ask for more shared memory than the
    device gives a block, and a device with less of it than FWD_STAGE_WB_SM (clusters with
    99 KB a block) copies no more than that an SM; H200-sized devices keep 200 KB."""
    small = 101376
    for dt in (np.dtype(np.float32), np.dtype(np.float16), ref.BFLOAT16):
        vec = 16 // dt.itemsize
        for wdt in (dt, np.dtype(np.float32)):
            for n in range(16384 + 1024, 262144 + 1, 1024 * vec // 4):
                for limit in (SMEM_H100, small):
                    p = F.forward_plan(n, dt, wdt, wdt, vec, limit, C.MAX_CLUSTER)
                    if p.cluster == 1 or p.tier != "reg" or not p.smem:
                        continue
                    minb = p.arg("MINB")
                    room = min(F.FWD_STAGE_WB_SM, limit)
                    assert minb * (p.smem + C.STATIC_SMEM_MARGIN) <= room, (n, limit, p)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("smem", [SMEM_H100, SMEM_A100])
def test_every_width_gets_a_valid_plan(dtype, smem):
    acc_words = 2 if dtype.itemsize == 8 else 1
    for vec in _vecs(dtype):
        for n in NS:
            if n % vec:
                continue
            c, short = CLUSTERS[smem], F.FWD_REG_ITEMS_SHORT
            for plan, budget in (
                (F.forward_plan(n, dtype, dtype, dtype, vec, smem, c), 64),
                (F.forward_plan(n, dtype, dtype, dtype, vec, smem, c, short), 64),
                (B.backward_plan(n, dtype, dtype, vec, smem, c), 16),
            ):
                fwd = plan.kernel.name.startswith("ln_fwd")
                # 16-bit backward rows in small blocks may take packs of half the width
                small = not fwd and plan.tier == "reg" and plan.tpr < 256
                narrow = small and dtype.itemsize == 2 and vec == 8 and plan.vec == 4
                assert plan.vec == vec or narrow, (plan, n)
                assert plan.block % 32 == 0 and 32 <= plan.block <= 1024
                assert plan.block % plan.tpr == 0 and plan.rows == plan.block // plan.tpr
                if plan.tier == "reg" and plan.cluster > 1 and not fwd:
                    _check_bwd_reg_cluster(plan, n, dtype, smem)
                elif plan.tier == "reg" and plan.cluster > 1:  # forward, a row over a cluster
                    assert fwd
                    _check_fwd_reg_cluster(plan, n, dtype, vec, CLUSTERS[smem])
                elif plan.tier == "reg":
                    assert plan.tpr * plan.items * plan.vec >= n, (plan, n)  # the row fits
                    lone = not fwd and plan.block == plan.tpr and plan.items * plan.vec > budget
                    if lone:  # backward rows past BWD_LONE_FROM threads (the sums in shared)
                        assert (plan.block, plan.items) == (512, 4) and plan.smem == 229376, plan
                        assert n > B.BWD_LONE_FROM * 16, plan
                    else:
                        assert plan.items * plan.vec * acc_words <= budget, plan  # registers
                    assert plan.items <= C.MAX_ITEMS
                    # the backward's 16-bit rows of 64 threads of 3 packs of 4 share blocks
                    grouped = not fwd and plan.tpr == 64 and dtype.itemsize == 2 and vec == 8
                    grouped = grouped and plan.items * plan.vec <= B.BWD_GROUP_VALUES
                    if grouped:
                        assert plan.block == B.BWD_GROUP_BLOCK, plan
                    else:
                        assert plan.tpr <= 32 or plan.tpr == plan.block, plan
                    assert plan.block <= _reg_block_max(fwd, dtype, vec)
                    if fwd:
                        _check_fwd_reg(plan, n, dtype, CLUSTERS[smem])
                    else:
                        # 16-bit rows in 16-byte packs: blocks of 256+ threads copy the next
                        # row's x and dy ahead, blocks of BWD_SHARED_SUMS_BLOCK+ keep the dw/db
                        # sums in shared memory (and only they go past 512 threads)
                        packs16 = dtype.itemsize == 2 and vec == 8
                        ahead = packs16 and plan.tpr >= 256
                        shared = packs16 and plan.block >= B.BWD_SHARED_SUMS_BLOCK
                        assert shared or plan.block <= 512, plan
                        # w (of x's dtype here) is staged in every such block, one copy a
                        # block, but not on sm_80 where it would leave the SM fewer blocks that
                        # copy ahead
                        staged = plan.arg("STAGE_W")
                        assert staged == packs16 or (ahead and smem == SMEM_A100), plan
                        got = tuple(plan.arg(k) for k in ("BLOCK", "AHEAD", "SHARED_SUMS"))
                        assert got == (plan.block, ahead, shared), plan
                        values = plan.block * plan.items * vec
                        pair = 2 * values * dtype.itemsize if ahead else 0
                        w_bytes = plan.tpr * plan.items * plan.vec * dtype.itemsize
                        sums = 2 * values * 4 if shared else 0
                        assert plan.smem == pair + (w_bytes if staged else 0) + sums, plan
                        assert plan.smem <= smem - C.STATIC_SMEM_MARGIN, plan
                        # a block a row that shares its SM splits the launch bounds' threads
                        # evenly where the SM's shared memory holds the blocks
                        threads = 1024 if shared else 768
                        blocks = threads // plan.block
                        held = blocks * (plan.smem + C.STATIC_SMEM_MARGIN) <= smem
                        if packs16 and plan.tpr == plan.block and blocks >= 2 and held:
                            assert threads % plan.block == 0, plan
                else:
                    assert plan.tpr == plan.block and plan.rows == 1
                    assert plan.smem <= smem - C.STATIC_SMEM_MARGIN
                if plan.tier in ("ring", "cluster") and not fwd:
                    # each block's slices of x and dy fit its ring; dw/db accumulators in
                    # registers; the cluster's slices cover the row; lag 1 where two rows fit
                    c = plan.cluster
                    assert (c == 1) == (plan.tier == "ring") and c <= CLUSTERS[smem], plan
                    slice_bytes = 2 * -(-(n // vec) // c) * vec * dtype.itemsize  # x and dy
                    assert slice_bytes <= plan.smem, (n, plan)
                    if c > 1:
                        lag = int(2 * slice_bytes <= plan.smem)
                        got = (plan.arg("BLOCK"), plan.arg("C"), plan.arg("LAG"))
                        assert got == (plan.block, c, lag), plan
                    assert plan.items * vec <= budget * 2 and plan.rows == 1
                    assert plan.items * vec * plan.block * c >= n  # the row fits
                    assert vec * dtype.itemsize >= 4, plan  # cp.async copies 4, 8 or 16 bytes
                    name = "ln_bwd_ring" if c == 1 else "ln_bwd_cluster"
                    assert plan.kernel.name == name
                elif plan.tier == "cluster":  # forward: a slice fits a block's ring, the row not
                    c = plan.cluster
                    slice_bytes = -(-(n // vec) // c) * vec * dtype.itemsize
                    assert slice_bytes <= plan.smem and plan.smem % 16 == 0, (n, plan)
                    assert n * dtype.itemsize > smem - C.STATIC_SMEM_MARGIN, (n, plan)
                    assert c == 2 or 2 * slice_bytes > plan.smem, plan  # the fewest blocks
                    assert 1 < c <= CLUSTERS[smem] and vec * dtype.itemsize >= 4, plan
                    assert plan.kernel.name == "ln_fwd_cluster"
                    assert (plan.arg("BLOCK"), plan.arg("C")) == (plan.block, c), plan
                elif plan.tier == "ring":  # one row fits the block's ring, one ring per block
                    assert n * dtype.itemsize <= plan.smem and plan.smem % 16 == 0
                    # past the register tier (every value budget, the largest block)
                    assert n > _reg_block_max(fwd, dtype, vec) * C.MAX_ITEMS * vec, (n, plan)
                    assert vec * dtype.itemsize >= 4, plan  # cp.async copies 4, 8 or 16 bytes
                    assert plan.kernel.name == "ln_fwd_ring"
                if plan.tier not in ("cluster", "reg"):
                    assert plan.cluster == 1


def _check_bwd_reg_cluster(plan, n, dtype, smem):
    """A backward row over a cluster of register blocks (sm_90): 16-bit rows in 16-byte packs
    that no block holds, over the fewest blocks (2, 4 or 8) of BWD_REG_CLUSTER_ITEMS vectors a
    thread, each of the fewest threads in steps of a warp; the slices cover the row."""
    c, vec, block = plan.cluster, plan.vec, plan.block
    items = B.BWD_REG_CLUSTER_ITEMS
    assert dtype.itemsize == 2 and vec == 8 and c in (2, 4, 8) and c <= CLUSTERS[smem], plan
    assert smem == SMEM_H100
    assert plan.tpr == block and plan.rows == 1 and plan.items == items
    assert B.BWD_REG_CLUSTER_LEAST <= block <= B.BWD_REG_CLUSTER_BLOCK, plan
    slots = block * items * vec
    assert n <= c * slots, plan  # the slices cover the row (odd widths may leave the last empty)
    assert n > B.BWD_SHARED_SUMS_BLOCK_MAX * B.BWD_REG_VALUES  # no block holds it
    widest = B.BWD_REG_CLUSTER_BLOCK * items * vec
    assert c == 2 or n > (c // 2) * widest, plan  # the fewest blocks
    assert block == B.BWD_REG_CLUSTER_LEAST or n > c * (block - 32) * items * vec, plan
    want = kernel(
        "ln_bwd_reg_cluster",
        T=dtype,
        RMS=False,
        TW=dtype,
        TB=None,
        VEC=vec,
        ITEMS=items,
        BLOCK=block,
        C=c,
        STAGE_W=True,
    )  # w of x's dtype: staged
    assert plan.kernel == want, plan
    # the next row's x and dy, the dw/db sums (float32) and w
    assert plan.smem == 3 * slots * dtype.itemsize + 2 * slots * 4, plan


def test_small_backward_blocks_fill_their_slots():
    """16-bit backward rows whose register block has under 256 threads: rows of up to a warp in
    a power of two of threads (several rows a block of 128), wider ones in steps of a warp
    (N = 520-768, 64 threads, four rows a block, others a block each); no thread slot empty in
    every row group, and packs of 8 bytes where they leave fewer element slots empty than
    16-byte packs."""
    cdiv = C.cdiv
    for dtype in (d for d in DTYPES if d.itemsize == 2):
        shapes = {}
        for n in range(8, 1544, 8):
            plan = B.backward_plan(n, dtype, dtype, 8, SMEM_H100, CLUSTERS[SMEM_H100])
            assert plan.tier == "reg" and plan.tpr < 256 and plan.vec in (4, 8), (n, plan)
            packs = n // plan.vec
            assert plan.items == cdiv(packs, plan.tpr), (n, plan)  # none wholly empty
            assert plan.items * plan.vec <= 16, (n, plan)
            assert plan.smem == plan.tpr * plan.items * plan.vec * dtype.itemsize, plan  # w
            empty = plan.tpr * plan.items * plan.vec - n
            # 16-byte packs, 2 a thread: the threads of the row
            if n <= 512:
                assert plan.block == 128 and plan.tpr <= 32 and 32 % plan.tpr == 0, (n, plan)
                tpr16 = min(32, max(4, 1 << (cdiv(n // 8, 2) - 1).bit_length()))
            else:  # rows of 64 threads of 3 packs of 4 in blocks of 4, others a block each
                assert plan.tpr % 32 == 0, (n, plan)
                grouped = plan.tpr == 64 and plan.items * plan.vec <= 12
                assert plan.block == (256 if grouped else plan.tpr), (n, plan)
                assert grouped == (520 <= n <= 768), (n, plan)
                tpr16 = cdiv(cdiv(n // 8, 2), 32) * 32
            empty16 = tpr16 * cdiv(n // 8, tpr16) * 8 - n
            assert empty <= empty16 and (plan.vec == 8) == (empty == empty16), (n, plan)
            shapes[n] = (plan.vec, plan.items, plan.tpr)
        # the measured widths (backward._small_block); 512, 1024 as before
        assert shapes[384] == (4, 3, 32) and shapes[512] == (8, 2, 32)
        assert shapes[768] == (4, 3, 64) and shapes[1024] == (8, 2, 64)
        assert shapes[1280] == shapes[1536] == (8, 2, 96)


def test_short_backward_launches_group_more_rows():
    """Rows of 2 packs of 8 in 64 or 128 threads share blocks of BWD_GROUP_BLOCK only where the
    launch is short (its blocks of BWD_MIN_STEPS groups of rows would not fill the resident
    blocks); rows of 3 packs of 4 always, wider and narrower rows never."""
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    cases = ((768, 256, 256), (1024, 64, 256), (2048, 128, 256), (1152, 96, 96), (4096, 256, 256))
    for n, long_block, short_block in cases + ((512, 128, 128),):
        plans = [B.backward_plan(n, bf16, bf16, 8, SMEM_H100, 8, s) for s in (False, True)]
        assert [p.block for p in plans] == [long_block, short_block], (n, plans)
        assert all(p.rows == p.block // p.tpr for p in plans)
    plan = B.backward_plan(1024, bf16, bf16, 8, SMEM_H100, 8)
    assert B.backward_short(8 * 1584 - 1, plan, 1584)
    assert not B.backward_short(8 * 1584, plan, 1584)


def test_tiers_by_width():
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    f32 = np.dtype(np.float32)
    assert F.forward_plan(1024, bf16, bf16, bf16, 8, SMEM_H100).tpr == 32  # centered
    assert F.forward_plan(4096, bf16, bf16, bf16, 8, SMEM_H100).tier == "reg"
    # 8 vectors a thread, in blocks of up to 1024 threads (without clusters; with them, 16-bit
    # rows of 6K-16K elements may keep 4: test_lean_16bit_rows)
    for n, dt, vec, block, items in (
        (8192, bf16, 8, 128, 8),
        (12288, bf16, 8, 192, 8),
        (32768, bf16, 8, 512, 8),
        (65536, bf16, 8, 1024, 8),
        (16384, f32, 4, 512, 8),
        (32768, f32, 4, 1024, 8),
    ):
        p = F.forward_plan(n, dt, dt, dt, vec, SMEM_H100)
        assert (p.tier, p.block, p.items, p.cluster) == ("reg", block, items, 1), (n, dt, p)
    # on sm_90, rows of 16-byte vectors past 512 threads split over a cluster of blocks of at
    # most 512 (the fewest blocks), which copy w and b into shared memory where the SM's
    # blocks' copies fit 200 KB; float32 rows at two blocks per SM instead of three (20480), or
    # in blocks of 384 threads or more at one an SM, two rows a block (32768, 65536)
    h100 = C.MAX_CLUSTER
    for n, dt, vec, cluster, block, staged, lag in (
        (49152, bf16, 8, 2, 384, 98304, False),
        (65536, bf16, 8, 2, 512, 0, False),
        (20480, f32, 4, 2, 320, 81920, False),
        (32768, f32, 4, 2, 512, 131072, True),
        (40000, f32, 4, 4, 320, 81920, False),
        (65536, f32, 4, 4, 512, 131072, True),
        (131072, bf16, 8, 4, 512, 0, False),
        (262144, bf16, 8, 8, 512, 0, False),
    ):
        p = F.forward_plan(n, dt, dt, dt, vec, SMEM_H100, h100)
        got = (p.tier, p.cluster, p.block, p.items, p.smem, p.arg("LAG"))
        assert got == ("reg", cluster, block, 8, staged, lag), (n, dt, p)
    assert F.forward_plan(32768, bf16, bf16, bf16, 8, SMEM_H100, h100).cluster == 1
    # wider rows through the ring kernel: blocks of 256 threads while a row fits a third of the
    # shared memory, else of 512; each ring holds one row
    f64 = np.dtype(np.float64)
    for n, dt, vec, block in (
        (9216, f64, 2, 256),
        (16384, f64, 2, 512),
        (65544, bf16, 8, 512),  # without clusters
        (36864, f32, 4, 512),
        (16400, bf16, 2, 256),  # narrow vectors: no register clusters
    ):
        p = F.forward_plan(n, dt, dt, dt, vec, SMEM_H100, h100 if vec == 2 else 1)
        assert (p.tier, p.block, p.smem) == ("ring", block, n * dt.itemsize), (n, dt, p)
    # rows too wide for one block's ring and not taken by the register clusters (narrower
    # vectors, float64, past 8 blocks of registers): split over the fewest blocks of a cluster
    # whose slices fit rings of a third of the shared memory (sm_90)
    for n, dt, vec, cluster in (
        (65536, f32, 2, 4),
        (131076, bf16, 4, 4),
        (270000, bf16, 8, 8),
        (32768, f64, 2, 4),
    ):
        p = F.forward_plan(n, dt, dt, dt, vec, SMEM_H100, h100)
        assert (p.tier, p.cluster, p.block) == ("cluster", cluster, 256), (n, dt, p)
    # backward: 16-bit rows in 16-byte packs stay in registers up to 16384 (1024 threads, the
    # dw/db sums in shared memory), float32 rows up to 8192; past the register tier x and dy
    # are staged in a ring with dw/db in registers up to 16384; wider rows split over a
    # cluster of such blocks (sm_90), else one block per row (x and dy staged or re-read)
    h100 = C.MAX_CLUSTER
    assert B.backward_plan(8192, bf16, bf16, 8, SMEM_H100, h100).tier == "reg"
    assert B.backward_plan(8192, f32, f32, 4, SMEM_H100, h100).tier == "reg"
    for n, dt, vec, tier, block in (
        (16384, bf16, 4, "ring", 512),
        (16384, f32, 4, "ring", 512),
    ):
        p = B.backward_plan(n, dt, dt, vec, SMEM_H100, h100)
        assert (p.tier, p.block, p.items * vec * p.block) == (tier, block, n), (n, dt, p)
    # 16-bit rows whose block at 2 vectors a thread would pass 640 threads run 512 threads of 4
    # vectors (the sums in shared memory), where those fit the SM (not sm_80's 163 KB)
    for n, smem, tier, block, items in (
        (10240, SMEM_H100, "reg", 640, 2),
        (10248, SMEM_H100, "reg", 512, 4),
        (11264, SMEM_H100, "reg", 512, 4),
        (12288, SMEM_H100, "reg", 512, 4),
        (16384, SMEM_H100, "reg", 512, 4),
        (12288, SMEM_A100, "reg", 768, 2),
        (16384, SMEM_A100, "ring", 512, 4),
    ):
        p = B.backward_plan(n, bf16, bf16, 8, smem, h100)
        assert (p.tier, p.block, p.items) == (tier, block, items), (n, smem, p)
        if tier == "reg":
            staged = smem == SMEM_H100  # sm_80: w does not fit beside them
            got = tuple(p.arg(k) for k in ("ITEMS", "TPR", "BLOCK", "AHEAD", "SHARED_SUMS"))
            assert got + (p.arg("STAGE_W"),) == (items, block, block, True, True, staged), p
    # 16-bit rows in 16-byte packs in blocks that share an SM take the size that splits its
    # threads evenly (768 with the sums in registers, 1024 in shared memory): 4160-5120 in
    # blocks of 384, not 320; 6145-7168 in 512, not 448 (where the SM holds two of them)
    for n, smem, block, shared in (
        (4096, SMEM_H100, 256, False),
        (4160, SMEM_H100, 384, False),
        (5120, SMEM_H100, 384, False),
        (6144, SMEM_H100, 384, False),
        (7168, SMEM_H100, 512, True),
        (7168, SMEM_A100, 448, True),  # two blocks of 512 would not fit the SM
        (8192, SMEM_H100, 512, True),
        (10240, SMEM_H100, 640, True),  # a lone block keeps its size
    ):
        p = B.backward_plan(n, bf16, bf16, 8, smem, h100)
        assert (p.tier, p.tpr, p.block, p.items) == ("reg", block, block, 2), (n, p)
        got = tuple(p.arg(k) for k in ("TPR", "BLOCK", "AHEAD", "SHARED_SUMS", "STAGE_W"))
        assert got == (block, block, True, shared, True), (n, p)  # (w staged)
    # on sm_90, such 16-bit rows past one block split over the fewest blocks (2, 4 or 8) of at
    # most 256 threads of 4 vectors, in steps of a warp (register clusters, two rows a block);
    # rows one block holds stay in it
    for n, cluster, block in (
        (16392, 4, 160),
        (24576, 4, 192),
        (28672, 4, 224),
        (32768, 4, 256),
        (40960, 8, 160),
        (49152, 8, 192),
        (65536, 8, 256),
    ):
        p = B.backward_plan(n, bf16, bf16, 8, SMEM_H100, h100)
        assert (p.tier, p.cluster, p.block, p.items) == ("reg", cluster, block, 4), (n, p)
        got = tuple(p.arg(k) for k in ("ITEMS", "BLOCK", "C", "STAGE_W"))
        assert got == (4, block, cluster, True), (n, p)  # (w staged)
    for n, dt, vec, cluster in (
        (98304, bf16, 8, 8),
        (32768, bf16, 4, 2),
        (32768, f32, 4, 2),
        (131072, bf16, 8, 8),
    ):
        p = B.backward_plan(n, dt, dt, vec, SMEM_H100, h100)
        assert (p.tier, p.cluster) == ("cluster", cluster), (n, dt, p)
        assert p.items * vec * p.block * cluster >= n, (n, dt, p)
    assert B.backward_plan(32768, bf16, bf16, 8, SMEM_H100).tier == "row"  # no clusters
    assert B.backward_plan(262144, bf16, bf16, 8, SMEM_H100, h100).tier == "row"
    # odd widths of 16-bit elements (2-byte accesses, which cp.async cannot copy) stay in the
    # row tier, staged in shared memory
    staged = F.forward_plan(65537, bf16, bf16, bf16, 1, SMEM_H100)
    assert staged.tier == "row" and staged.smem == 131088
    huge = F.forward_plan(10**6, f32, f32, f32, 4, SMEM_H100)
    assert huge.tier == "row" and huge.smem == 0  # re-read: a slower path, not a wrong one
    assert staged.arg("STAGE") and not huge.arg("STAGE")


def test_short_launches_keep_fewer_vectors():
    """8 vectors a forward thread where the launch has FWD_SHORT_WAVES waves of 1024 threads on
    every SM, else 4, taken where one block of up to 512 threads still holds the row."""
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    assert F.forward_items(2**27 // 1024, 1024, 8, 132) == 8
    assert F.forward_items(4096, 1024, 8, 132) == 4
    m = F.FWD_SHORT_WAVES * 132 * 1024 // 16  # 16 threads a row at 8 vectors
    assert F.forward_items(m, 1024, 8, 132) == 8
    assert F.forward_items(m - 1, 1024, 8, 132) == 4
    assert F.forward_items(m - 1, 1024, 8, 66) == 8  # fewer SMs fill sooner
    for n, items, block in ((1024, 4, 128), (16384, 4, 512), (32768, 8, 512)):
        p = F.forward_plan(n, bf16, bf16, bf16, 8, SMEM_H100, C.MAX_CLUSTER, 4)
        assert (p.tier, p.items, p.block, p.cluster) == ("reg", items, block, 1), (n, p)


def test_residual_rows_stream_over_1024_threads_at_32768():
    """With a residual add (x, residual and h of one 16-bit dtype), N = 32768 streams over 1024
    threads of 4 packs (FWD_STREAM_RES_SHAPES: 2048 threads an SM, two blocks) where the
    stream tier is taken; LayerNorm and RMSNorm alone keep the register rows, and the rows
    around it, mixed dtypes and launches that do not stream keep their plans."""
    bf16, f16, f32 = ref.BFLOAT16, np.dtype(np.float16), np.dtype(np.float32)
    h100 = C.MAX_CLUSTER
    for dt in (bf16, f16):
        for rms in (False, True):
            p = F.forward_plan(32768, dt, dt, dt, 8, SMEM_H100, h100, stream=True, rms=rms,
                               residual=(dt, dt))  # fmt: skip
            assert (p.tier, p.tpr, p.block, p.items, p.threads) == ("stream", 1024, 1024, 4, 2048)
            assert (p.arg("TR"), p.arg("TH"), p.arg("RMS"), p.arg("MINB")) == (dt, dt, rms, 2)
            alone = F.forward_plan(32768, dt, dt, dt, 8, SMEM_H100, h100, stream=True, rms=rms)
            assert alone.tier == "reg", alone
            for n in (31744, 33792, 65536):
                q = F.forward_plan(n, dt, dt, dt, 8, SMEM_H100, h100, stream=True, rms=rms,
                                   residual=(dt, dt))  # fmt: skip
                assert q.tier != "stream", (n, q)
            q = F.forward_plan(32768, dt, dt, dt, 8, SMEM_H100, h100, rms=rms, residual=(dt, dt))
            assert q.kernel.name == "ln_fwd_reg_cluster", q  # no streaming asked
        mixed = F.forward_plan(32768, dt, dt, dt, 8, SMEM_H100, h100, stream=True,
                               residual=(dt, f32))  # fmt: skip
        assert mixed.tier != "stream", mixed
    args = (32768, bf16, bf16, bf16, 8, SMEM_H100, h100, 132)
    res = dict(residual=(bf16, bf16))
    assert F.forward_launch_plan(4096, *args, 4.8e12 / 132, **res).tier == "stream"  # H200
    assert F.forward_launch_plan(4096, *args, 3.35e12 / 132, **res).tier == "reg"  # H100 SXM


def test_stream_16bit_rows():
    """On sm_90 with fast DRAM, long launches of 16-bit rows in 16-byte vectors with 16-bit w
    and b stream: rows of up to 512 packs two packs a thread in the fewest warps where they fill
    them (a warp: eight rows a block; else a block a row), or in 64 threads filling 7/8 or more
    (partial), wider rows where their packs split evenly over 512 threads of 2-4, 256 of 3,
    320 of 2-4, 448 of 4 or 640 of 4 (a block per row, up to 2048 threads an SM), w and b
    present or not as compile-time flags (rows of 64-128 threads of two packs with pass 2 a
    loop; w and b through coherent loads where x, w or b is float16), and past those any row whose
    packs split evenly over 256-640 threads (a multiple of 32) at 3 or 4 packs, or over 256-384
    at 2; other widths, dtypes, devices and launches of more rows than a grid holds keep their
    tiers, and short launches too where a register plan fits one wave of resident blocks."""
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    fp16 = np.dtype(np.float16)
    f32 = np.dtype(np.float32)
    h100 = C.MAX_CLUSTER
    shapes = {n: (n // 16, 2, False) for n in range(512, 4097, 512)}  # threads a row, packs
    shapes.update({n: (64, 2, True) for n in range(896, 1024, 8)})  # 112-127 packs of 128
    # wider rows, (threads, packs) a block a row: 8192 from FWD_STREAM_SHAPES; the rest
    # FWD_STREAM_EVEN's, 3 or 4 packs over 256-640 threads, 2 over 256-384
    wide = {5120: (320, 2), 6144: (256, 3), 7680: (320, 3), 8192: (512, 2), 10240: (320, 4)}
    wide.update({12288: (512, 3), 14336: (448, 4), 16384: (512, 4), 20480: (640, 4)})
    wide.update({4608: (288, 2), 5632: (352, 2), 6912: (288, 3), 8448: (352, 3)})
    wide.update({9216: (384, 3), 9984: (416, 3), 10752: (448, 3), 11264: (352, 4)})
    wide.update({11520: (480, 3), 13056: (544, 3), 13312: (416, 4), 13824: (576, 3)})
    wide.update({14592: (608, 3), 15360: (640, 3), 17408: (544, 4), 18432: (576, 4)})
    wide.update({19456: (608, 4)})
    shapes.update({n: (tpr, steps, False) for n, (tpr, steps) in wide.items()})
    for n in range(8, 65537, 8):
        for x, w, b in (
            (bf16, bf16, bf16),
            (fp16, fp16, fp16),
            (fp16, bf16, fp16),
            (bf16, fp16, bf16),
        ):
            p = F.forward_plan(n, x, w, b, 8, SMEM_H100, h100, stream=True)
            if n not in shapes:
                assert p.tier != "stream", (n, p)
                continue
            assert F.forward_plan(n, x, w, b, 8, SMEM_H100, h100).tier != "stream"
            tpr, steps, partial = shapes[n]
            block = 256 if tpr == 32 else tpr
            minb = 2048 // block  # blocks an SM: 2048 threads or the most under it
            got = (p.tier, p.block, p.tpr, p.items, p.rows, p.threads)
            assert got == ("stream", block, tpr, steps, block // tpr, minb * block), (n, p)
            roll = n in (1024, 1536, 2048)  # pass 2 a loop
            coherent = fp16 in (x, w, b)  # w and b through ld.global
            want = (False, x, w, b, 0, 0, 0, 8, tpr, block, steps, minb, partial, roll, coherent)
            assert p.kernel.args[3:] == want and p.arg("TR") is None, p
            assert F.forward_grid(70001, p, 0) == -(-70001 // (block // tpr))
            for affine in ((True, False), (False, True), (False, False)):
                q = F.forward_plan(n, x, w, b, 8, SMEM_H100, h100, stream=True, affine=affine)
                wb = (w if affine[0] else None, b if affine[1] else None)  # void: not given
                assert q.tier == "stream" and q.kernel.args == p.kernel.args[:5] + wb + want[4:]
    for args in (
        (8192, bf16, f32, f32, 8, SMEM_H100, h100),  # float32 w and b
        (8192, f32, f32, f32, 4, SMEM_H100, h100),  # float32 rows
        (8192, bf16, bf16, bf16, 4, SMEM_H100, h100),  # 8-byte vectors
        (8192, bf16, bf16, bf16, 8, SMEM_H100, 1),  # no clusters (sm_80)
        (8192, bf16, bf16, bf16, 8, SMEM_H100, h100, F.FWD_REG_ITEMS_SHORT),
        (8192, bf16, bf16, bf16, 8, SMEM_H100, h100, F.FWD_REG_ITEMS, True),  # one wave
    ):
        assert F.forward_plan(*args, stream=True).tier == "reg", args
    # what a launch takes: long ones on fast DRAM (H200: 37 GB/s an SM; H100 SXM: 25) stream,
    # and short ones (fewer than FWD_SHORT_WAVES waves) where no register plan fits one wave
    args = (8192, bf16, bf16, bf16, 8, SMEM_H100, h100, 132)
    h200 = F.forward_launch_plan(16384, *args, 4.8e12 / 132)
    assert h200.tier == "stream" and F.forward_waves(16384, h200, 132) == 0.0, h200
    assert F.forward_launch_plan(16384, *args, 3.35e12 / 132).tier == "reg"
    assert F.forward_launch_plan(16384, *args).tier == "reg"  # DRAM speed not reported
    for m, n, tier in (
        (4096, 8192, "stream"),  # short: 4096 blocks of 256 threads, 792 resident
        (1024, 8192, "stream"),
        (512, 16384, "stream"),  # 512 blocks of 512 threads, 396 resident
        (16384, 1024, "stream"),
        (16384, 512, "stream"),
        (1151, 8192, "stream"),
        (396, 16384, "reg"),  # one wave
        (4096, 1024, "reg"),  # one wave at 1024 threads an SM (forward_launch_plan)
        (4096, 512, "reg"),  # one wave at 768
        (2048, 2048, "reg"),
        (1024, 4096, "reg"),
        (37, 4096, "reg"),
        (16384, 768, "reg"),  # no stream shape
    ):
        short = F.forward_launch_plan(m, n, *args[1:], 4.8e12 / 132)
        assert F.forward_items(m, n, 8, 132) == F.FWD_REG_ITEMS_SHORT, (m, n)
        assert short.tier == tier, (m, n, short)
        if tier == "stream":
            assert short == F.forward_plan(n, *args[1:7], stream=True), (m, n)
            slow = F.forward_launch_plan(m, n, *args[1:], 3.35e12 / 132)  # H100
            assert slow.tier == "reg" and F.forward_waves(m, slow, 132) > 1, (m, n)
    bare = F.forward_launch_plan(16384, *args, 4.8e12 / 132, (False, True))
    assert bare.tier == "stream" and (bare.arg("TW"), bare.arg("TB")) == (None, bf16)
    over = C.MAX_GRID + 1  # a block per row: more rows than a grid's blocks do not stream
    assert F.forward_launch_plan(over, *args, 4.8e12 / 132).tier == "reg"


def test_lean_16bit_rows():
    """On sm_90, 16-bit rows in 16-byte vectors (w and b 16-bit too) of FWD_LEAN_FROM elements
    and up keep 4 vectors a thread where that block splits FWD_LEAN_THREADS evenly (192, 256,
    384 or 512 threads), else 8; rows kept at 4 vectors in a block of their own, in any launch,
    ask for 1536 threads an SM."""
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    f32 = np.dtype(np.float32)
    h100 = C.MAX_CLUSTER
    for n, block, items, minb in (
        (4608, 128, 8, 8),  # narrower than FWD_LEAN_FROM
        (6144, 192, 4, 8),
        (7168, 256, 4, 6),
        (8192, 256, 4, 6),
        (9216, 192, 8, 5),  # 320 threads at 4 vectors
        (12288, 384, 4, 4),
        (13312, 256, 8, 4),  # 448 threads at 4 vectors
        (16384, 512, 4, 3),
        (16392, 320, 8, 3),  # 4 vectors would take 576 threads
    ):
        for items_asked in (F.FWD_REG_ITEMS, F.FWD_REG_ITEMS_SHORT):
            p = F.forward_plan(n, bf16, bf16, bf16, 8, SMEM_H100, h100, items_asked)
            if items_asked == F.FWD_REG_ITEMS_SHORT and items == 8 and n < 16392:
                # short launches: 4 vectors, and 1536 threads an SM for a block of its own
                b4 = -(-n // 32 // 64) * 64
                assert _reg_tail(p) == (4, b4, b4, 1536 // b4, False, 0), (n, p)
                continue
            tail = (items, block, block, minb, False, 0)
            assert p.tier == "reg" and _reg_tail(p) == tail, (n, items_asked, p)
    # float32 w and b, or float32 rows: 8 vectors and 1024 threads an SM
    p = F.forward_plan(16384, bf16, f32, f32, 8, SMEM_H100, h100)
    assert _reg_tail(p) == (8, 256, 256, 4, False, 0), p
    p = F.forward_plan(8192, f32, f32, f32, 4, SMEM_H100, h100)
    assert _reg_tail(p) == (8, 256, 256, 4, False, 0), p
    # rows of up to a warp at 4 vectors keep 1024 (several rows a block)...
    p = F.forward_plan(640, bf16, bf16, bf16, 8, SMEM_H100, h100, 4)
    assert _reg_tail(p) == (4, 32, 128, 8, False, 0), p
    # ...but where 3 fill the row's slots, centered in those 3 at 1024 threads an SM
    # (FWD_CENTER_EXACT), in short and long launches, with 16-bit w and b on sm_90
    for n, tpr in ((192, 8), (384, 16), (768, 32)):
        for items in (F.FWD_REG_ITEMS_SHORT, F.FWD_REG_ITEMS):
            p = F.forward_plan(n, bf16, bf16, bf16, 8, SMEM_H100, h100, items)
            assert _reg_tail(p) == (3, tpr, 128, 8, True, 3), p
            p = F.forward_plan(n, bf16, f32, f32, 8, SMEM_H100, h100, items)  # as loaded
            assert _reg_tail(p) == (items, tpr * 4 // items, 128, 8, False, 0), p
            p = F.forward_plan(n, bf16, bf16, bf16, 8, SMEM_A100, 1, items)  # sm_80
            assert _reg_tail(p) == (items, tpr * 4 // items, 128, 8, False, 0), p
    p = F.forward_plan(768, f32, f32, f32, 4, SMEM_H100, h100, 4)  # float32: as loaded
    assert _reg_tail(p) == (4, 64, 64, 16, False, 0), p
    # devices without clusters (sm_80) keep 8 vectors and 1024 threads
    p = F.forward_plan(16384, bf16, bf16, bf16, 8, SMEM_H100, 1)
    assert _reg_tail(p) == (8, 256, 256, 4, False, 0), p
    p = F.forward_plan(16384, bf16, bf16, bf16, 8, SMEM_A100, 1, 4)
    assert _reg_tail(p) == (4, 512, 512, 2, False, 0), p


def test_short_launches_fill_one_wave():
    """On sm_90 a short forward launch takes, of its plan, the centered rows at 1024 threads an
    SM and rows of 8 vectors, the plan whose grid fills one wave of resident blocks most, where
    it fills more than the first plan's waves do on average."""
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    f64 = np.dtype(np.float64)
    h100 = C.MAX_CLUSTER

    def plan(m, n, clusters=h100, dt=bf16):
        vec = 16 // dt.itemsize
        return F.forward_launch_plan(m, n, dt, dt, dt, vec, SMEM_H100, clusters, 132)

    for m, n, items, tpr, threads in (
        (3000, 1024, 4, 32, 768),  # one wave at 768 threads already
        (3168, 1024, 4, 32, 768),
        (3169, 1024, 4, 32, 1024),  # 793 blocks of 4 rows: one wave at 1024, not at 768
        (4096, 1024, 4, 32, 1024),
        (4224, 1024, 4, 32, 1024),
        (4225, 1024, 4, 32, 768),  # 8 vectors would fill half a wave, 768 a third of two
        (4400, 1024, 4, 32, 768),
        (2048, 2048, 4, 64, 1024),
        (4096, 2048, 4, 64, 768),  # centered at 8 vectors too: 2.6 waves at 768
        (8192, 512, 4, 16, 1024),
        (16384, 512, 4, 16, 768),
        (4096, 1536, 8, 32, 1024),  # kept as loaded: 8 vectors, 1024 blocks of 4 rows
        (4096, 1280, 8, 32, 1024),
        (1024, 4096, 4, 128, 1024),
        (4096, 4096, 4, 128, 768),  # no plan fits one wave
        (2**27 // 1024, 1024, 4, 32, 768),  # a long launch
    ):
        p = plan(m, n)
        assert (p.items, p.tpr, p.threads) == (items, tpr, threads), (m, n, p)
        w = F.forward_waves(m, p, 132)
        assert w == -(-m // p.rows) / (132 * (threads // p.block)), (m, n, p)
    assert plan(4096, 1024, 1).threads == 768  # sm_80: no clusters, the first plan
    assert plan(4096, 1536, 1).items == 4
    assert F.forward_waves(4096, plan(4096, 1024, dt=f64), 132) == 0  # double: no bounds
    assert F.forward_waves(2048, plan(2048, 65536), 132) == 0  # a cluster


def test_vector_width():
    assert C.vector_width(2, 4096, (4096,), (0, 256)) == 8
    assert C.vector_width(2, 4096, (4097,), (0,)) == 1  # odd row stride
    assert C.vector_width(2, 4096, (4096,), (2,)) == 1  # slice starting at element 1
    assert C.vector_width(2, 1000, (1000,), (0,)) == 8
    assert C.vector_width(2, 1004, (1004,), (8,)) == 4
    assert C.vector_width(4, 769, (769,), (0,)) == 1
    assert C.vector_width(8, 1000, (1000,), (16,)) == 2
    assert C.vector_width(8, 1000, (1000,), (8,)) == 1


def test_grid_is_persistent_and_covers_rows():
    assert C.grid_size(0, 4, 528) == 1
    assert C.grid_size(37, 32, 528) == 2
    assert C.grid_size(10**9, 4, 528) == 528  # never past the resident capacity


def _bwd_plan(rows, block, cluster=1):
    return C.Plan(None, "reg", 8, 2, block // rows, block, rows, 0, cluster)


def test_backward_grid():
    """Every block walks BWD_MIN_STEPS groups of rows, at most the resident blocks; a short
    grid grows by BWD_FILL to fill the SMs, to whole blocks an SM where that shortens the most
    loaded SM's walk, then shrinks to the fewest blocks of as many steps."""
    steps = B.BWD_MIN_STEPS
    grid = B.backward_grid
    big = _bwd_plan(1, 512)
    assert grid(8192, big, 264, 132) == 264  # enough rows: the resident blocks
    assert grid(10**9, _bwd_plan(4, 128), 792, 132) == 792
    assert grid(2048, _bwd_plan(1, 256), 396, 132) == 2048 // steps  # 8 steps fill 256 threads
    assert grid(1, _bwd_plan(4, 128), 792, 132) == 1
    # 512 threads an SM where blocks keep 3 steps (N = 2048 at M = 2048: 4 blocks of 128)
    assert grid(2048, _bwd_plan(1, 128), 792, 132) == 512
    # else 256 (M = 2048, N = 1024: 1056 blocks of 64 would walk 2 steps; 528 walk 4 -> 512)
    assert grid(2048, _bwd_plan(1, 64), 1584, 132) == 512
    assert grid(512, _bwd_plan(4, 128), 792, 132) == 128  # a block per group of rows at most
    # whole blocks an SM: 144 blocks of 8 steps leave 12 SMs two; 264 walk 5, 231 as many
    assert grid(1151, big, 264, 132) == 231
    assert grid(512, big, 264, 132) == 128  # a block on every SM, 4 steps each
    for m in (1, 100, 512, 1151, 3000, 8192, 10**5):
        for rows, block, cap in ((4, 128, 792), (1, 64, 1584), (1, 512, 132), (1, 48, 2112)):
            g = grid(m, _bwd_plan(rows, block), cap, 132)
            assert 1 <= g <= cap and g <= -(-m // rows)
            walk = -(-m // (rows * g))
            if 1 < g < cap:  # short of the resident blocks: the fewest of as many steps
                assert -(-m // (rows * (g - 1))) > walk
    # clusters keep the steps rule (capacity in clusters): no growth below the capacity
    assert grid(1024, _bwd_plan(1, 512, 4), 62, 132) == 62
    assert grid(100, _bwd_plan(1, 512, 4), 62, 132) == -(-100 // steps)


def test_forward_grid_per_tier():
    """The register tier's single blocks launch a block per group of rows (at most the grid
    limit; the kernels' row loops take the rest); its clusters and the staging tiers stay
    persistent, clusters counted in blocks."""
    bf16 = [d for d in DTYPES if d.name == "bfloat16"][0]
    reg = F.forward_plan(1024, bf16, bf16, bf16, 8, SMEM_H100)  # 4 rows a block
    assert reg.tier == "reg" and reg.rows == 4
    assert F.forward_grid(1, reg, 528) == 1
    assert F.forward_grid(10**6, reg, 528) == 250000  # past the resident capacity
    assert F.forward_grid(2**40, reg, 528) == 2**31 - 1
    h100 = C.MAX_CLUSTER
    split = F.forward_plan(131072, bf16, bf16, bf16, 8, SMEM_H100, h100)
    assert split.tier == "reg" and split.cluster == 4
    assert F.forward_grid(1, split, 33) == 4  # a cluster for one row
    assert F.forward_grid(10**6, split, 33) == 4 * 33  # the resident clusters walk rows
    assert F.forward_grid(2**40, split, 33) == 4 * 33
    ring = F.forward_plan(65544, bf16, bf16, bf16, 8, SMEM_H100)
    assert ring.tier == "ring" and F.forward_grid(10**6, ring, 132) == 132
    cl = F.forward_plan(270000, bf16, bf16, bf16, 8, SMEM_H100, h100)
    assert cl.tier == "cluster" and F.forward_grid(10**6, cl, 33) == 33 * cl.cluster


@pytest.mark.parametrize("m", [1, 7, 64, 1151, 70000, 2**31 // 4096 + 1])
@pytest.mark.parametrize("n", [1, 33, 65537, 10**6])
def test_dwdb_slices_cover_rows_within_grid_limits(m, n):
    slices, per = B.dwdb_slices(m, n, 132)
    assert 1 <= slices <= 65535 and per >= 1
    assert slices * per >= m and (slices - 1) * per < m  # every row in exactly one slice


@pytest.mark.parametrize("n", [1, 33, 512, 1024, 4095, 4096, 4224, 65537])
@pytest.mark.parametrize("sms", [16, 132])
@pytest.mark.parametrize("slices", [1, 132, 255, 256, 2112])
def test_partial_reduce_covers_the_columns(n, sms, slices):
    """ln_partial_reduce: 8 columns a block (4 rows a warp load) where even 4 times the blocks
    of 32 columns leave SMs idle, else 32; blocks of (32, 8) threads under 256 partial rows,
    else (32, 32); both named in its template."""
    f16, f32 = np.dtype("float16"), np.dtype("float32")
    k, cols, y = B.reduce_kernel(n, slices, sms, f16, f32, f16)
    assert cols == (32 if 4 * -(-n // 32) > sms else 8)
    assert y == (8 if slices < 256 else 32)
    assert k == kernel("ln_partial_reduce", A=f32, TW=f32, TB=f16, Y=y, C=cols)


@pytest.mark.parametrize("d", [1, 3, 32, 256, 769, 4096, 65536, 10**6])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("max_seqlen", [None, 1, 128, 10**6])
@pytest.mark.parametrize("backward", [False, True])
def test_jagged_plan_keeps_chunks_inside_the_invariant(d, dtype, max_seqlen, backward):
    """A chunk of R rows meets at most two long sequences: R = 1, or 2 * R * D <= cap (a
    long sequence has more than cap elements); a staged sequence fits the shared memory (the
    forward: one group's ring, the rings of all groups filling the block's share)."""
    dt = ref.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    for limit in (SMEM_H100, SMEM_A100):
        p = J.jagged_plan(d, dt, 1, limit, max_seqlen, backward)
        assert p.smem <= limit - C.STATIC_SMEM_MARGIN and p.smem % 16 == 0
        if backward:
            assert p.cap * dt.itemsize * 2 <= p.smem
            room = p.smem // 2
        else:
            assert p.group in (32, p.block) and p.block % 32 == 0
            assert p.ring * dt.itemsize * (p.block // p.group) == p.smem
            assert p.cap <= p.ring
            room = p.ring * dt.itemsize
        assert p.rows >= 1 and (p.rows == 1 or 2 * p.rows * d <= p.cap)
        if max_seqlen and max_seqlen * d * dt.itemsize <= room:
            assert p.cap >= max_seqlen * d


def test_launch_config_packing_matches_the_driver_struct():
    """The launch path packs cuLaunchKernelEx's CUlaunchConfig with a struct format (one
    pack_into a call); each field must land where the ctypes mirror of cuda.h's layout, which
    the occupancy query passes to the driver, has it."""
    values = (1, 2, 3, 4, 5, 6, 7, 0x1122334455667788, 0x0123456789ABCDEF, 9)
    buf = ctypes.create_string_buffer(ctypes.sizeof(_driver._LaunchConfig))
    _driver._CONFIG.pack_into(buf, 0, *values)
    config = _driver._LaunchConfig.from_buffer(buf)
    assert list(config.grid) == [1, 2, 3] and list(config.block) == [4, 5, 6]
    assert config.smem == 7 and config.num_attrs == 9
    assert config.stream == values[7] and config.attrs == values[8]
    assert _driver._CONFIG.size <= ctypes.sizeof(_driver._LaunchConfig)


def test_gpus_before_ampere_are_refused_by_name():
    from cupyln import _launcher

    _launcher.check_arch("NVIDIA A100", 80)
    _launcher.check_arch("NVIDIA H200", 90)
    with pytest.raises(
        RuntimeError,
        match=r"needs .* 8\.0 \(Ampere\) or newer; Tesla V100 has compute "
        r"capability 7\.0",
    ):
        _launcher.check_arch("Tesla V100", 70)


def test_a_plan_constant_is_set_and_restored():
    from cupyln import _control

    old = _control.set_plan_constant("FWD_REG_ITEMS", 4)
    try:
        assert old == 8 and F.FWD_REG_ITEMS == 4
    finally:
        assert _control.set_plan_constant("FWD_REG_ITEMS", old) == 4
    assert F.FWD_REG_ITEMS == 8
    with pytest.raises(KeyError, match="no plan constant"):
        _control.set_plan_constant("forward_plan", None)


def test_a_shared_plan_constant_is_set_everywhere_it_is_bound():
    from cupyln import _control

    old = _control.set_plan_constant("ROW_BLOCK", 128)
    try:
        assert C.ROW_BLOCK == F.ROW_BLOCK == B.ROW_BLOCK == 128
        dt = np.dtype(np.float32)
        assert B.backward_plan(10**6, dt, dt, 4, SMEM_H100).block == 128
    finally:
        _control.set_plan_constant("ROW_BLOCK", old)
    assert C.ROW_BLOCK == F.ROW_BLOCK == B.ROW_BLOCK == 256


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_forward_launch_plans_hold_every_m(profile):
    """forward_launch_plans (what precompile builds) holds the plan forward_launch_plan takes
    at every M, for each profile's limits, norm and residual."""
    dev = PROFILES[profile]
    rng = np.random.default_rng(7)
    bf, f4 = next(d for d in TABLE if d.name == "bfloat16"), np.dtype(np.float32)
    for n in (64, 512, 1000, 4096, 8192, 16384, 32768, 65536, 10**6):
        for rms, residual in ((False, None), (True, None), (True, (f4, f4)), (False, (bf, bf))):
            vec = C.vector_width(4 if residual and residual[1] == f4 else 2, n)
            args = (n, bf, f4, f4, vec, dev.smem_block, dev.max_cluster)
            norm = dict(rms=rms, residual=residual, threads_sm=dev.threads_sm)
            ahead = F.forward_launch_plans(*args, dev.dram_per_sm, **norm)
            ms = {1, 2, 1023, 1024, 2048, 2**31} | set(rng.integers(1, 300000, 40).tolist())
            for m in sorted(ms):
                p = F.forward_launch_plan(m, *args, dev.sm_count, dev.dram_per_sm, **norm)
                assert p in ahead, (profile, n, rms, residual, m)


def test_profiles_hold_what_the_plans_read():
    """Every architecture the kernels are built for has a profile, and each profile's limits
    are those of its family (clusters from sm_90; 1536 threads an SM on sm_86/89/120)."""
    assert set(ARCHS) == {80, 86, 89, 90, 100, 120}
    assert {p for names in ARCHS.values() for p in names} == set(PROFILES)
    for name, p in PROFILES.items():
        assert name in ARCHS[p.arch]
        assert p.clusters == (p.arch >= 90) and p.max_cluster == (8 if p.clusters else 1)
        assert p.threads_sm == (1536 if p.arch in (86, 89, 120) else 2048)
        assert p.smem_block < p.smem_sm and p.dram_per_sm > 0
    assert unsupported("NVIDIA A100", 80) is None and unsupported("NVIDIA B200", 100) is None
    assert "Tesla V100 has compute capability 7.0" in unsupported("Tesla V100", 70)


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_plans_fit_its_limits(profile):
    """Each profile's plans, forward (every M: forward_launch_plans) and backward, every dtype,
    pack width and norm, fit that GPU's limits: blocks of whole warps up to 1024 threads, the
    launch bounds' threads (and MINB blocks of the block's threads) within its threads an SM,
    shared memory with the kernels' own within its opt-in limit, clusters only where it has
    them. (Registers: tests/test_compile.py's spill allowances at each architecture's bounds.)"""
    dev = PROFILES[profile]
    wide = {769, 1000, 32768, 65536, 65537, 262144, 10**6}
    ns = sorted(set(range(8, 17000, 56)) | set(range(1, 130)) | wide)
    for dt in DTYPES:
        for vec in _vecs(dt):
            for n in (n for n in ns if n % vec == 0):
                plans = set()
                for residual in (None, (dt, dt)):
                    for rms in (False, True):
                        plans |= F.forward_launch_plans(
                            n, dt, dt, dt, vec, dev.smem_block, dev.max_cluster, dev.dram_per_sm,
                            rms=rms, residual=residual, threads_sm=dev.threads_sm,
                        )  # fmt: skip
                for short in (False, True):
                    for rms in (False, True):
                        limits = (dev.smem_block, dev.max_cluster)
                        plans.add(B.backward_plan(n, dt, dt, vec, *limits, short=short, rms=rms))
                for p in plans:
                    assert p.block % 32 == 0 and p.block <= 1024, (profile, n, p)
                    assert p.threads <= dev.threads_sm, (profile, n, p)
                    assert p.smem + C.STATIC_SMEM_MARGIN <= dev.smem_block, (profile, n, p)
                    assert p.cluster <= dev.max_cluster, (profile, n, p)
                    if "MINB" in C.params(p.kernel.name):
                        assert p.arg("MINB") * p.block <= dev.threads_sm, (profile, n, p)
