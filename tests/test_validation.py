"""Bad input gets a TypeError/ValueError naming the argument, what was expected and what came,
and nothing is written. The NumPy-input checks run on the CPU tier; the rest need CuPy arrays."""

import numpy as np
import pytest

import cupyln

from .conftest import GPU_COUNT, requires_gpu

if GPU_COUNT:
    import cupy

    from cupyln import reference as ref


@pytest.mark.parametrize("fn", [cupyln.forward, cupyln.layer_norm])
def test_numpy_x_is_refused(fn):
    with pytest.raises(TypeError, match=r"x must be a cupy.ndarray.*numpy.ndarray"):
        fn(np.ones((4, 8), np.float32))


def test_numpy_dy_is_refused():
    with pytest.raises(TypeError, match=r"x must be a cupy.ndarray"):
        cupyln.backward(np.ones((2, 3)), np.ones((2, 3)), None, np.ones(2), np.ones(2))


def test_list_is_refused():
    with pytest.raises(TypeError, match="got builtins.list"):
        cupyln.forward([[1.0, 2.0]])


@requires_gpu
@pytest.mark.gpu
class TestOnGpu:
    def setup_method(self):
        self.x = ref.sample((6, 32), "float32", seed=1)
        self.w = ref.sample((32,), "float32", seed=2)
        self.y = cupy.full((6, 32), cupy.nan, cupy.float32)
        self.mean = cupy.full(6, cupy.nan, cupy.float32)
        self.rstd = cupy.full(6, cupy.nan, cupy.float32)

    def fwd_raises(self, exc, match, *args, **kw):
        out = (self.y, self.mean, self.rstd)
        with pytest.raises(exc, match=match):
            cupyln.forward(*args, **kw, out=out)
        assert all(bool(cupy.isnan(a).all()) for a in out), "an output was written"

    def test_forward_arguments(self):
        x, w = self.x, self.w
        self.fwd_raises(TypeError, "x must have dtype .*; got int32", x.astype(cupy.int32))
        self.fwd_raises(ValueError, r"at least one dimension.*0-d", cupy.float32(1.0) + x[0, 0])
        self.fwd_raises(ValueError, r"N\) must be in \[1, .*got 0", cupy.ones((3, 0), "f4"))
        self.fwd_raises(ValueError, r"w must have shape \(32,\).*got \(31,\)", x, w[:31])
        self.fwd_raises(ValueError, r"b must have shape \(32,\).*got \(1, 32\)", x, w, w[None])
        self.fwd_raises(TypeError, "w must be a cupy.ndarray.*numpy", x, w.get())
        self.fwd_raises(TypeError, "b must have dtype .*; got complex64", x, w, w.astype("c8"))
        self.fwd_raises(ValueError, "eps must be finite and >= 0; got -1", x, w, None, -1.0)
        self.fwd_raises(ValueError, "eps must be finite and >= 0; got nan", x, w, None, np.nan)
        self.fwd_raises(ValueError, "eps must be finite and >= 0; got inf", x, w, None, np.inf)
        self.fwd_raises(TypeError, "eps must be a real number; got str", x, w, None, "1e-5")

    def test_forward_eps_on_the_cached_path(self):
        # a shape seen before launches through the forward's cache, which checks eps too
        x, w = self.x, self.w
        y1 = cupyln.forward(x, w, None, 1.0)[0]
        for eps, exc, match in (
            (-1.0, ValueError, "eps must be finite and >= 0; got -1.0"),
            (np.nan, ValueError, "eps must be finite and >= 0; got nan"),
            (np.inf, ValueError, "eps must be finite and >= 0; got inf"),
            ("1e-5", TypeError, "eps must be a real number; got str"),
            (True, TypeError, "eps must be a real number; got bool"),
        ):
            with pytest.raises(exc, match=match):
                cupyln.forward(x, w, None, eps)
        for eps in (1, np.float32(1.0), np.float64(1.0)):
            assert bool((cupyln.forward(x, w, None, eps)[0] == y1).all()), eps

    def test_forward_out(self):
        with pytest.raises(ValueError, match=r"y must be a float32 array of shape \(6, 32\)"):
            cupyln.forward(self.x, out=(cupy.empty((6, 31), "f4"), None, None))
        with pytest.raises(ValueError, match=r"mean must be a float32 array"):
            cupyln.forward(self.x, out=(None, cupy.empty(6, "f8"), None))
        with pytest.raises(ValueError, match="rstd must be C-contiguous"):
            cupyln.forward(self.x, out=(None, None, cupy.empty(12, "f4")[::2]))
        with pytest.raises(TypeError, match=r"out must be a tuple \(y, mean, rstd\)"):
            cupyln.forward(self.x, out=self.y)

    def test_outputs_overlapping_inputs_are_refused(self):
        """Outputs sharing memory with an input or with each other are refused before anything
        is written, at a row-tier shape (its dw/db read dy again after dx is written); y may
        be x itself, and is then right."""
        n = 262144  # float32 rows of the backward's row tier
        x = ref.sample((3, n), "float32", seed=3)
        w = ref.sample((n,), "float32", seed=4)
        y, mean, rstd = cupyln.forward(x, w)
        dy = ref.sample((3, n), "float32", seed=5)
        dx = cupy.full_like(x, cupy.nan)
        dw = cupy.full_like(w, cupy.nan)
        for out, match in (
            ((dy, None, None), "dx must not overlap dy"),
            ((dx, w, None), "dw must not overlap w"),
            ((dx, dw, dw), "dw must not overlap db"),
            ((dx, x[1], None), "dw must not overlap x"),
        ):
            keep = dy.copy(), x.copy(), w.copy()
            with pytest.raises(ValueError, match=match):
                cupyln.backward(dy, x, w, mean, rstd, out=out)
            assert bool(cupy.isnan(dx).all()) and bool(cupy.isnan(dw).all())
            assert all(bool((a == b).all()) for a, b in zip(keep, (dy, x, w)))
        wide = cupy.empty((3, n + 1), "float32")
        shifted = (wide.ravel()[1 : 3 * n + 1].reshape(3, n), None, None)
        wide[:, :n] = x
        with pytest.raises(ValueError, match="y must not overlap x"):
            cupyln.forward(wide[:, :n], w, out=shifted)
        stats = cupy.empty(6, "float32")
        with pytest.raises(ValueError, match="mean must not overlap rstd"):
            cupyln.forward(x, w, out=(None, stats[:3], stats[2:5]))
        inplace = x.copy()
        got = cupyln.forward(inplace, w, out=(inplace, None, None))[0]
        assert got is inplace and bool((got == y).all())
        rows = cupy.empty((4, n), "float32")
        rows[1:] = x
        with pytest.raises(ValueError, match="y must not overlap x"):  # a row apart
            cupyln.rms_forward(rows[1:], w, out=(rows[:3], None))

    def test_backward_arguments(self):
        x, w = self.x, self.w
        _, mean, rstd = cupyln.forward(x, w)
        dy = cupy.ones_like(x)
        dx = cupy.full(x.shape, cupy.nan, cupy.float32)
        cases = [
            (ValueError, r"dy must have the shape of x \(6, 32\); got \(6, 31\)",
             (dy[:, :31], x, w, mean, rstd)),
            (TypeError, "dy must be of x's precision .float32: .*; got float64",
             (dy.astype("f8"), x, w, mean, rstd)),
            (ValueError, r"mean must have shape x.shape\[:-1\] = \(6,\); got \(5,\)",
             (dy, x, w, mean[:5], rstd)),
            (TypeError, "rstd must be float32 for float32 x; got float64",
             (dy, x, w, mean, rstd.astype("f8"))),
            (TypeError, "mean must be a cupy.ndarray", (dy, x, w, mean.get(), rstd)),
            (ValueError, r"w must have shape \(32,\)", (dy, x, w[:3], mean, rstd)),
        ]  # fmt: skip
        for exc, match, args in cases:
            with pytest.raises(exc, match=match):
                cupyln.backward(*args, out=(dx, None, None))
            assert bool(cupy.isnan(dx).all()), f"dx written for {match}"
        with pytest.raises(TypeError, match="db_dtype must be one of .*; got int64"):
            cupyln.backward(dy, x, w, mean, rstd, db_dtype="int64")
        with pytest.raises(ValueError, match="out's dw must be None without w"):
            cupyln.backward(dy, x, None, mean, rstd, out=(dx, cupy.empty(32, "f4"), None))
        assert bool(cupy.isnan(dx).all())
        # dy of x's precision in another dtype is converted; bias_dtype is db_dtype's old name
        dy16 = ref.sample((6, 32), "float16", seed=7)
        want = cupyln.backward(dy16.astype("f4"), x, w, mean, rstd, db_dtype="float64")
        with pytest.warns(DeprecationWarning, match="bias_dtype is deprecated.*db_dtype"):
            got = cupyln.backward(dy16, x, w, mean, rstd, bias_dtype="float64")
        assert got[2].dtype == "float64"
        assert all(bool((a == b).all()) for a, b in zip(got, want))
        with pytest.raises(TypeError, match="bias_dtype is the old name of db_dtype"):
            cupyln.backward(dy, x, w, mean, rstd, bias_dtype="f8", db_dtype="f8")


def test_family_checks_name_their_argument():
    """The norm family's shared checks (CPU: they take shapes, dtypes and numbers)."""
    from cupyln import _checks

    assert _checks.weight_offset(1) == 1.0 and _checks.weight_offset(0.0, False) == 0.0
    with pytest.raises(ValueError, match="weight_offset needs a weight; got weight=None"):
        _checks.weight_offset(1.0, False)
    f4, f8 = np.dtype("float32"), np.dtype("float64")
    assert _checks.residual((2, 3), f4, None, (2, 3), f4) == f4
    with pytest.raises(TypeError, match="residual_dtype must be one of .*; got int8"):
        _checks.residual((2, 3), f4, "int8", (2, 3), f4)
    with pytest.raises(TypeError, match="residual_dtype must be of x's precision"):
        _checks.residual((2, 3), f4, f8, (2, 3), f4)


def test_out_of_the_wrong_kind_or_length_is_refused():
    """_checks.outputs names what ``out`` must be: a tuple, and of how many entries."""
    from cupyln import _checks

    names, specs = ("y", "mean", "rstd"), [((2, 3), "f4"), ((2,), "f4"), ((2,), "f4")]
    with pytest.raises(TypeError, match=r"out must be a tuple \(y, mean, rstd\); got str"):
        _checks.outputs("y", names, specs, 0)
    for out in ((None, None), (None,) * 4):
        with pytest.raises(ValueError, match=rf"\(y, mean, rstd\) of 3; got {len(out)} entries"):
            _checks.outputs(out, names, specs, 0)
    assert _checks.outputs(None, names, specs, 0) is None
    assert _checks.outputs([None] * 3, names, specs, 0) == [None] * 3


def test_extent_spans_strided_and_reversed_arrays():
    """_checks.extent: the bytes an array's elements span, whatever its strides."""
    from types import SimpleNamespace

    from cupyln import _checks

    def arr(ptr, shape, strides, itemsize=4):
        size = int(np.prod(shape))
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr), shape=shape, strides=strides,
                               size=size, itemsize=itemsize)  # fmt: skip

    assert _checks.extent(arr(1000, (3, 8), (32, 4))) == (1000, 1096)
    assert _checks.extent(arr(1000, (3, 8), (64, 4))) == (1000, 1160)  # strided rows
    assert _checks.extent(arr(1000, (3, 8), (-32, 4))) == (936, 1032)  # rows reversed
    assert _checks.extent(arr(1000, (0, 8), (32, 4))) == (1000, 1000)  # empty
