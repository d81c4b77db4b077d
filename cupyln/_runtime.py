"""CuPy and the CUDA runtime as the array API, the launcher and the bridges use them: CuPy
imported on first use (importing cupyln needs none), the current device, context and stream,
external (framework) streams, and allocation from CuPy's pool."""

from __future__ import annotations

from functools import cache

loaded: list = []  # [cupy, Cuda], filled on first use; the hot paths read loaded[1] directly


class Cuda:
    """The CuPy and driver functions the hot paths call, looked up once."""

    __slots__ = ("ndarray", "alloc", "device", "context", "stream")

    def __init__(self, cupy):
        from cupy_backends.cuda.api import driver

        self.ndarray = cupy.ndarray
        self.alloc = cupy.cuda.alloc  # the current allocator (cupy.cuda.set_allocator)
        self.device = cupy.cuda.runtime.getDevice
        self.context = driver.ctxGetCurrent
        self.stream = cupy.cuda.get_current_stream


def cupy():
    """The cupy module."""
    if not loaded:
        try:
            import cupy as cp
        except ImportError as err:
            raise ModuleNotFoundError(
                "cupyln needs CuPy, which comes with an extra for the machine's CUDA driver: "
                'pip install "cupyln[cuda12]" (or "cupyln[cuda13]")',
                name="cupy",
            ) from err

        loaded.extend((cp, Cuda(cp)))
    return loaded[0]


def cuda() -> Cuda:
    if not loaded:
        cupy()
    return loaded[1]


def is_current(device_id: int) -> bool:
    """Whether ``device_id`` is the current device and its context is current in this thread
    (then a launch needs no ``OnDevice``)."""
    c = cuda()
    return c.device() == device_id and bool(c.context())


class OnDevice:
    """Makes ``device_id`` current for the block when it is not already (cheap when it is)."""

    __slots__ = ("_ctx",)

    def __init__(self, device_id: int):
        cp = cupy()
        self._ctx = None
        if cp.cuda.runtime.getDevice() != device_id:
            self._ctx = cp.cuda.Device(device_id)
        elif not cuda().context():
            # a thread that has not used CUDA yet (torch's autograd thread, XLA's callback
            # thread): the driver-level launch needs the device's context made current
            cp.cuda.runtime.setDevice(device_id)

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def current_stream() -> int:
    """CuPy's current stream, as a raw CUstream."""
    return cupy().cuda.get_current_stream().ptr


class _RawStream:
    """A raw CUstream in the CUDA stream protocol (what ``cupy.cuda.Stream.from_external``
    takes)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_external_streams: dict = {}


def external_stream(device_id: int, ptr: int):
    """CuPy's Stream for a framework's raw stream ``ptr`` on ``device_id`` (cached): made
    current, CuPy's pool allocations and the CuPy calls inside are ordered on it. Call with
    ``device_id`` current."""
    s = _external_streams.get((device_id, ptr))
    if s is None:
        s = cupy().cuda.Stream.from_external(_RawStream(ptr))
        _external_streams[(device_id, ptr)] = s
    return s


def allocate(nbytes: int):
    """Memory from CuPy's current allocator, ordered on its current stream."""
    return cupy().cuda.alloc(nbytes)


def pool_workspace(nbytes: int):
    """A backward workspace (address, owner) from CuPy's pool on its current stream."""
    mem = allocate(nbytes)
    return mem.ptr, mem


@cache
def driver_version() -> int:
    return cupy().cuda.runtime.driverGetVersion()


def memset(ptr: int, nbytes: int, stream: int, value: int = 0) -> None:
    """Set ``nbytes`` at ``ptr`` to the byte ``value`` on ``stream`` (nothing for a null
    pointer or no bytes)."""
    if ptr and nbytes:
        cupy().cuda.runtime.memsetAsync(ptr, value, nbytes, stream)


def to_host(ptr: int, dtype, count: int, stream: int):
    """``count`` values of ``dtype`` at device address ``ptr``, once the work queued on
    ``stream`` before them is done (a synchronization)."""
    import numpy

    out = numpy.empty(count, dtype)
    rt = cupy().cuda.runtime
    rt.memcpyAsync(out.ctypes.data, ptr, out.nbytes, rt.memcpyDeviceToHost, stream)
    rt.streamSynchronize(stream)
    return out


def device_of(ptr: int) -> int:
    """The device that holds the memory at ``ptr``."""
    return cupy().cuda.runtime.pointerGetAttributes(ptr).device


def aligned_copy(ptr: int, nbytes: int, keep: list) -> int:
    """``ptr``, or a 64-byte-aligned copy of its ``nbytes`` made on the current stream (its
    memory appended to ``keep``, which holds it until the launches are enqueued)."""
    if ptr % 64 == 0:
        return ptr
    cp = cupy()
    mem = cp.cuda.alloc(nbytes)
    cp.cuda.runtime.memcpyAsync(mem.ptr, ptr, nbytes, 3, cp.cuda.get_current_stream().ptr)
    keep.append(mem)
    return mem.ptr
