"""cupyln: LayerNorm and RMSNorm for NVIDIA GPUs on CuPy arrays (forward, dx, dw/db), with
the residual add fused in front of either; CUDA C kernels compiled at run time with NVRTC;
torch and JAX bridges in ``cupyln.torch`` and ``cupyln.jax``.

    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd)
    y, rstd, h = cupyln.rms_forward(x, w, residual=r)
    dx, dw = cupyln.rms_backward(dy, h, w, rstd, dh=dh)
"""

from ._api import (
    backward,
    describe,
    forward,
    layer_norm,
    rms_backward,
    rms_forward,
    rms_norm,
)
from ._control import precompile
from ._formats import Quantized
from ._jagged import jagged_backward, jagged_forward, jagged_layer_norm

__version__ = "0.3.0"
__all__ = [
    "forward",
    "backward",
    "layer_norm",
    "rms_forward",
    "rms_backward",
    "rms_norm",
    "jagged_forward",
    "jagged_backward",
    "jagged_layer_norm",
    "describe",
    "precompile",
    "Quantized",
    "__version__",
]
