"""What the plans read of a GPU (``Device``), and the profiles of the GPUs cupyln supports.

The launcher reads a ``Device`` off the CUDA device attributes. The profiles hold the same
fields as the vendors' data sheets and the CUDA Programming Guide's tables give them; the tests
and the benchmark plan with one of them on another GPU (``_launcher.emulate``) to run the plans
another GPU would get. Plain data: no GPU, no arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import MAX_CLUSTER

MIN_ARCH = 80  # the kernels use cp.async and bf16 conversions: Ampere (sm_80) and newer

KB, MB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Device:
    """A GPU as the plans see it."""

    name: str
    arch: int  # compute capability times ten: 80, 86, 89, 90, 100, 120
    sm_count: int
    smem_block: int  # opt-in shared bytes a block may have
    smem_sm: int  # shared bytes an SM has
    l2_bytes: int
    threads_sm: int  # resident threads an SM
    clusters: bool  # thread-block cluster launches (the device's ClusterLaunch attribute)
    dram: float  # peak DRAM bytes a second (0: not reported)

    @property
    def max_cluster(self) -> int:
        """Blocks a thread-block cluster of the kernels may have (1: no clusters)."""
        return MAX_CLUSTER if self.clusters else 1

    @property
    def dram_per_sm(self) -> float:
        return self.dram / self.sm_count


def _profile(name, arch, sms, smem_block, smem_sm, l2, threads, clusters, dram) -> Device:
    return Device(name, arch, sms, smem_block, smem_sm, l2, threads, clusters, dram)


#: Supported GPUs by family, one of each kind of limit: what ``emulate`` plans for.
PROFILES: dict[str, Device] = {
    "a100": _profile(
        "NVIDIA A100-SXM4-80GB", 80, 108, 163 * KB, 164 * KB, 40 * MB, 2048, False, 2.039e12
    ),  # fmt: skip
    "a10": _profile("NVIDIA A10", 86, 72, 99 * KB, 100 * KB, 6 * MB, 1536, False, 600e9),
    "l4": _profile("NVIDIA L4", 89, 58, 99 * KB, 100 * KB, 48 * MB, 1536, False, 300e9),
    "rtx4090": _profile(
        "NVIDIA GeForce RTX 4090", 89, 128, 99 * KB, 100 * KB, 72 * MB, 1536, False, 1.008e12
    ),  # fmt: skip
    "h200": _profile("NVIDIA H200", 90, 132, 227 * KB, 228 * KB, 50 * MB, 2048, True, 4.8e12),
    "b200": _profile("NVIDIA B200", 100, 148, 227 * KB, 228 * KB, 126 * MB, 2048, True, 8e12),
    "rtx5090": _profile(
        "NVIDIA GeForce RTX 5090", 120, 170, 99 * KB, 100 * KB, 96 * MB, 1536, True, 1.792e12
    ),  # fmt: skip
}

#: The architectures the kernels are built and checked for (tests/test_compile.py), each with
#: the profiles whose plans it runs.
ARCHS: dict[int, tuple[str, ...]] = {
    80: ("a100",),
    86: ("a10",),
    89: ("l4", "rtx4090"),
    90: ("h200",),
    100: ("b200",),
    120: ("rtx5090",),
}


def unsupported(name: str, arch: int) -> str | None:
    """Why a GPU of compute capability ``arch`` cannot run cupyln, or None where it can."""
    if arch >= MIN_ARCH:
        return None
    return (
        f"cupyln needs an NVIDIA GPU of compute capability {MIN_ARCH // 10}.{MIN_ARCH % 10} "
        f"(Ampere) or newer; {name} has compute capability {arch // 10}.{arch % 10}"
    )
