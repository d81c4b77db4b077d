"""The launcher: plans become compiled kernels and launches. The only caller of the compile
and driver layers, for the dense kernels and the jagged ones alike. By job:

- ``device``: the GPU as the plans see it (or an emulated profile), residency of kernels;
- ``dense``: the forward and backward of a ``Problem`` on raw pointers and a raw stream;
- ``jagged``: the jagged kernels of a problem, the offsets' check and clamp;
- ``ahead``: compiling every kernel a problem can take before a CUDA-graph capture;
- ``cache``: every cache of the launcher, registered so that ``forget_plans`` drops them all.
"""

from .ahead import precompile
from .cache import forget as forget_plans
from .cache import set_plan_constant
from .dense import (
    BWD_ARGS,
    FWD_ARGS,
    NO_QUANT,
    add_launch,
    backward_launch,
    describe_kernels,
    dwdb_cols,
    forward_launch,
    forward_launch_at,
    launch_backward,
    launch_forward,
    partial_reduce,
    vector_widths,
)
from .device import capacity, check_arch, device, emulate, emulated, function
from .jagged import (
    Jagged,
    JaggedKernels,
    jagged,
    jagged_check,
    jagged_clamp,
    launch_jagged_backward,
    launch_jagged_forward,
)

__all__ = [
    "BWD_ARGS",
    "FWD_ARGS",
    "NO_QUANT",
    "Jagged",
    "JaggedKernels",
    "add_launch",
    "backward_launch",
    "capacity",
    "check_arch",
    "describe_kernels",
    "device",
    "dwdb_cols",
    "emulate",
    "emulated",
    "forget_plans",
    "forward_launch",
    "forward_launch_at",
    "function",
    "jagged",
    "jagged_check",
    "jagged_clamp",
    "launch_backward",
    "launch_jagged_backward",
    "launch_jagged_forward",
    "launch_forward",
    "partial_reduce",
    "precompile",
    "set_plan_constant",
    "vector_widths",
]
