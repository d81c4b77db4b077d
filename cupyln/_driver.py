"""Kernel launch through the CUDA driver with a pre-packed argument buffer.

``cupy.RawKernel.__call__`` inspects and converts every argument on each call (microseconds for
ten arguments). A ``Launcher`` instead knows its kernel's parameter layout (a ``struct`` format:
``Q`` a pointer, ``q`` int64, ``i`` int32, ``f``/``d`` float/double) and packs the values into
a buffer laid out as the C parameters are (native alignment), then hands ``cuLaunchKernel``
that one buffer (``extra``: CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE) instead of a pointer per
parameter. The driver copies the parameters before it returns, so the buffer is reused; each
thread has its own, because the launch releases the GIL.

A ``Launcher`` made with ``after_prior=True`` launches through ``cuLaunchKernelEx`` (called through
ctypes; CuPy binds only ``cuLaunchKernel``) with programmatic stream serialization: on sm_90 the
kernel may start before the kernel ahead of it on the stream has finished, and it must call
``wait_prior_grid()`` (kernels/common.cuh) before reading anything that kernel wrote. Where the
driver lacks the call, it launches as any other.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading

_module = []


def _driver():
    """CuPy's binding of the driver API (imported on first launch: importing cupyln needs no
    CuPy)."""
    if not _module:
        from cupy_backends.cuda.api import driver

        _module.append(driver)
    return _module[0]


# cuda.h: the `extra` options of cuLaunchKernel that pass all parameters as one buffer
_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0
# cuda.h: CUlaunchAttributeID of programmatic stream serialization
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# CUlaunchConfig up to numAttrs: grid (3), block (3), shared bytes, stream, attrs, numAttrs
_CONFIG = struct.Struct("@7IQQI")


@functools.cache
def _launch_kernel_ex():
    """cuLaunchKernelEx from the driver library (not bound by CuPy), or None."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


class _Buffer:
    """One thread's argument buffer for one parameter layout."""

    __slots__ = ("data", "extra", "config", "attrs", "_size", "_options", "_attr")

    def __init__(self, layout: struct.Struct):
        self.data = ctypes.create_string_buffer(max(8, layout.size))  # malloc: 16-aligned
        self._size = ctypes.c_size_t(layout.size)
        self._options = (ctypes.c_void_p * 5)(
            _PARAM_BUFFER_POINTER,
            ctypes.addressof(self.data),
            _PARAM_BUFFER_SIZE,
            ctypes.addressof(self._size),
            _PARAM_END,
        )
        self.extra = ctypes.addressof(self._options)  # the arrays live as long as the buffer
        # cuLaunchKernelEx's CUlaunchConfig and its one CUlaunchAttribute (id, padding to 8
        # bytes, a 64-byte value whose first int enables programmatic stream serialization)
        self._attr = ctypes.create_string_buffer(72)
        struct.pack_into("@i4xi", self._attr, 0, _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
        self.attrs = ctypes.addressof(self._attr)
        self.config = ctypes.create_string_buffer(ctypes.sizeof(_LaunchConfig))


class Launcher:
    """Launches one compiled kernel (a ``cupy.RawKernel``) whose parameters have ``fmt``."""

    __slots__ = ("kernel", "fmt", "_func", "_layout", "_local", "_ex", "_launch")

    def __init__(self, kernel, fmt: str, after_prior: bool = False):
        self.kernel = kernel
        self.fmt = fmt
        self._func = kernel.kernel.ptr
        self._layout = struct.Struct("@" + fmt)  # C's layout: each value at its alignment
        self._local = threading.local()
        self._ex = _launch_kernel_ex() if after_prior else None
        self._launch = _driver().launchKernel

    def __call__(self, grid, block, smem: int, stream: int, *args) -> None:
        """Launch on ``stream`` (a raw CUstream; 0 is the legacy default stream) with the
        current device's context. ``grid``/``block`` are ints or (x, y) pairs."""
        try:
            buf = self._local.buf
        except AttributeError:  # this thread's first launch of the kernel
            buf = self._local.buf = _Buffer(self._layout)
        self._layout.pack_into(buf.data, 0, *args)
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        bx, by = (block, 1) if isinstance(block, int) else block
        if self._ex is None:
            self._launch(self._func, gx, gy, 1, bx, by, 1, smem, stream, 0, buf.extra)
            return
        config = buf.config
        _CONFIG.pack_into(config, 0, gx, gy, 1, bx, by, 1, smem, stream, buf.attrs, 1)
        status = self._ex(ctypes.addressof(config), self._func, None, buf.extra)
        if status:
            _driver().check_status(status)


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of the driver API (cuda.h)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("smem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _max_active_clusters_fn():
    """cuOccupancyMaxActiveClusters from the driver library (not bound by CuPy), or None."""
    try:
        return ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    except (OSError, AttributeError):
        return None


def max_active_clusters(kernel, cluster: int, block: int, smem: int):
    """Clusters of ``kernel`` (compiled with ``__cluster_dims__(cluster, 1, 1)``) that the
    device holds at once, from ``cuOccupancyMaxActiveClusters`` (called through ctypes).
    Clusters must fit one GPC, so this can be less than SMs / cluster, and 0 where none fits.
    None where the driver library or the call is unavailable, or the call fails."""
    fn = _max_active_clusters_fn()
    if fn is None:
        return None
    config = _LaunchConfig((cluster, 1, 1), (block, 1, 1), smem, None, None, 0)
    count = ctypes.c_int(0)
    err = fn(ctypes.byref(count), ctypes.c_void_p(kernel.kernel.ptr), ctypes.byref(config))
    return count.value if err == 0 else None
