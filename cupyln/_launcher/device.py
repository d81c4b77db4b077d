"""The device as the plans see it (read off its attributes, or an emulated profile), and the
compiled kernels' residency on it."""

from __future__ import annotations

from .. import _compile, _runtime
from .._driver import max_active_clusters
from .._plans.devices import PROFILES, Device, unsupported
from .cache import cached, forget

# cudaDeviceAttr values (the CUDA runtime's enum) of what the plans read
_ATTRS = dict(sm_count=16, smem_block=97, smem_sm=81, l2_bytes=38, threads_sm=39,
              memory_khz=36, bus_bits=37, clusters=120)  # fmt: skip

_emulated: list = []  # [profile name] while emulate() holds one


def check_arch(name: str, arch: int) -> None:
    """Refuse a GPU older than MIN_ARCH, by name, before anything is compiled for it."""
    why = unsupported(name, arch)
    if why is not None:
        raise RuntimeError(why)


@cached(maxsize=None)
def device(device_id: int) -> Device:
    """The device as the plans see it, read off its attributes (or the profile ``emulate``
    holds, where the device can run its plans)."""
    cp = _runtime.cupy()
    rt = cp.cuda.runtime
    arch = int(cp.cuda.Device(device_id).compute_capability)
    name = rt.getDeviceProperties(device_id)["name"].decode()
    check_arch(name, arch)

    def attr(key: str) -> int:
        try:
            return rt.deviceGetAttribute(_ATTRS[key], device_id)
        except rt.CUDARuntimeError:  # not known to this driver
            return 0

    # double data rate: 2 transfers a memory clock (kHz) over the bus (bits)
    dram = 2e3 * attr("memory_khz") * attr("bus_bits") / 8
    keys = ("sm_count", "smem_block", "smem_sm", "l2_bytes", "threads_sm")
    own = Device(name, arch, *(attr(k) for k in keys), arch >= 90 and attr("clusters") > 0, dram)
    if not _emulated:
        return own
    profile = PROFILES[_emulated[0]]
    if profile.smem_block > own.smem_block or (profile.clusters and not own.clusters):
        raise RuntimeError(f"{name} cannot run the plans of {profile.name}: they take more "
                           "shared memory a block or clusters it lacks")  # fmt: skip
    return profile


def emulate(profile: str | None) -> None:
    """Plan as on the GPU of ``PROFILES[profile]`` from now on (None: as on the device itself),
    for the tests and the benchmark: the kernels still compile for the device in use and run
    on it. Drops every cached plan."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}; got {profile!r}")
    _emulated[:] = [] if profile is None else [profile]
    forget()


def emulated() -> str | None:
    """The profile ``emulate`` holds, or None."""
    return _emulated[0] if _emulated else None


def function(k, device_id: int, smem: int):
    """The compiled kernel of record ``k``; kernels that take dynamic shared memory get the
    device's opt-in limit. (Reading the device first refuses one older than MIN_ARCH before
    anything compiles.)"""
    limit = device(device_id).smem_block
    return _compile.function(k, device_id, limit if smem else 0)


def capacity(f, block: int, smem: int, device_id: int, cluster: int = 1) -> int:
    """Resident blocks of compiled kernel ``f`` on the whole device (a persistent grid's size);
    for a kernel of thread-block clusters, resident clusters: 0 where the driver reports that
    none fits (SMs / cluster where the driver cannot tell)."""
    from cupy_backends.cuda.api import driver

    sms = device(device_id).sm_count
    if cluster > 1:
        clusters = max_active_clusters(f, cluster, block, smem)
        return max(1, sms // cluster) if clusters is None else clusters
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, block, smem)
    return max(1, per_sm) * sms


def placed(device_id: int, make):
    """(plan, compiled kernel, resident blocks) of ``make(max_cluster)``: the plan at the
    device's largest cluster, or the plan without clusters where none of its clusters fits."""
    plan = make(device(device_id).max_cluster)
    f = function(plan.kernel, device_id, plan.smem)
    cap = capacity(f, plan.block, plan.smem, device_id, plan.cluster)
    if cap == 0:
        plan = make(1)
        f = function(plan.kernel, device_id, plan.smem)
        cap = capacity(f, plan.block, plan.smem, device_id)
    return plan, f, cap
