"""CPU tier of the JAX bridge: the import error without JAX, validation before any launch."""

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
    assert "ImportError:" in out.stdout and "cupyln[jax]" in out.stdout, out.stdout + out.stderr


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


def test_cpu_arrays_are_refused():
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cupyln.jax")
    x = jax.device_put(jax.numpy.ones((4, 8)), jax.devices("cpu")[0])
    with pytest.raises(ValueError, match="must be on a GPU"):
        cj.layer_norm(x)


def test_a_computation_placed_on_the_cpu_says_it_needs_a_gpu():
    jax = pytest.importorskip("jax")
    cj = pytest.importorskip("cupyln.jax")
    x = jax.device_put(jax.numpy.ones((4, 8)), jax.devices("cpu")[0])
    with pytest.raises(Exception, match="cupyln.jax runs on GPU arrays"):
        jax.jit(cj.layer_norm)(x)
