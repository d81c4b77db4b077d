"""GPU tier of the jagged LayerNorm: against the float64 reference (cupyln.reference.jagged_*),
every kernel path (the short path's block and warp groups, the chunked path for long
sequences and the short kernel's walk of a sequence longer than max_seqlen, both forced with a
small max_seqlen), skewed lengths, empty sequences, determinism, bad offsets.

Tolerances: cupyln.reference.TOLERANCE by output dtype; dw/db allow atol * sqrt(rows).
"""

import itertools
import math

import numpy as np
import pytest

from cupyln import reference as ref

from .conftest import GPU_COUNT, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

if GPU_COUNT:
    import cupy

    import cupyln

_seed = itertools.count(9000)


def batch(lengths, d, dtype, off_dtype="int64", wdt="float32", bdt="float32"):
    rng = np.random.default_rng(next(_seed))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(off_dtype)
    total = int(offsets[-1])
    values = ref.sample((total, d), dtype, seed=int(rng.integers(1 << 30)))
    w = None if wdt is None else ref.sample((d,), wdt, 1.0, 0.3, seed=int(rng.integers(1 << 30)))
    b = None if bdt is None else ref.sample((d,), bdt, 0.0, 0.3, seed=int(rng.integers(1 << 30)))
    dy = ref.sample((total, d), dtype, 0.0, 1.0, seed=int(rng.integers(1 << 30)))
    return values, cupy.asarray(offsets), w, b, dy


def check(values, offsets, w, b, dy, eps=1e-6, **kw):
    ar = "float64" if values.dtype == np.float64 else "float32"
    ref.poison_pool(values.nbytes)
    y, mean, rstd = cupyln.jagged_forward(values, offsets, w, b, eps, **kw)
    yr, meanr, rstdr = ref.jagged_forward(values, offsets, w, b, eps)
    ref.assert_close(y, yr, "y", arithmetic=ar)
    ref.assert_close(mean, meanr, "mean", arithmetic=ar)
    ref.assert_close(rstd, rstdr, "rstd", arithmetic=ar)
    ref.poison_pool(values.nbytes)
    dx, dw, db = cupyln.jagged_backward(dy, values, offsets, w, mean, rstd, **kw)
    dxr, dwr, dbr = ref.jagged_backward(dy, values, offsets, w, eps)
    rows = math.sqrt(max(values.shape[0], 1))
    ref.assert_close(dx, dxr, "dx", arithmetic=ar)
    assert (dw is None) == (w is None)
    if w is not None:
        ref.assert_close(dw, dwr, "dw", atol_scale=rows, arithmetic=ar)
    ref.assert_close(db, dbr, "db", atol_scale=rows, arithmetic=ar)
    return y, mean, rstd, dx, dw, db


# The Helion example's sweep: B x M, lengths uniform in [1, max_seqlen = 128], float32.
@pytest.mark.parametrize("b", [32, 256, 2048, 16384])
@pytest.mark.parametrize("d", [32, 256])
def test_seed_sweep(b, d):
    lengths = np.random.default_rng(b * d).integers(1, 129, b)
    check(*batch(lengths, d, "float32"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("max_seqlen", [None, 128, 2])
@pytest.mark.parametrize("check_offsets", [True, False])
def test_dtypes_and_all_paths(dtype, max_seqlen, check_offsets):
    """max_seqlen=2 gives the short path room for 2 rows only. With the offsets check the host
    learns that longer sequences exist: they take the chunked path. Without it the host trusts
    the bound and skips the chunked path: the forward's short kernel walks every longer
    sequence from global memory, and the backward keeps the chunked path."""
    lengths = np.random.default_rng(1).integers(0, 129, 300)
    check(*batch(lengths, 256, dtype, wdt=dtype, bdt="float32"), max_seqlen=max_seqlen,
          check_offsets=check_offsets)  # fmt: skip


@pytest.mark.parametrize("d", [1, 3, 17, 64, 769, 4096])
@pytest.mark.parametrize("max_seqlen", [None, 1])
def test_widths_and_scalar_path(d, max_seqlen):
    lengths = np.random.default_rng(d).integers(0, 40, 50)
    check(*batch(lengths, d, "bfloat16", "int32"), max_seqlen=max_seqlen)


def test_empty_sequences_and_empty_batches():
    y, mean, rstd, *_ = check(*batch([0, 3, 0, 0, 5, 0], 64, "float32"))
    assert float(mean[0]) == 0.0 and math.isclose(float(rstd[0]), 1e3, rel_tol=1e-6)
    check(*batch([0, 0, 0], 64, "float32"))  # no rows at all
    values = cupy.empty((0, 8), cupy.float32)
    y, mean, rstd = cupyln.jagged_forward(values, cupy.zeros(1, cupy.int64))  # B = 0
    assert y.shape == (0, 8) and mean.shape == (0,) and rstd.shape == (0,)
    dx, dw, db = cupyln.jagged_backward(values, values, cupy.zeros(1, cupy.int32), None, mean,
                                        rstd)  # fmt: skip
    assert dx.shape == (0, 8) and dw is None and bool((db == 0).all())


def test_single_sequence_and_no_affine():
    check(*batch([1000], 512, "float32", wdt=None, bdt=None))
    check(*batch([1000], 512, "bfloat16", wdt="bfloat16", bdt=None))


@pytest.mark.slow
def test_one_huge_sequence_among_many_short():
    """The skew the chunked path exists for: 10**6 rows in one sequence beside 5000 one-row
    sequences (and a few long ones between them)."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([np.ones(2000, int), [10**6], np.ones(3000, int),
                              rng.integers(1000, 5000, 5), [0, 1]])  # fmt: skip
    check(*batch(lengths, 32, "bfloat16"), max_seqlen=128)


@pytest.mark.parametrize("max_seqlen", [None, 2])
@pytest.mark.parametrize("check_offsets", [True, False])
def test_large_mean_sequences_stay_exact(max_seqlen, check_offsets):
    """1e4 + 0.5 randn: the short path takes the variance about a first mean (corrected
    two-pass), the walks shift by a sequence's (or chunk's) first element and the chunked path
    applies the mean in double, so y keeps float32 accuracy."""
    values, offsets, w, b, _ = batch([100, 3000, 7], 128, "float32")
    values = values + np.float32(1e4)
    y, mean, rstd = cupyln.jagged_forward(values, offsets, w, b, max_seqlen=max_seqlen,
                                          check_offsets=check_offsets)  # fmt: skip
    yr, meanr, rstdr = ref.jagged_forward(values, offsets, w, b)
    ref.assert_close(y, yr, "y")
    ref.assert_close(mean, meanr, "mean")
    ref.assert_close(rstd, rstdr, "rstd")


@pytest.mark.parametrize("max_seqlen", [None, 1024])
def test_sequences_of_rows_far_apart_stay_exact(max_seqlen):
    """A sequence whose first row's mean lies far from the sequence's (one row near 0, a
    thousand near 1000): the short path's variance about the sequence's own mean keeps rstd at
    float32 accuracy (a variance about the first row's mean would lose about three digits)."""
    values, offsets, w, b, _ = batch([1024, 3], 16, "float32")
    values[1:1024] += np.float32(1000.0)
    y, mean, rstd = cupyln.jagged_forward(values, offsets, w, b, max_seqlen=max_seqlen)
    yr, meanr, rstdr = ref.jagged_forward(values, offsets, w, b)
    ref.assert_close(mean, meanr, "mean")
    ref.assert_close(rstd, rstdr, "rstd")
    ref.assert_close(y, yr, "y")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_unchecked_bad_offsets_stay_in_bounds(dtype):
    """check_offsets=False: offsets that leave values (past total_L, negative, decreasing) are
    clamped on the GPU into a valid partition, and the results are those of that partition,
    bit for bit; valid offsets are unchanged by it."""
    values, _, w, b, dy = batch([8, 8, 8, 8], 64, "bfloat16")
    total = values.shape[0]
    for bad, clamped in (
        ([0, 5, 3, 40, 999], [0, 5, 5, 32, 32]),
        ([-7, 10, 2**30, 12, 20], [0, 10, 32, 32, 32]),
        ([3, 3, -1, 31, 31], [0, 3, 3, 31, 32]),
        ([0, 8, 16, 24, 32], [0, 8, 16, 24, 32]),
    ):
        bad, clamped = (cupy.asarray(o, dtype) for o in (bad, clamped))
        kept = bad.copy()
        unchecked = dict(check_offsets=False)  # (the same kernels for both)
        y, mean, rstd = cupyln.jagged_forward(values, bad, w, b, **unchecked)
        want = cupyln.jagged_forward(values, clamped, w, b, **unchecked)
        ref.assert_close(want[0], ref.jagged_forward(values, clamped, w, b)[0], "y")
        for got, exp in zip((y, mean, rstd), want):
            assert bool((got.view("uint8") == exp.view("uint8")).all())
        assert bool((bad == kept).all()), "the caller's offsets were written"
        grads = cupyln.jagged_backward(dy, values, bad, w, mean, rstd, **unchecked)
        exps = cupyln.jagged_backward(dy, values, clamped, w, mean, rstd, **unchecked)
        for got, exp in zip(grads, exps):
            assert bool((got.view("uint8") == exp.view("uint8")).all())
    assert total == 32


def test_dw_db_are_deterministic():
    lengths = np.random.default_rng(5).integers(1, 3000, 40)
    values, offsets, w, b, dy = batch(lengths, 256, "bfloat16")
    _, mean, rstd = cupyln.jagged_forward(values, offsets, w, b, max_seqlen=16)
    runs = [cupyln.jagged_backward(dy, values, offsets, w, mean, rstd) for _ in range(3)]
    for dx, dw, db in runs[1:]:
        assert bool((dx.view(cupy.uint16) == runs[0][0].view(cupy.uint16)).all())
        assert bool((dw.view(cupy.uint32) == runs[0][1].view(cupy.uint32)).all())
        assert bool((db.view(cupy.uint32) == runs[0][2].view(cupy.uint32)).all())
    again = cupyln.jagged_forward(values, offsets, w, b, max_seqlen=16)
    assert bool((again[1] == mean).all()) and bool((again[2] == rstd).all())


def test_layer_norm_is_the_forward_without_affine():
    values, offsets, *_ = batch([4, 9, 1], 32, "float32")
    y = cupyln.jagged_layer_norm(values, offsets)
    assert bool((y == cupyln.jagged_forward(values, offsets)[0]).all())


@pytest.mark.parametrize(
    "offsets,message",
    [
        ([0, 3, 2, 6], r"non-decreasing; offsets\[1\] = 3 > offsets\[2\] = 2"),
        ([1, 3, 6], r"offsets\[0\] must be 0"),
        ([0, 3, 5], r"offsets\[-1\] must equal values.shape\[0\] = 6"),
        ([0, 3, 7], r"offsets\[-1\] must equal"),
    ],
)
def test_bad_offsets_are_refused(offsets, message):
    values = cupy.ones((6, 4), cupy.float32)
    with pytest.raises(ValueError, match=message):
        cupyln.jagged_forward(values, cupy.asarray(offsets, cupy.int64))


def test_bad_arguments_are_refused():
    values = cupy.ones((6, 4), cupy.float32)
    with pytest.raises(TypeError, match="offsets must have dtype int32 or int64"):
        cupyln.jagged_forward(values, cupy.asarray([0, 6], cupy.float32))
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        cupyln.jagged_forward(values, cupy.asarray([[0, 6]], cupy.int32))
    with pytest.raises(TypeError, match="offsets must be a cupy.ndarray"):
        cupyln.jagged_forward(values, np.asarray([0, 6]))
    with pytest.raises(ValueError, match="values must be 2-D"):
        cupyln.jagged_forward(cupy.ones(6, cupy.float32), cupy.asarray([0, 6]))
    with pytest.raises(ValueError, match=r"w must have shape \(4,\)"):
        cupyln.jagged_forward(values, cupy.asarray([0, 6]), cupy.ones(5, cupy.float32))
