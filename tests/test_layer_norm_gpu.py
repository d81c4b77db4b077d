"""GPU tier: forward and backward against the float64 reference (cupyln.reference).

Tolerances come from the one table, ``cupyln.reference.TOLERANCE`` (by output dtype, with the
reason there); dw/db allow atol * sqrt(M), since they are sums over M rows. Every output is
NaN-poisoned before the call (passed through ``out=``), so an element the kernels never wrote
fails the comparison. Inputs are the seeds' ``-2.3 + 0.5 * randn`` with fresh seeds per case.
"""

import contextlib
import itertools
import math

import numpy as np
import pytest

from cupyln import _launcher
from cupyln import reference as ref
from cupyln._dtypes import TABLE
from cupyln._layout import rows as _rows
from cupyln._plans.devices import PROFILES
from cupyln._problem import Problem

from .conftest import GPU_COUNT, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

if GPU_COUNT:
    import cupy

    import cupyln

DTYPES = [d.name for d in TABLE]
# Widths: 1-3 tiny, 17/127 odd sub-warp rows, 760/769/1000/1128 not powers of two (769 forces the
# scalar path), 1024/4096/8192/16384 tier edges, 8193/65537 one past them, 5120/12288 model
# widths, 12288-65536 16-bit rows of 8 vectors a thread (32768/65536 forward: blocks of 512 and,
# on sm_90, a cluster of two such blocks a row; float32 32768/65536 over 2/4 blocks),
# 4096-8192 16-bit backward rows copied ahead through shared memory, 8193 (float32) the ring
# tier, 32768/65536 the cluster tiers (every backward; the forward of float64 rows), 262144 the
# re-read tier (the 16-bit forward: a cluster of 8 blocks of registers).
NS = [1, 2, 3, 17, 64, 127, 512, 760, 769, 1000, 1024, 1128, 4096, 5120, 8192, 8193, 12288,
      16384, 32768, 65536, 65537, 262144]  # fmt: skip
# Rows: 0 (empty), 1, 37 (fewer rows than SMs), 1151 (the tutorial's), 70000 (> 65535).
MS = [0, 1, 37, 1151, 70000]
MAX_ELEMENTS = 80_000_000  # per case: x, dy, outputs and the float64 reference fit easily
SWEEP = [(m, n) for n in NS for m in MS if m * n <= MAX_ELEMENTS]

_seed = itertools.count(1000)


def fresh(shape, dtype, loc=-2.3, scale=0.5):
    return ref.sample(shape, dtype, loc=loc, scale=scale, seed=next(_seed))


_UINT = {2: "uint16", 4: "uint32", 8: "uint64"}
_NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000,
             "float64": 0x7FF8000000000000}  # fmt: skip


def poisoned(shape, dtype):
    """An output array filled with NaN (quiet-NaN bits), on the current device."""
    a = cupy.empty(shape, dtype)
    a.view(_UINT[a.itemsize])[...] = _NAN_BITS[np.dtype(dtype).name]
    return a


def run_and_check(x, w, b, dy, eps=1e-5, bias_dtype=None, rows_scale=None, dx_scale=1.0):
    """Forward and backward into poisoned outputs; compare all six results with the reference."""
    n = x.shape[-1]
    m = x.size // n
    acc = "float64" if x.dtype == np.float64 else "float32"
    lead = x.shape[:-1]
    bdt = bias_dtype or (b.dtype if b is not None else (w.dtype if w is not None else x.dtype))
    home = cupy.cuda.Device(x.data.device_id)
    with home:  # outputs live with x; the calls below run with whatever device is current
        outs = (poisoned(x.shape, x.dtype), poisoned(lead, acc), poisoned(lead, acc))
        gouts = (
            poisoned(x.shape, x.dtype),
            None if w is None else poisoned((n,), w.dtype),
            poisoned((n,), bdt),
        )
    y, mean, rstd = cupyln.forward(x, w, b, eps, out=outs)
    assert y is outs[0] and mean is outs[1] and rstd is outs[2]
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd, db_dtype=bdt, out=gouts)
    assert dx is gouts[0] and db is gouts[2] and (dw is None) == (w is None)
    with home:
        _compare(x, w, b, dy, eps, m, rows_scale, (y, mean, rstd, dx, dw, db), dx_scale)
    return y, mean, rstd, dx, dw, db


def _compare(x, w, b, dy, eps, m, rows_scale, got, dx_scale=1.0):
    y, mean, rstd, dx, dw, db = got
    yr, meanr, rstdr = ref.forward(x, w, b, eps)
    dxr, dwr, dbr = ref.backward(dy, x, w, eps, mean, rstd)  # at the saved statistics
    ar = "float64" if x.dtype == np.float64 else "float32"  # the kernels' arithmetic
    ref.assert_close(y, yr, "y", arithmetic=ar)
    ref.assert_close(mean, meanr, "mean", arithmetic=ar)
    ref.assert_close(rstd, rstdr, "rstd", arithmetic=ar)
    ref.assert_close(dx, dxr, "dx", atol_scale=dx_scale, arithmetic=ar)
    s = math.sqrt(max(m, 1)) if rows_scale is None else rows_scale
    if w is not None:
        ref.assert_close(dw, dwr, "dw", atol_scale=s, arithmetic=ar)
    ref.assert_close(db, dbr, "db", atol_scale=s, arithmetic=ar)


def inputs(shape, xdt, wdt, bdt):
    n = shape[-1]
    x = fresh(shape, xdt)
    w = None if wdt is None else fresh((n,), wdt, loc=1.0, scale=0.3)
    b = None if bdt is None else fresh((n,), bdt, loc=0.0, scale=0.3)
    dy = fresh(shape, xdt, loc=0.0, scale=1.0)
    return x, w, b, dy


def hopper_plans(x) -> bool:
    """Whether x's device, as the plans see it (under a profile, the profile's), has the
    H200's limits: the tests that pin a plan's shape were worked out for those."""
    d, h200 = _launcher.device(x.device.id), PROFILES["h200"]
    return (d.arch, d.sm_count, d.smem_block, d.clusters) == (
        h200.arch,
        h200.sm_count,
        h200.smem_block,
        h200.clusters,
    )


@contextlib.contextmanager
def forward_rules(monkeypatch, **values):
    """The forward's plan constants (cupyln._plans.forward) set to ``values`` for the block,
    its plans and cached launches cleared before and after."""
    from cupyln import _control
    from cupyln._plans import forward

    def clear():
        _control.forget_plans()

    for name, value in values.items():
        monkeypatch.setattr(forward, name, value)
    clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        clear()


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    cupy.get_default_memory_pool().free_all_blocks()


# ------------------------------------------------------------------ the sweep
@pytest.mark.parametrize("m,n", SWEEP, ids=[f"{m}x{n}" for m, n in SWEEP])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sweep(dtype, m, n):
    run_and_check(*inputs((m, n), dtype, dtype, dtype))


@pytest.mark.parametrize("n,block,items", [(7000, 512, 2), (10248, 512, 4), (15000, 512, 4)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_shared_sums_rows_with_empty_slots(dtype, n, block, items):
    """16-bit backward rows whose dw/db sums live in shared memory, with threads whose last
    slot lies past N: 7000 in blocks of 512 threads of 2 vectors (448 would leave an eighth of
    the SM's threads unused), 10248 and 15000 in 512 threads of 4 (a lone block an SM)."""
    x, w, b, dy = inputs((1151, n), dtype, dtype, dtype)
    if hopper_plans(x):  # the plan (sm_80's shared memory is smaller)
        got = cupyln.describe(x, w, b)["backward"]
        assert f"reg vec=8 items={items} tpr={block} block={block} " in got
    run_and_check(x, w, b, dy)


SHORT = [(4096, 1024, 4), (2048, 2048, 4), (1024, 4096, 4), (8192, 512, 4), (4096, 1536, 8),
         (4096, 1280, 8)]  # fmt: skip


@pytest.mark.parametrize("m,n,items", SHORT, ids=[f"{m}x{n}" for m, n, _ in SHORT])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_short_launches_fill_one_wave(dtype, m, n, items):
    """Short forward launches whose grid then fits one wave of resident blocks on sm_90: centered
    rows at 1024 threads an SM, or rows of 8 vectors a thread (as many blocks resident as the
    grid has, or more)."""
    x, w, b, dy = inputs((m, n), dtype, dtype, dtype)
    if hopper_plans(x):
        got = cupyln.describe(x, w, b)["forward"]
        block = int(got.split(" block=")[1].split()[0])
        resident = int(got.split(" resident=")[1].split()[0])
        sms = x.device.attributes["MultiProcessorCount"]
        assert f" items={items} " in got and resident == sms * (1024 // block), got
        assert -(-m // (block // int(got.split(" tpr=")[1].split()[0]))) <= resident, got
    run_and_check(x, w, b, dy)


EXACT = [(37, 768), (1024, 768), (4096, 768), (16384, 768), (8192, 384), (4096, 192)]


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("m,n", EXACT, ids=[f"{m}x{n}" for m, n in EXACT])
@pytest.mark.parametrize(
    "xdt,wdt,bdt",
    [("bfloat16",) * 3, ("float16",) * 3, ("bfloat16", "float16", None), ("float16", None, None)],
)
def test_rows_of_a_warp_centered_in_the_slots_they_fill(monkeypatch, xdt, wdt, bdt, m, n, long):
    """16-bit rows of a warp or less whose packs fill 3 vector slots a thread (N = 192, 384,
    768) are kept centered in those 3 on sm_90, at 1024 threads an SM (the register tier rounds
    slots up to 4 otherwise), in short launches and in long ones (any launch here:
    FWD_SHORT_WAVES = 0)."""
    with forward_rules(monkeypatch, **({"FWD_SHORT_WAVES": 0} if long else {})):
        x, w, b, dy = inputs((m, n), xdt, wdt, bdt)
        if hopper_plans(x):
            got = cupyln.describe(x, w, b)["forward"]
            assert got.startswith("reg ") and " items=3 " in got, got
        run_and_check(x, w, b, dy)


STREAM = [
    ("bfloat16", "bfloat16", "bfloat16"),
    ("float16", "float16", "float16"),
    ("bfloat16", "float16", None),
    ("float16", None, "bfloat16"),
    ("bfloat16", None, None),
]


@pytest.mark.parametrize(
    "n",
    [512, 904, 1000, 1016, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7680, 8192]
    + [10240, 12288, 14336, 16384, 20480]
    + [4608, 9216, 11264, 13824, 19456],  # FWD_STREAM_EVEN: 288x2, 384x3, 352x4, 576x3, 608x4
)
@pytest.mark.parametrize("xdt,wdt,bdt", STREAM, ids=["-".join(map(str, c)) for c in STREAM])
def test_forward_stream_rows(monkeypatch, xdt, wdt, bdt, n):
    """The 16-bit rows that stream in long launches on sm_90 with fast DRAM (ln_fwd_stream, a
    block per row, or eight rows of a warp a block: 37 rows leave the last block five; rows past
    some threads' last packs at N = 904-1016), taken here by any launch on any sm_90
    (FWD_SHORT_WAVES, FWD_STREAM_DRAM_PER_SM = 0), with w and b each present or not: strided
    rows, rows of a large mean (1e3, 1e4) and one of a repeated value against the float64
    reference; y written over x itself, and by the cached launch of a second call, match y
    written elsewhere, bit for bit."""
    with forward_rules(monkeypatch, FWD_SHORT_WAVES=0, FWD_STREAM_DRAM_PER_SM=0.0):
        _, w, b, dy = inputs((37, n), xdt, wdt, bdt)
        x = fresh((37, n + 64), xdt)[:, :n]  # rows at a stride of n + 64
        x[5] = fresh((n,), xdt, loc=1000.0, scale=8.0)
        x[7] = fresh((n,), xdt, loc=1e4, scale=64.0)
        x[9] = -4096.0
        if hopper_plans(x):
            assert cupyln.describe(x, w, b)["forward"].startswith("stream "), n
        y = run_and_check(x, w, b, dy)[0]
        inplace = x.copy()
        got = cupyln.forward(inplace, w, b, out=(inplace, None, None))[0]
        assert got is inplace and bool((got.view("uint16") == y.view("uint16")).all())
        dense = x.copy()
        for _ in range(2):  # the first call plans, the second takes the cached launch
            got = cupyln.forward(dense, w, b)[0]
            assert bool((got.view("uint16") == y.view("uint16")).all())


SHORT_STREAM = [(20001, 512, True), (16384, 1000, True), (1151, 8192, True), (512, 16384, True),
                (4096, 1024, False), (396, 16384, False)]  # fmt: skip


@pytest.mark.parametrize("m,n,stream", SHORT_STREAM, ids=[f"{m}x{n}" for m, n, _ in SHORT_STREAM])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_short_launches_stream_past_one_wave(monkeypatch, dtype, m, n, stream):
    """Short forward launches of 16-bit rows the stream tier takes, where no register plan fits
    one wave of resident blocks (any sm_90 here: FWD_STREAM_DRAM_PER_SM = 0), against the float64
    reference; launches that one wave holds keep the register rows."""
    with forward_rules(monkeypatch, FWD_STREAM_DRAM_PER_SM=0.0):
        x, w, b, dy = inputs((m, n), dtype, dtype, dtype)
        if hopper_plans(x):
            got = cupyln.describe(x, w, b)["forward"]
            assert got.startswith("stream " if stream else "reg "), got
        run_and_check(x, w, b, dy)


@pytest.mark.parametrize("m,n", [(640, 640), (3000, 768), (1151, 8192), (512, 16384), (37, 20480)])
def test_short_backward_grids_and_dependent_reduce(monkeypatch, m, n):
    """Short backward launches, whose grids grow to fill the SMs (backward_grid), checked against
    the float64 reference; ln_partial_reduce launched dependent on the partials' kernel (sm_90,
    driver 12.3+) gives bitwise the dw/db of a plain launch."""
    from cupyln import _control, _launcher, _runtime
    from cupyln._plans import backward

    x, w, b, dy = inputs((m, n), "bfloat16", "bfloat16", "bfloat16")
    run_and_check(x, w, b, dy)
    _, mean, rstd = cupyln.forward(x, w, b)

    def clear():
        _control.forget_plans()

    def grads(after_prior):
        monkeypatch.setattr(backward, "REDUCE_AFTER_PRIOR", after_prior)
        clear()
        got = [cupyln.backward(dy, x, w, mean, rstd) for _ in range(3)]
        vec = _launcher.vector_widths(2, n, (n,), x.data.ptr & 15)
        p = Problem(m, n, x.dtype, w.dtype, w.dtype, x_stride=n, dy_stride=n)
        launch = _launcher.backward_launch(x.data.device_id, p, vec)
        return got, launch.reduce[0]

    (dependent, red), (plain, red_plain) = grads(True), grads(False)
    sm90 = _launcher.device(x.device.id).arch >= 90 and _runtime.driver_version() >= 12030
    assert (red._ex is not None) == sm90 and red_plain._ex is None
    for got in dependent + plain:
        for a, want in zip(got, plain[0]):
            assert bool((a == want).all())
    clear()


@pytest.mark.parametrize("n,tpr,always", [(520, 64, True), (768, 64, True), (1024, 64, False),
                                           (2048, 128, False)])  # fmt: skip
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_row_groups_share_a_block(dtype, n, tpr, always):
    """16-bit backward rows of 64 or 128 threads, several a block (BWD_GROUP_BLOCK; rows
    of 2 packs of 8 only in short launches), each row group under its own barrier: row counts
    that leave a block's last groups without a row, with and without w, against the float64
    reference with NaN-poisoned outputs; the same dx, dw and db bit for bit on every call."""
    for m, wdt in ((1, dtype), (3, None), (6, "float32"), (1029, dtype), (20000, dtype)):
        x, w, b, dy = inputs((m, n), dtype, wdt, dtype)
        got = cupyln.describe(x, w, b)["backward"]
        grouped = always or m <= 1029  # (20000 rows of 1024 or 2048: not a short launch)
        assert f"tpr={tpr} block={256 if grouped else tpr} " in got, got
        first = run_and_check(x, w, b, dy)
        _, mean, rstd = cupyln.forward(x, w, b)
        for _ in range(2):
            again = cupyln.backward(dy, x, w, mean, rstd, db_dtype=b.dtype)
            for a, want in zip(again, first[3:]):
                assert (a is None) == (want is None)
                assert a is None or bool((a == want).all())


@pytest.mark.parametrize(
    "n,cluster,block", [(20480, 4, 160), (32768, 4, 256), (40960, 8, 160), (65536, 8, 256)]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_register_clusters(dtype, n, cluster, block):
    """16-bit backward rows split over a cluster of register blocks on sm_90 (elsewhere their
    own tiers), checked against the float64 reference with NaN-poisoned outputs; fewer rows
    than clusters, and clusters of odd and even numbers of rows (the blocks hold two rows at
    once) too."""
    for m in (5, 700, 701):
        x, w, b, dy = inputs((m, n), dtype, dtype, dtype)
        if hopper_plans(x):
            got = cupyln.describe(x, w, b)["backward"]
            assert f"tpr={block} block={block} " in got and got.endswith(f"cluster={cluster}")
        run_and_check(x, w, b, dy)


@pytest.mark.parametrize("n", [384, 768, 1000, 4096, 10248, 20480, 32768])
@pytest.mark.parametrize("xdt", ["bfloat16", "float16"])
@pytest.mark.parametrize("wdt", [None, "x", "other", "float32"])
def test_backward_w_staged(xdt, wdt, n):
    """16-bit backward rows whose blocks copy w into shared memory once (w of x's dtype; on
    sm_90 in blocks of several rows sharing one copy (384: 4 rows of 32 threads, 768: 4 of 64),
    a block a row (1000), blocks of 256 threads copying ahead, a lone block of 512 with the
    sums shared, register clusters), with no w, and with w of the other 16-bit dtype and of
    float32 (not staged); rows past the slots of the last threads (1000, 10248) and fewer rows
    than blocks (m = 5) too."""
    other = "float16" if xdt == "bfloat16" else "bfloat16"
    wdt = {"x": xdt, "other": other}.get(wdt, wdt)
    for m in (5, 300):
        x, w, b, dy = inputs((m, n), xdt, wdt, wdt)
        if hopper_plans(x) and wdt is not None:
            p = Problem(m, n, x.dtype, w.dtype, w.dtype, x_stride=n, dy_stride=n)
            launch = _launcher.backward_launch(x.device.id, p, 8)
            assert launch.plan.arg("STAGE_W") == (wdt == xdt), launch.plan
        run_and_check(x, w, b, dy)


# Forward rows over register clusters (sm_90) whose blocks copy w and b into shared memory or
# read them through L1 (forward._reg_cluster_plan): N, x's dtype, w's and b's, blocks a cluster,
# threads a block, staged, two rows a block. float32: at 2 blocks an SM (20480), in blocks of
# 384 threads or more two rows a block (28672, 32768, 65536); float32 x with bf16 w and b at its
# own shape (32768).
BF, FP, F32 = "bfloat16", "float16", "float32"
STAGE_WB = [(49152, BF, BF, 2, 384, True, False), (45056, FP, FP, 2, 384, True, False),
            (65536, BF, BF, 2, 512, False, False), (20480, F32, F32, 2, 320, True, False),
            (28672, F32, F32, 2, 448, True, True), (32768, F32, F32, 2, 512, True, True),
            (65536, F32, F32, 4, 512, True, True), (32768, F32, BF, 2, 512, True, True),
            (49152, BF, F32, 2, 384, False, False)]  # fmt: skip


@pytest.mark.parametrize("n,xdt,wdt,cluster,block,staged,lag", STAGE_WB)
def test_forward_register_clusters_stage_w_and_b(n, xdt, wdt, cluster, block, staged, lag):
    """Against the float64 reference with NaN-poisoned outputs: w and b both, either alone (w
    and b of x's dtype: the same plan) and neither; fewer rows than clusters (5) and rows that
    walk several times round the persistent grid, even and odd numbers of them (700, 701: the
    blocks holding two rows end on either set)."""
    present = [(wdt, wdt)] if wdt != xdt else [(wdt, wdt), (wdt, None), (None, wdt), (None, None)]
    for w_dtype, b_dtype in present:
        for m in (5, 700, 701):
            x, w, b, dy = inputs((m, n), xdt, w_dtype, b_dtype)
            if hopper_plans(x):
                got = cupyln.describe(x, w, b)["forward"]
                assert f"tpr={block} block={block} " in got, got
                assert got.endswith(f"cluster={cluster}") and (" smem=0 " not in got) == staged
                wb = [None if a is None else a.dtype for a in (w, b)]
                p = Problem(m, n, x.dtype, *wb, x_stride=n)
                plan = _launcher.forward_launch(x.device.id, p, 16 // x.itemsize)
                assert plan[1].arg("LAG") == lag, plan[1]
            run_and_check(x, w, b, dy)


# Every pairing of x, w, b dtypes (None = no w / no b) at a vector-path and a scalar-path width.
COMBOS = list(itertools.product(DTYPES, DTYPES + [None], DTYPES + [None]))


@pytest.mark.parametrize("n", [4096, 769])
@pytest.mark.parametrize("xdt,wdt,bdt", COMBOS, ids=["-".join(map(str, c)) for c in COMBOS])
def test_mixed_dtypes(xdt, wdt, bdt, n):
    run_and_check(*inputs((37, n), xdt, wdt, bdt))


@pytest.mark.parametrize("n", [3, 1000, 65537])
def test_rank3_and_rank1(n):
    run_and_check(*inputs((3, 5, n), "bfloat16", "float32", "float32"))
    run_and_check(*inputs((n,), "float32", "float32", "float32"))


def test_backward_without_w_returns_db_only():
    x, _, _, dy = inputs((64, 512), "float16", None, None)
    _, mean, rstd = cupyln.forward(x)
    dx, dw, db = cupyln.backward(dy, x, None, mean, rstd)
    assert dw is None and db.dtype == x.dtype
    ref.assert_close(db, ref.backward(dy, x)[2], "db", atol_scale=8)


def test_layer_norm_returns_y():
    x, w, b, _ = inputs((5, 300), "float32", "float32", "float32")
    ref.assert_close(cupyln.layer_norm(x, w, b), ref.forward(x, w, b)[0], "y")


def test_internal_allocation_path():
    x, w, b, dy = inputs((70, 2048), "bfloat16", "bfloat16", "bfloat16")
    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    ref.assert_close(y, ref.forward(x, w, b)[0], "y")
    dxr, dwr, dbr = ref.backward(dy, x, w)
    ref.assert_close(dx, dxr, "dx")
    ref.assert_close(dw, dwr, "dw", atol_scale=9)
    ref.assert_close(db, dbr, "db", atol_scale=9)


@pytest.mark.parametrize("n", [1, 64])
def test_many_rows_past_grid_y_limit(n):
    # 300000 rows: far past 65535 (a grid.y limit some peers hit) and many rows per block.
    x, w, b, dy = inputs((300_000, n), "float32", "float32", "float32")
    # A row of one element has dx = 0 exactly, but rstd = 1/sqrt(eps) = 316 times the rounding
    # of g = dy * w (the kernels' float32 product, fused into the subtraction) can come out:
    # allow that much absolute error, |g| * 2^-23 * rstd, where it exceeds the table's atol.
    scale = 1.0
    if n == 1:
        g = float(cupy.abs(dy.astype("float64") * w.astype("float64")).max())
        scale = max(1.0, g * 2.0**-23 * 1e-5**-0.5 / ref.TOLERANCE["float32"][0])
    run_and_check(x, w, b, dy, dx_scale=scale)


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("n", [64, 769, 4096, 65536])
def test_strided_rows_without_copy(n):
    base = fresh((50, n + 24), "bfloat16")
    x = base[:, 8 : 8 + n]  # row stride n + 24, starts 16 bytes in
    dbase = fresh((50, n + 40), "bfloat16", loc=0.0, scale=1.0)
    dy = dbase[:, :n]
    w = fresh((n,), "bfloat16", loc=1.0, scale=0.3)
    b = fresh((n,), "bfloat16", loc=0.0, scale=0.3)
    assert not x.flags.c_contiguous
    assert _rows(x)[0] is x and _rows(dy)[0] is dy  # read in place, not copied
    run_and_check(x, w, b, dy)


@pytest.mark.parametrize("n", [8, 1000, 4096])
def test_misaligned_rows_take_the_scalar_path(n):
    flat = fresh((40 * n + 1,), "float16")
    x = flat[1:].reshape(40, n)  # starts at element 1: not 16-byte aligned
    assert x.data.ptr % 16 != 0
    w = fresh((n + 1,), "float32", loc=1.0, scale=0.3)[1:]  # misaligned weight too
    dy = fresh((40, n), "float16", loc=0.0, scale=1.0)
    run_and_check(x, w, None, dy)


def test_other_layouts_are_copied():
    t = fresh((256, 48), "float32")
    x = t.T  # last dimension not contiguous
    run_and_check(x, None, None, fresh(x.shape, "float32", 0.0, 1.0))
    x3 = fresh((4, 6, 130), "float32")[:, :3, :]  # leading dims not collapsible into rows
    run_and_check(x3, None, fresh((130,), "float32"), fresh(x3.shape, "float32", 0.0, 1.0))
    xr = fresh((20, 64), "float32")[::-1]  # negative row stride
    run_and_check(xr, None, None, fresh(xr.shape, "float32", 0.0, 1.0))


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("n", [17, 1024, 8192, 32768, 65536, 262144])
def test_large_mean_rows(n):
    x = fresh((16, n), "float32", loc=1e4, scale=1.0)
    w = fresh((n,), "float32", loc=1.0, scale=0.3)
    dy = fresh((16, n), "float32", 0.0, 1.0)
    run_and_check(x, w, None, dy)


@pytest.mark.parametrize("n", [1024, 8192, 32768])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_mean_rows_16bit(dtype, n):
    """16-bit rows far from zero (|mean * rstd| about 125) and rows of one repeated value
    (rstd = 1/sqrt(eps), |mean * rstd| about 10^7, where rounding mean * rstd once would put up
    to 0.5 into each xhat): the backward's fused xhat + lo must take lo * sum(g) off its sums."""
    x = fresh((16, n), dtype, loc=1000.0, scale=8.0)
    x[3] = 30000.0
    x[9] = -4096.0
    w = fresh((n,), dtype, loc=1.0, scale=0.3)
    dy = fresh((16, n), dtype, 0.0, 1.0)
    run_and_check(x, w, None, dy)


@pytest.mark.parametrize("n", [64, 4096, 65536])
def test_nan_in_x_stays_in_its_row(n):
    x, w, b, dy = inputs((9, n), "float32", "float32", "float32")
    x[4, n // 2] = cupy.nan
    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    keep = [i for i in range(9) if i != 4]
    assert bool(cupy.isnan(y[4]).all()) and bool(cupy.isnan(dx[4]).all())
    assert bool(cupy.isnan(mean[4])) and bool(cupy.isnan(rstd[4]))
    ref.assert_close(y[keep], ref.forward(x[keep], w, b)[0], "y of the other rows")
    ref.assert_close(dx[keep], ref.backward(dy[keep], x[keep], w)[0], "dx of the other rows")
    assert bool(cupy.isnan(dw).all())  # the NaN row's xhat reaches every column of dw...
    ref.assert_close(db, ref.backward(dy, x, w)[2], "db", atol_scale=3)  # ...and not db


@pytest.mark.parametrize("n", [64, 4096, 65536])
def test_nan_in_dy_stays_in_its_row_and_column(n):
    x, w, b, dy = inputs((9, n), "float32", "float32", "float32")
    dy[2, 5] = cupy.nan
    _, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    keep = [i for i in range(9) if i != 2]
    assert bool(cupy.isnan(dx[2]).all())
    ref.assert_close(dx[keep], ref.backward(dy[keep], x[keep], w)[0], "dx of the other rows")
    cols = [c for c in range(n) if c != 5]
    assert bool(cupy.isnan(dw[5])) and bool(cupy.isnan(db[5]))
    _, dwr, dbr = ref.backward(dy, x, w)
    ref.assert_close(dw[cols], dwr[cols], "dw of the other columns", atol_scale=3)
    ref.assert_close(db[cols], dbr[cols], "db of the other columns", atol_scale=3)


# Widths of the cluster tiers (sm_90) whose blocks get unequal slices of the row. Backward:
# 32776 bf16 (registers: 8 blocks of 160 threads, the last without columns), 16385 float32
# (scalar packs over 4), 98304 bf16 (8 staged blocks); forward in registers: 131080 bf16
# (16385 packs over 8 blocks of 320 threads), 40000 float32 (2500 packs a block, idle lanes),
# 28676 float32 (3584 and 3585 packs over 2 blocks of 512 threads, two rows a block); forward
# staged: 32770 float64 (16385 packs over 4).
# Rows fewer than clusters (1, 37) leave clusters without rows.
@pytest.mark.parametrize("m", [1, 37, 700])
@pytest.mark.parametrize(
    "n,dtype",
    [(32776, "bfloat16"), (16385, "float32"), (98304, "bfloat16"), (131080, "bfloat16"),
     (40000, "float32"), (28676, "float32"), (32770, "float64")],
)  # fmt: skip
def test_cluster_row_slices(m, n, dtype):
    run_and_check(*inputs((m, n), dtype, "float32", dtype))


@pytest.mark.parametrize("m,n", [(70000, 64), (5000, 1024), (333, 8192), (100, 65536)])
def test_dw_db_are_deterministic(m, n):
    x, w, b, dy = inputs((m, n), "bfloat16", "float32", "float32")
    _, mean, rstd = cupyln.forward(x, w, b)
    runs = [cupyln.backward(dy, x, w, mean, rstd) for _ in range(3)]
    for dx, dw, db in runs[1:]:
        assert bool((dx == runs[0][0]).all())
        assert bool((dw.view(cupy.uint32) == runs[0][1].view(cupy.uint32)).all())
        assert bool((db.view(cupy.uint32) == runs[0][2].view(cupy.uint32)).all())


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_eps(eps):
    run_and_check(*inputs((20, 512), "float32", "float32", "float32"), eps=eps)


def test_tutorial_seed_check():
    # The Triton tutorial's own check: 1151 x 8192 fp16, y/dx/dw/db allclose(atol=1e-2, rtol=0).
    m, n = 1151, 8192
    x = fresh((m, n), "float16")
    w = ref.from_float32(cupy.random.default_rng(7).random(n, dtype=cupy.float32), "float16")
    b = ref.from_float32(cupy.random.default_rng(8).random(n, dtype=cupy.float32), "float16")
    dy = fresh((m, n), "float16", 0.0, 0.1)
    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    yr, _, _ = ref.forward(x, w, b)
    dxr, dwr, dbr = ref.backward(dy, x, w)
    for out, r in ((y, yr), (dx, dxr), (dw, dwr), (db, dbr)):
        cupy.testing.assert_allclose(ref.to_float64(out), r, atol=1e-2, rtol=0)


# ------------------------------------------------------------------ the cached hot path
def _bits(a):
    return None if a is None else a.view(_UINT[a.itemsize])


def _same_bits(got, want, what):
    assert (got is None) == (want is None), what
    if got is not None:
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert bool((_bits(got) == _bits(want)).all()), f"{what}: bits differ"


@pytest.mark.parametrize("n", [64, 769, 4096, 16384, 65536])
@pytest.mark.parametrize("xdt,wdt", [("bfloat16", "float32"), ("float32", None)])
def test_repeated_calls_match_checked_calls(n, xdt, wdt):
    """Calls after the first take the cached path (no out=): bit for bit the result of the
    checked path into poisoned outputs, for fresh data each time."""
    m = 333
    for _ in range(3):
        x, w, b, dy = inputs((3, m // 3, n), xdt, wdt, wdt)
        want = run_and_check(x, w, b, dy)
        ref.poison_pool(want[0].nbytes * 4)
        got = cupyln.forward(x, w, b)
        ref.poison_pool(want[0].nbytes * 4)
        got += cupyln.backward(dy, x, w, got[1], got[2])
        for g, wv, what in zip(got, want, ("y", "mean", "rstd", "dx", "dw", "db")):
            _same_bits(g, wv, what)
    assert cupyln._api._forward_key(x, w, b) in cupyln._api._forward_calls[False]
    assert cupyln._api._backward_key(dy, x, w, got[1], got[2]) in cupyln._api._backward_calls[False]


def test_outputs_share_one_allocation():
    x, w, b, dy = inputs((10, 256), "float16", "float16", "float16")
    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    assert y.data.mem is mean.data.mem is rstd.data.mem
    assert dx.data.mem is dw.data.mem is db.data.mem
    for a in (y, mean, rstd, dx, dw, db):
        assert a.flags.c_contiguous and a.data.ptr % 256 == 0


@pytest.mark.parametrize("n", [512, 769])
def test_strided_and_misaligned_weights_are_copied(n):
    """w/b views that are strided or start off a 64-byte boundary: right on every call, the
    cached ones included (the kernels read w/b as contiguous aligned packs)."""
    x, _, _, dy = inputs((50, n), "bfloat16", None, None)
    base = fresh((4 * n + 8,), "float32", loc=1.0, scale=0.3)
    for w, b in ((base[::2][:n], base[1::4][:n]), (base[1 : n + 1], base[3 : n + 3])):
        for _ in range(2):
            y, mean, rstd = cupyln.forward(x, w, b)
            ref.assert_close(y, ref.forward(x, w, b)[0], "y")
            dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
            ref.assert_close(dw, ref.backward(dy, x, w)[1], "dw", atol_scale=8)


def test_threads_share_the_cache():
    from concurrent.futures import ThreadPoolExecutor

    cases = [inputs((64 + i, 1024), "bfloat16", "bfloat16", "bfloat16") for i in range(8)]
    want = [run_and_check(*c) for c in cases]

    def work(i):
        x, w, b, dy = cases[i % len(cases)]
        with cupy.cuda.Stream(non_blocking=True) as s:
            y, mean, rstd = cupyln.forward(x, w, b)
            dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
            s.synchronize()
        return i % len(cases), (y, mean, rstd, dx, dw, db)

    with ThreadPoolExecutor(8) as pool:
        for i, got in pool.map(work, range(64)):
            for g, wv, what in zip(got, want[i], ("y", "mean", "rstd", "dx", "dw", "db")):
                _same_bits(g, wv, what)


@pytest.mark.parametrize("first", ["forward", "backward"])
def test_cached_calls_in_a_thread_new_to_cuda(first):
    """A thread that has not used CUDA yet makes its first call one whose attributes are
    cached (the driver-level launch needs the device's context current in that thread)."""
    import threading

    x, w, b, dy = inputs((96, 1024), "float16", "float32", "float32")
    want = run_and_check(x, w, b, dy)
    mean, rstd = want[1], want[2]
    for _ in range(2):  # cached now
        cupyln.forward(x, w, b)
        cupyln.backward(dy, x, w, mean, rstd)
    cupy.cuda.Device().synchronize()
    got, errors = [], []

    def work():
        try:
            if first == "forward":
                got.extend(cupyln.forward(x, w, b))
            got.extend(cupyln.backward(dy, x, w, mean, rstd))
            cupy.cuda.get_current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    names = ("y", "mean", "rstd", "dx", "dw", "db") if first == "forward" else ("dx", "dw", "db")
    for g, wv, what in zip(got, want[-len(names) :], names):
        _same_bits(g, wv, what)


# ------------------------------------------------------------------ streams and devices
def test_runs_on_the_current_stream_after_a_producer():
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        # a producer kernel still running on s when cupyln is called on s
        big = cupy.random.default_rng(3).standard_normal((4096, 4096), dtype=cupy.float32)
        for _ in range(20):
            big = big * 1.0001
        x = (big[:1024, :2048] * 0.5 - 2.3).astype(cupy.float32)
        w = cupy.full(2048, 1.5, cupy.float32)
        y, mean, rstd = cupyln.forward(x, w)
        dy = cupy.ones_like(x)
        dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    s.synchronize()
    ref.assert_close(y, ref.forward(x, w)[0], "y")
    dxr, dwr, dbr = ref.backward(dy, x, w)
    ref.assert_close(dx, dxr, "dx")
    ref.assert_close(dw, dwr, "dw", atol_scale=32)


@pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs")
def test_second_device():
    with cupy.cuda.Device(1):
        x, w, b, dy = inputs((33, 1000), "bfloat16", "float32", "float32")
    assert cupy.cuda.runtime.getDevice() == 0
    y, mean, rstd, dx, dw, db = run_and_check(x, w, b, dy)
    assert all(a.data.device_id == 1 for a in (y, mean, rstd, dx, dw, db))
    assert cupy.cuda.runtime.getDevice() == 0


# ------------------------------------------------------------------ M * N past 2**31
@pytest.mark.slow
@pytest.mark.parametrize("n", [4096, 131072])
def test_more_than_2_pow_31_elements(n):
    m = 2**31 // n + 3
    x = fresh((m, n), "bfloat16")
    w = fresh((n,), "bfloat16", 1.0, 0.3)
    b = fresh((n,), "bfloat16", 0.0, 0.3)
    y, mean, rstd = cupyln.forward(x, w, b)
    dy = fresh((m, n), "bfloat16", 0.0, 1.0)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    rows = [0, 1, m // 2, m - 2, m - 1]  # the last rows sit past element 2**31
    ref.assert_close(y[rows], ref.forward(x[rows], w, b)[0], "y")
    ref.assert_close(dx[rows], ref.backward(dy[rows], x[rows], w)[0], "dx")
    assert not bool(cupy.isnan(y[-1]).any())
    # dw/db over all rows, by a float64 column sum in chunks
    dwr = cupy.zeros(n, cupy.float64)
    dbr = cupy.zeros(n, cupy.float64)
    step = max(1, 2**24 // n)
    for s in range(0, m, step):
        _, dwc, dbc = ref.backward(dy[s : s + step], x[s : s + step], w)
        dwr += dwc
        dbr += dbc
    ref.assert_close(dw, dwr, "dw", atol_scale=math.sqrt(m))
    ref.assert_close(db, dbr, "db", atol_scale=math.sqrt(m))


@pytest.mark.parametrize("rms,residual", [(False, None), (True, None), (True, "float32")])
def test_precompile_leaves_nothing_to_compile(rms, residual):
    """After cupyln.precompile, forward and backward at any M (contiguous rows) compile no
    kernel, for LayerNorm, RMSNorm and an add in front with h in float32."""
    from cupyln import _compile

    n, dt = 4096, "bfloat16"
    assert cupyln.precompile(n, dt, rms=rms, residual_dtype=residual, w_dtype="float32") > 0
    compiled = len(_compile._functions)
    w = ref.sample((n,), "float32", loc=1.0, seed=2)
    for m in (1, 7, 1000, 1024, 2048, 3001, 20000):
        x = ref.sample((m, n), dt, seed=m)
        dy = ref.sample((m, n), dt if residual is None else residual, seed=m + 1)
        if rms:
            r = None if residual is None else ref.sample((m, n), residual, seed=m + 2)
            out = cupyln.rms_forward(x, w, residual=r)
            h = x if r is None else out[-1]
            cupyln.rms_backward(dy, h, w, out[1], dh=None if r is None else dy)
        else:
            y, mean, rstd = cupyln.forward(x, w, w)
            cupyln.backward(dy, x, w, mean, rstd)
        assert len(_compile._functions) == compiled, f"M={m}: a kernel compiled"
