"""What every plan is made of: the ``Plan`` record, the kernels' template signatures, and the
small shape arithmetic the tiers share. Pure functions of integers and dtypes: no GPU, no
arrays, no kernel sources."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

# The policies every dense kernel takes first (kernels/policy.cuh): what a row is (x, or
# x + residual -> h), and what the norm writes (which statistics, y's dtype, w and b).
LOAD = ("Load", ("T", "TR", "TH"))
STORE = ("Store", ("RMS", "TY", "TW", "TB", "QF", "QB", "QO"))
# What a kernel record may leave out: no residual, y of x's dtype, y not quantized (QF: the
# format's code in kernels/policy.cuh, QB: elements a scale covers, QO: option bits).
DEFAULTS = {"TR": None, "TH": None, "TY": "T", "QF": 0, "QB": 0, "QO": 0}
# Policy parameters whose C++ defaults a name expression leaves out where they are trailing.
TRAILING = {"QF": 0, "QB": 0, "QO": 0}

# Each kernel's template arguments, in the order kernels/*.cu declares them: a parameter, or a
# policy (its name, its parameters). A plan names its parameters; the compile layer renders
# them in this order, each policy as ``cupyln::Name<...>``.
SIGNATURES: dict[str, tuple] = {
    "ln_fwd_reg": (LOAD, STORE, "VEC", "ITEMS", "TPR", "BLOCK", "MINB", "CENTER", "WHOLE"),
    "ln_fwd_stream": (
        LOAD,
        STORE,
        "VEC",
        "TPR",
        "BLOCK",
        "NCH",
        "MINB",
        "PARTIAL",
        "ROLL",
        "COHERENT_WB",
    ),  # fmt: skip
    "ln_fwd_reg_cluster": (LOAD, STORE, "VEC", "ITEMS", "BLOCK", "C", "MINB", "STAGE_WB", "LAG"),
    "ln_fwd_ring": (LOAD, STORE, "VEC", "BLOCK", "GROUP"),
    "ln_fwd_cluster": (LOAD, STORE, "VEC", "BLOCK", "C"),
    "ln_fwd_row": (LOAD, STORE, "VEC", "BLOCK", "STAGE"),
    "ln_fwd_add": (LOAD, "VEC"),
    "ln_bwd_reg": (
        LOAD,
        STORE,
        "VEC",
        "ITEMS",
        "TPR",
        "BLOCK",
        "AHEAD",
        "SHARED_SUMS",
        "STAGE_W",
    ),  # fmt: skip
    "ln_bwd_reg_cluster": (LOAD, STORE, "VEC", "ITEMS", "BLOCK", "C", "STAGE_W"),
    "ln_bwd_ring": (LOAD, STORE, "VEC", "ITEMS", "BLOCK"),
    "ln_bwd_cluster": (LOAD, STORE, "VEC", "ITEMS", "BLOCK", "C", "LAG"),
    "ln_bwd_row": (LOAD, STORE, "VEC", "BLOCK", "STAGE"),
    "ln_bwd_dwdb_cols": (LOAD, STORE),
    "ln_partial_reduce": ("A", "TW", "TB", "Y", "C"),
    "jag_partition": ("I",),
    "jag_check_offsets": ("I",),
    "jag_clamp_offsets": ("I",),
    "jag_fwd_short": ("T", "TW", "TB", "I", "VEC", "BLOCK", "GROUP"),
    "jag_fwd_partial": ("T", "I", "VEC", "BLOCK"),
    "jag_combine": ("A", "I", "FORWARD", "BLOCK"),
    "jag_fwd_apply": ("T", "TW", "TB", "I", "VEC", "BLOCK"),
    "jag_bwd_short": ("T", "TW", "I", "VEC", "BLOCK", "UNROLL"),
    "jag_bwd_partial": ("T", "TW", "I", "VEC", "BLOCK"),
    "jag_bwd_apply": ("T", "TW", "I", "VEC", "BLOCK"),
    "jag_expand_stats": ("A", "I"),
}


@cache
def params(name: str) -> tuple[str, ...]:
    """Kernel ``name``'s parameters, its policies' spelled out, in order."""
    out: list[str] = []
    for p in SIGNATURES[name]:
        out.extend(p[1] if isinstance(p, tuple) else (p,))
    return tuple(out)


STATIC_SMEM_MARGIN = 1024  # the kernels' own static shared memory (reductions), bytes
MAX_CLUSTER = 8  # the portable thread-block cluster size limit
MAX_GRID = 2**31 - 1  # blocks in a grid's x dimension; the kernels' row loops take the rest
ROW_BLOCK = 256  # row tiers: blocks that share an SM overlap their phases


@dataclass(frozen=True)
class Kernel:
    """One template instantiation: a kernel of kernels/*.cu and its template arguments (NumPy
    dtypes for element types, ints, bools), in SIGNATURES order."""

    name: str
    args: tuple

    def arg(self, param: str):
        """The argument of template parameter ``param`` (e.g. ``"CENTER"``, or a policy's
        ``"RMS"``)."""
        return self.args[params(self.name).index(param)]


def kernel(name: str, **args) -> Kernel:
    """``Kernel(name, ...)`` from keyword arguments named as the template's parameters (its
    policies' spelled out; those of DEFAULTS may be left out)."""
    names = params(name)
    for p, d in DEFAULTS.items():
        if p in names and p not in args:
            args[p] = args[d] if d in names else d
    if set(args) != set(names):
        raise TypeError(f"{name} takes {names}; got {tuple(args)}")
    return Kernel(name, tuple(args[p] for p in names))


@dataclass(frozen=True)
class Plan:
    """One launch shape: the kernel, then ``rows`` rows per block of ``block`` threads, ``tpr``
    threads a row each keeping ``items`` packs of ``vec`` elements, ``smem`` dynamic shared
    bytes, ``cluster`` blocks per thread-block cluster, and ``threads`` an SM that the launch
    bounds ask for (0: none)."""

    kernel: Kernel
    tier: str  # "reg", "stream", "ring", "cluster" or "row"
    vec: int
    items: int
    tpr: int
    block: int
    rows: int
    smem: int
    cluster: int = 1
    threads: int = 0
    unfused: bool = False  # a residual add the kernel does not fuse: ln_fwd_add runs first

    def arg(self, param: str):
        return self.kernel.arg(param)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def staged(elements: int, itemsize: int) -> int:
    """Shared bytes staging ``elements`` elements of ``itemsize`` (a 16-byte multiple)."""
    return cdiv(elements * itemsize, 16) * 16


def slice_packs(n: int, vec: int, cluster: int) -> int:
    """Packs of VEC elements in the widest of ``cluster`` blocks' column slices of a row."""
    return cdiv(cdiv(n, vec), cluster)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def share(smem_limit: int, blocks: int = 1) -> int:
    """Dynamic shared bytes of each of ``blocks`` blocks sharing an SM (16-byte multiple)."""
    return (smem_limit // blocks - STATIC_SMEM_MARGIN) // 16 * 16


def async_copyable(vec: int, itemsize: int) -> bool:
    """cp.async copies packs of 4, 8 or 16 bytes (ring.cuh)."""
    return vec * itemsize >= 4


def vector_width(itemsize: int, n: int, strides=(), pointers=()) -> int:
    """Largest VEC (elements, VEC * itemsize <= 16 bytes) dividing N and every row stride, with
    every pointer aligned to VEC * itemsize bytes. 1 is the scalar path."""
    vec = 16 // itemsize
    while vec > 1:
        if (
            n % vec == 0
            and all(s % vec == 0 for s in strides)
            and all(p % (vec * itemsize) == 0 for p in pointers)
        ):
            return vec
        vec //= 2
    return 1


def grid_size(m: int, rows_per_block: int, capacity: int) -> int:
    """Blocks for M rows: one per group of rows, at most the resident capacity (persistent).
    For a plan of thread-block clusters: clusters, and ``capacity`` in clusters."""
    return max(1, min(cdiv(m, rows_per_block), capacity))


# ------------------------------------------------------------- register rows (both directions)
MAX_ITEMS = 8  # pack slots a thread: 16 unrolled scalar slots spill in the backward
MIN_TPR = 4  # small rows still get several independent 16-byte loads a warp row
SUBWARP_BLOCK = 128  # blocks of rows of a warp or less
REG_BLOCK_STEP = 64  # a block a row: sized to the row in steps of this many threads...
REG_BLOCK_MAX = 512  # ...up to this many (1024-thread blocks cap a thread at 64 registers)


def reg_shape(n: int, vec: int, values: int, block_max: int, step: int = REG_BLOCK_STEP):
    """(tpr, items, block) of a register row, or None when no block of ``block_max`` threads
    holds it at ``values`` elements a thread. Rows of up to a warp's worth: the fewest threads
    (a power of two, at least MIN_TPR) that hold them, ITEMS a power of two (unused slots are
    predicated off), SUBWARP_BLOCK threads a block. Wider rows: the full budget a thread, a
    block sized to the row in steps of ``step`` threads."""
    nvec = cdiv(n, vec)
    items_max = max(1, min(MAX_ITEMS, values // vec))
    if nvec <= 32 * items_max:
        tpr = min(32, max(MIN_TPR, pow2_at_least(cdiv(nvec, items_max))))
        return tpr, pow2_at_least(cdiv(nvec, tpr)), SUBWARP_BLOCK
    block = cdiv(cdiv(nvec, items_max), step) * step
    if block <= block_max:
        return block, items_max, block
    return None
