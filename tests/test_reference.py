"""CPU tier: the float64 reference against torch's layer_norm and its autograd, and the
bfloat16 conversions against ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest

from cupyln import reference as ref

# Shapes: N = 1 and 3 (tiny rows), 769 (odd), rank-3 input, a single row.
SHAPES = [(5, 1), (7, 3), (4, 769), (2, 3, 64), (1, 1000)]


def _inputs_and_leaves(torch, seed, shape, affine, b_scale):
    """Seed-style float64 inputs (x, dy, w, b) and torch leaves (tx, tw, tb) with gradients."""
    rng = np.random.default_rng(seed)
    n = shape[-1]
    x = -2.3 + 0.5 * rng.standard_normal(shape)
    dy = rng.standard_normal(shape)
    w = 1.0 + 0.3 * rng.standard_normal(n) if affine else None
    b = b_scale * rng.standard_normal(n) if affine else None
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True) if affine else None
    tb = torch.tensor(b, requires_grad=True) if affine else None
    return x, dy, w, b, tx, tw, tb


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_reference_matches_torch_float64(shape, affine):
    torch = pytest.importorskip("torch")
    n = shape[-1]
    x, dy, w, b, tx, tw, tb = _inputs_and_leaves(torch, 0, shape, affine, b_scale=0.5)
    eps = 1e-5
    ty = torch.nn.functional.layer_norm(tx, (n,), tw, tb, eps)
    ty.backward(torch.tensor(dy))
    tmean = tx.detach().mean(-1)
    trstd = 1 / torch.sqrt(tx.detach().var(-1, unbiased=False) + eps)

    y, mean, rstd = ref.forward(x, w, b, eps)
    dx, dw, db = ref.backward(dy, x, w, eps)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, tmean.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rstd, trstd.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    if affine:
        np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-10, atol=1e-10)
    else:
        assert dw is None
        np.testing.assert_allclose(db, dy.reshape(-1, n).sum(0), rtol=1e-12, atol=1e-12)


def test_reference_large_mean_rows_are_exact():
    # 1e4 + noise: the two-pass formulas keep the variance; E[x^2] - E[x]^2 would not.
    rng = np.random.default_rng(1)
    x = 1e4 + rng.standard_normal((3, 4096))
    _, _, rstd = ref.forward(x, eps=0.0)
    np.testing.assert_allclose(1 / rstd**2, x.var(-1), rtol=1e-9)


def test_bfloat16_conversions_match_ml_dtypes():
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(2)
    a = np.concatenate(
        [
            (rng.standard_normal(10000) * 10.0 ** rng.integers(-30, 30, 10000)),
            [0.0, -0.0, np.inf, -np.inf, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3895314e38],
        ]
    ).astype(np.float32)
    got = ref.from_float32(a, bf16)
    want = a.astype(bf16)
    assert got.dtype == bf16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(ref.to_float64(got), want.astype(np.float64))
    assert np.isnan(ref.to_float64(ref.from_float32(np.array([np.nan], np.float32), bf16)))[0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_from_float32_plain_dtypes(dtype):
    a = np.linspace(-3, 3, 101, dtype=np.float32)
    np.testing.assert_array_equal(ref.from_float32(a, dtype), a.astype(dtype))


def test_tolerance_table_covers_supported_dtypes():
    from cupyln._dtypes import SUPPORTED_NAMES

    assert set(ref.TOLERANCE) == set(SUPPORTED_NAMES)


def test_assert_close_rejects_wrong_and_nan():
    r = np.array([1.0, 2.0, 3.0])
    ref.assert_close(np.array([1.0, 2.0, 3.0], np.float32), r, "same")
    with pytest.raises(AssertionError, match="off"):
        ref.assert_close(np.array([1.0, 2.1, 3.0], np.float32), r, "off by 0.1")
    with pytest.raises(AssertionError, match="NaN"):
        ref.assert_close(np.array([1.0, np.nan, 3.0], np.float32), r, "nan")


def test_backward_at_given_statistics():
    rng = np.random.default_rng(3)
    x = -2.3 + 0.5 * rng.standard_normal((6, 50))
    dy, w = rng.standard_normal((6, 50)), rng.standard_normal(50)
    _, mean, rstd = ref.forward(x)
    for a, b in zip(ref.backward(dy, x, w), ref.backward(dy, x, w, 1e-5, mean, rstd)):
        np.testing.assert_array_equal(a, b)
    dx_shifted = ref.backward(dy, x, w, 1e-5, mean + 1e-3, rstd)[0]
    assert np.abs(dx_shifted - ref.backward(dy, x, w)[0]).max() > 1e-6


# Jagged batches: empty sequences (equal offsets) at the start, middle and end, a single row,
# M = 1, and a long sequence beside short ones.
JAGGED = [
    ([0, 0, 3, 3, 4, 9, 9], 5),
    ([0, 1], 1),
    ([0, 7], 3),
    ([0, 2, 2, 40, 41], 4),
]


@pytest.mark.parametrize("offsets,m", JAGGED)
@pytest.mark.parametrize("affine", [True, False])
def test_jagged_reference_matches_torch_per_sequence(offsets, m, affine):
    # The Helion seed's reference: torch layer_norm of each [L_i, M] block over its whole shape.
    torch = pytest.importorskip("torch")
    x, dy, w, b, tx, tw, tb = _inputs_and_leaves(torch, 4, (offsets[-1], m), affine, b_scale=0.3)
    eps = 1e-6
    outs = []
    for i in range(len(offsets) - 1):
        v = tx[offsets[i] : offsets[i + 1]]
        if v.shape[0] == 0:
            outs.append(v)
            continue
        wi = tw.expand(v.shape) if affine else None
        bi = tb.expand(v.shape) if affine else None
        outs.append(torch.nn.functional.layer_norm(v, tuple(v.shape), wi, bi, eps))
    ty = torch.cat(outs)
    ty.backward(torch.tensor(dy))

    y, mean, rstd = ref.jagged_forward(x, np.array(offsets), w, b, eps)
    dx, dw, db = ref.jagged_backward(dy, x, np.array(offsets), w, eps)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-9)
    if affine:
        np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-9, atol=1e-9)
    else:
        assert dw is None
    lengths = np.diff(offsets)
    for i, n_rows in enumerate(lengths):
        if n_rows:
            block = x[offsets[i] : offsets[i + 1]]
            np.testing.assert_allclose(mean[i], block.mean(), rtol=1e-12)
            np.testing.assert_allclose(rstd[i], 1 / np.sqrt(block.var() + eps), rtol=1e-12)
        else:
            assert mean[i] == 0 and rstd[i] == 1 / np.sqrt(eps)
