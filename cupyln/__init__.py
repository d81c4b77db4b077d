"""cupyln: LayerNorm for NVIDIA GPUs on CuPy arrays (forward, dx, dw/db), CUDA C kernels
compiled at run time with NVRTC; torch and JAX bridges in ``cupyln.torch`` and ``cupyln.jax``.

    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
"""

from ._api import backward, describe, forward, layer_norm
from ._jagged import jagged_backward, jagged_forward, jagged_layer_norm

__version__ = "0.2.0"
__all__ = [
    "forward",
    "backward",
    "layer_norm",
    "jagged_forward",
    "jagged_backward",
    "jagged_layer_norm",
    "describe",
    "__version__",
]
