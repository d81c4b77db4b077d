"""CPU tier of the JAX bridge: the import error without JAX, validation before any launch, the
CPU path (JAX's own ops) against the reference, and the kernels' program as XLA partitions it."""

import json
import subprocess
import sys

import pytest


def test_import_without_jax_names_the_extra():
    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import cupyln\n"
        "try:\n"
        "    import cupyln.jax\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "ImportError:" in out.stdout and "cupyln[jax-cuda12]" in out.stdout, out.stdout


def test_validation_errors_name_the_argument():
    jnp = pytest.importorskip("jax.numpy")
    cj = pytest.importorskip("cupyln.jax")
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(TypeError, match="x must have dtype"):
        cj.layer_norm(jnp.ones((4, 8), jnp.int32))
    with pytest.raises(TypeError, match="x must be a JAX array"):
        cj.layer_norm([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        cj.layer_norm(x, jnp.ones(7))
    with pytest.raises(ValueError, match="eps must be finite"):
        cj.layer_norm(x, eps=-1.0)
    with pytest.raises(ValueError, match="0-d"):
        cj.layer_norm(jnp.float32(1.0))


def _cpu_case(seed, dtype="float32", n=96):
    import numpy as np

    from cupyln import reference as ref

    x, r = (ref.sample((5, 3, n), dtype, seed=seed + i, xp=np) for i in (0, 1))
    w, b = (ref.sample((n,), "float32", seed=seed + i, xp=np) for i in (2, 3))
    return x, r, w, b


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_arrays_take_jax_ops_with_the_kernels_semantics(dtype):
    """On the CPU (eager and jitted) the four functions compute what the kernels compute: the
    float64 reference's y, h added in float32 and stored in residual_dtype, weight_offset, y in
    out_dtype; and the program holds no kernel call."""
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cupyln.jax")
    import numpy as np

    from cupyln import reference as ref

    jnp = jax.numpy
    x, r, w, b = _cpu_case(10, dtype)
    cpu = jax.devices("cpu")[0]  # where a GPU is, arrays go there unless put on the CPU
    jx, jr, jw, jb = (jax.device_put(a, cpu) for a in (x, r, w, b))
    h = ref.add(x, r, np.float32)
    cases = {
        "layer_norm": (lambda *a: cj.layer_norm(a[0], a[2], a[3]), ref.forward(x, w, b)[0]),
        "rms_norm": (lambda *a: cj.rms_norm(a[0], a[2], weight_offset=1.0),
                     ref.rms_forward(x, w, weight_offset=1.0)[0]),
        "add_rms_norm": (lambda *a: cj.add_rms_norm(a[0], a[1], a[2], residual_dtype="float32")[0],
                         ref.rms_forward(h, w)[0]),
        "add_layer_norm": (lambda *a: cj.add_layer_norm(a[0], a[1], a[2], a[3],
                                                        residual_dtype="float32")[0],
                           ref.forward(h, w, b)[0]),
    }  # fmt: skip
    for name, (f, want) in cases.items():
        for how, g in (("eager", f), ("jit", jax.jit(f))):
            y = g(jx, jr, jw, jb)
            assert y.dtype == jx.dtype and y.devices() == {jax.devices("cpu")[0]}, (name, how)
            ref.assert_close(np.asarray(y), want, f"{name} {how}")
        assert "callback" not in jax.jit(f).lower(jx, jr, jw, jb).as_text(), name
    y, hh = cj.add_rms_norm(jx, jr, jw, residual_dtype="float32")
    assert hh.dtype == jnp.float32 and np.array_equal(np.asarray(hh), h)
    y = cj.layer_norm(jx.astype(jnp.float32), jw, jb, out_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16


def test_cpu_gradients_match_the_reference():
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cupyln.jax")
    import numpy as np

    from cupyln import reference as ref

    x, r, w, b = _cpu_case(20)
    dy = ref.sample(x.shape, "float32", seed=30, xp=np)
    cpu = jax.devices("cpu")[0]
    jx, jw, jb, jdy = (jax.device_put(a, cpu) for a in (x, w, b, dy))

    def loss(f):
        return lambda *a: (f(*a) * jdy).sum()

    dx, dw, db = jax.jit(jax.grad(loss(cj.layer_norm), argnums=(0, 1, 2)))(jx, jw, jb)
    want = ref.backward(dy, x, w)
    rows = x.shape[0] * x.shape[1]
    for got, ref_, what in zip((dx, dw, db), want, ("dx", "dw", "db")):
        ref.assert_close(np.asarray(got), ref_, what, atol_scale=rows**0.5 if what != "dx" else 1)
    dx, dw = jax.grad(loss(cj.rms_norm), argnums=(0, 1))(jx, jw)
    want = ref.rms_backward(dy, x, w)
    ref.assert_close(np.asarray(dx), want[0], "rms dx")
    ref.assert_close(np.asarray(dw), want[1], "rms dw", atol_scale=rows**0.5)


def test_arrays_of_one_call_share_a_platform():
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cupyln.jax")
    x = jax.device_put(jax.numpy.ones((4, 8)), jax.devices("cpu")[0])
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("needs a GPU beside the CPU")
    w = jax.device_put(jax.numpy.ones(8), gpus[0])
    with pytest.raises(ValueError, match="x is on the CPU and weight on a GPU"):
        cj.layer_norm(x, w)


def test_vmap_loops_over_the_batch():
    """jax.vmap of each function and of its gradient, traced on CPU (nothing launched): the
    kernel calls, forward and backward, each run in a loop over the batch (lax.map); w and b
    batched too (a weight per element)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    cj = pytest.importorskip("cupyln.jax")
    x = r = jnp.ones((3, 20, 256), jnp.bfloat16)
    w = b = jnp.ones((3, 256), jnp.float32)
    calls = {
        "layer_norm": lambda x, r, w, b: cj.layer_norm(x, w, b),
        "rms_norm": lambda x, r, w, b: cj.rms_norm(x, w) + r,
        "add_rms_norm": lambda x, r, w, b: cj.add_rms_norm(x, r, w),
        "add_layer_norm": lambda x, r, w, b: cj.add_layer_norm(x, r, w, b),
    }
    for name, f in calls.items():

        def loss(x, r, w, b, f=f):
            return sum(t.astype(jnp.float32).sum() for t in jax.tree.leaves(f(x, r, w, b)))

        step = jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        jaxpr = jax.make_jaxpr(step)(x, r, w, b)
        shapes = [a.shape for a in jaxpr.out_avals]
        assert shapes == [(3,), x.shape, x.shape, w.shape, w.shape], (name, shapes)
        assert str(jaxpr).count("length=3") == 2, name


SHARDED = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"  # (a GPU machine's default backend has its own devices)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import cupyln.jax as cj

cj._KERNELS_ON_CPU = True  # the kernels' program, compiled for CPU devices: its partitioning
jax.config.update("jax_use_shardy_partitioner", sys.argv[1] == "shardy")
mesh = jax.make_mesh((2,), ("d",))
w, b = jnp.ones(32, jnp.float32), jnp.zeros(32, jnp.float32)
losses = {
    "layer_norm": lambda x, r, w, b: cj.layer_norm(x, w, b),
    "rms_norm": lambda x, r, w, b: cj.rms_norm(x, w),
    "add_rms_norm": lambda x, r, w, b: cj.add_rms_norm(x, r, w),
    "add_layer_norm": lambda x, r, w, b: cj.add_layer_norm(x, r, w, b),
}
out = {}


def stats(lines):
    return {
        "calls": [l.split(" = ")[1].split(" custom-call(")[0] for l in lines
                  if " custom-call(" in l and "callback" in l],
        "gathers": sum(" all-gather(" in l for l in lines),
        "reduces": [l.split(" = ")[1].split(" all-reduce(")[0] for l in lines
                    if " all-reduce(" in l],
    }


for layout, spec in (("rows", P("d")), ("width", P(None, None, "d"))):
    shape = (4, 6, 32)
    x = jax.device_put(jnp.ones(shape, jnp.bfloat16), NamedSharding(mesh, spec))
    r = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, spec))
    for name, f in losses.items():
        def loss(x, r, w, b):
            return sum(t.astype(jnp.float32).sum() for t in jax.tree.leaves(f(x, r, w, b)))
        grad = jax.grad(loss, argnums=(0, 1, 2, 3))
        for how, step in (("jit", grad), ("shard_map", jax.shard_map(
                grad, mesh=mesh, in_specs=(spec, spec, P(), P()),
                out_specs=(spec, spec, P(), P())))):
            if how == "shard_map" and layout != "rows":
                continue
            hlo = jax.jit(step).lower(x, r, w, b).compile().as_text()
            out[f"{layout} {how} {name}"] = stats(hlo.splitlines())
print(json.dumps(out))
"""


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_jit_over_a_mesh_splits_the_rows(partitioner):
    """Under jax.jit on a mesh of two (CPU) devices, compiled, not run: x split by rows stays
    split (each kernel call takes its device's 12 of 24 rows, no all-gather), only dw and db are
    summed across devices (all-reduce), and so under jax.shard_map (the weights' gradients
    summed as JAX's own ops sum them); x split along its width is gathered and each device
    runs all 24 rows. With either of XLA's partitioners (Shardy, JAX's default, and GSPMD)."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("cupyln.jax")
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        pytest.skip("this JAX has one partitioner")
    cmd = [sys.executable, "-c", SHARDED, partitioner]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("layer_norm", "rms_norm", "add_rms_norm", "add_layer_norm"):
        width = got[f"width jit {name}"]
        for rows in (got[f"rows jit {name}"], got[f"rows shard_map {name}"]):
            assert len(rows["calls"]) == 2 and rows["gathers"] == 0, (name, rows)
            assert all(c.startswith(("(bf16[12,32]", "(f32[12,32]")) for c in rows["calls"]), rows
            summed = 1 if name.startswith(("rms", "add_rms")) else 2  # dw; dw and db
            assert len(rows["reduces"]) == 1, rows
            assert rows["reduces"][0].count("f32[32]") == summed, rows
        assert width["gathers"] > 0 and all("[24,32]" in c for c in width["calls"]), width


QUANT_SHARDED = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import cupyln.jax as cj

cj._KERNELS_ON_CPU = True
jax.config.update("jax_use_shardy_partitioner", sys.argv[1] == "shardy")
mesh = jax.make_mesh((2,), ("d",))
w, b = jnp.ones(32, jnp.float32), jnp.zeros(32, jnp.float32)
x = jax.device_put(jnp.ones((4, 6, 32), jnp.bfloat16), NamedSharding(mesh, P("d")))
r = jax.device_put(jnp.ones((4, 6, 32), jnp.bfloat16), NamedSharding(mesh, P("d")))
calls = {
    "mxfp8": lambda x, r: cj.rms_norm(x, w, quant="mxfp8"),
    "nvfp4": lambda x, r: cj.add_layer_norm(x, r, w, b, quant="nvfp4",
                                            global_amax=jnp.float32(4.0))[0],
    "fp8_row": lambda x, r: cj.rms_norm(x, w, quant="fp8_row", scale_ub=2.0),
    "cublas": lambda x, r: cj.rms_norm(x, w, quant="mxfp8", scale_layout="cublas"),
}
out = {}
for name, f in calls.items():
    lines = jax.jit(f).lower(x, r).compile().as_text().splitlines()
    out[name] = {
        "calls": [l.split(" = ")[1].split(" custom-call(")[0] for l in lines
                  if " custom-call(" in l and "callback" in l],
        "gathers": sum(" all-gather(" in l for l in lines),
    }
print(json.dumps(out))
"""


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
def test_quant_over_a_mesh_splits_the_rows(partitioner):
    """quant= under jax.jit on a mesh of two (CPU) devices, compiled, not run: each device
    quantizes its own 12 of 24 rows (elements, scales and h split as x), no all-gather; the
    cuBLAS layout, whose tiles span 128 rows, runs once over the gathered rows."""
    jax = pytest.importorskip("jax")
    pytest.importorskip("cupyln.jax")
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        pytest.skip("this JAX has one partitioner")
    done = subprocess.run([sys.executable, "-c", QUANT_SHARDED, partitioner],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, width in (("mxfp8", 32), ("nvfp4", 16), ("fp8_row", 32)):
        rows = got[name]
        assert len(rows["calls"]) == 1 and rows["gathers"] == 0, (name, rows)
        assert rows["calls"][0].startswith(f"(u8[12,{width}]"), (name, rows)
    cublas = got["cublas"]
    assert cublas["gathers"] > 0 and cublas["calls"][0].startswith("(u8[24,32]"), cublas
