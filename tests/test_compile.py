"""CPU tier: every kernel variant the launcher can choose compiles with NVRTC for sm_80 and
sm_90 (no GPU or driver needed), and ptxas reports no stack frame, spill stores or loads
beyond the few kernels _spill_allowed names, each by a bound."""

import re

import pytest

from cupyln import _compile, _launch
from cupyln._dtypes import TABLE

from .test_launch import CLUSTERS, NS, SMEM_A100, SMEM_H100, _vecs

DTYPES = list(TABLE)
ARCHS = (80, 90)
BOUNDED_SPILL = 48  # bytes of stack, spill stores or spill loads (ln_bwd_reg_cluster only)
AHEAD_SPILL = 12  # ...and of ln_bwd_reg copying the next row ahead (AHEAD)
SM90_BOUNDS_SPILL = 8  # ...and of sm_90's forward launch bounds built for sm_80 (never run)
# ...and of the forward's stream tier at 32 registers a thread (kernels/layer_norm_fwd.cu
# ln_fwd_stream; NVRTC 12, either arch: up to 8 bytes with w and b given, bf16 blocks of 160-352
# threads of 2 packs, none where x, w or b is float16 (COHERENT_WB); 16 without one or both)
STREAM_SPILL = 8
STREAM_BARE_SPILL = 16

_REPORT = re.compile(
    r"Compiling entry function '(\w+)' for 'sm_\d+'\n"
    r".*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
    re.S,
)


def variants(x_dtype):
    """{source: sorted expressions} over every width, vector width and shared-memory limit
    (the forward's at both vector counts a thread keeps, the short one in a launch of one wave
    and of more, and the stream tier's;
    the backward's for long and short launches),
    plus every w/b dtype pairing for two register-tier, one row-tier and one ring-tier shapes
    (the ring tier's kernel is in the jagged source) with and without clusters, and a backward
    register and cluster tier.
    The cluster kernels build for sm_80 without their cluster attribute (they never run there)."""
    out = {_compile.FWD_SOURCE: set(), _compile.BWD_SOURCE: set(), _compile.JAG_SOURCE: set()}
    for smem in (SMEM_H100, SMEM_A100):
        for vec in _vecs(x_dtype):
            for n in NS:
                if n % vec == 0:
                    for p in (
                        _launch.forward_plan(
                            n, x_dtype, x_dtype, x_dtype, vec, smem, CLUSTERS[smem]
                        ),
                        _launch.forward_plan(  # long launches on fast DRAM (the stream tier)
                            n, x_dtype, x_dtype, x_dtype, vec, smem, CLUSTERS[smem], stream=True
                        ),
                        _launch.forward_plan(  # short launches (one wave: centered rows)
                            n, x_dtype, x_dtype, x_dtype, vec, smem, CLUSTERS[smem],
                            _launch.FWD_REG_ITEMS_SHORT, True,
                        ),
                        _launch.forward_plan(  # short launches of more than one wave
                            n, x_dtype, x_dtype, x_dtype, vec, smem, CLUSTERS[smem],
                            _launch.FWD_REG_ITEMS_SHORT,
                        ),
                        _launch.backward_plan(n, x_dtype, x_dtype, vec, smem, CLUSTERS[smem]),
                        _launch.backward_plan(  # short launches (more rows share blocks)
                            n, x_dtype, x_dtype, vec, smem, CLUSTERS[smem], True
                        ),
                    ):  # fmt: skip
                        out[p.source].add(p.expr)
    for vec in _vecs(x_dtype):  # the stream tier's rows past NS
        p = _launch.forward_plan(20480, x_dtype, x_dtype, x_dtype, vec, SMEM_H100, 8, stream=True)
        out[p.source].add(p.expr)
    for tw in DTYPES:
        for tb in DTYPES:
            full = 16 // x_dtype.itemsize
            for n, vec in ((4096, 1), (16384, full), (65536, 1), (65536, full)):
                p = _launch.forward_plan(n, x_dtype, tw, tb, vec, SMEM_H100)  # reg, row, ring
                out[p.source].add(p.expr)
                p = _launch.forward_plan(n, x_dtype, tw, tb, vec, SMEM_H100, 8)  # and cluster
                out[p.source].add(p.expr)
                for affine in ((True, True), (True, False), (False, True), (False, False)):
                    p = _launch.forward_plan(
                        n, x_dtype, tw, tb, vec, SMEM_H100, 8, stream=True, affine=affine
                    )
                    out[p.source].add(p.expr)  # and stream, with and without w and b
            for slices in (1, _launch.PARTIAL_REDUCE_FEW):  # partial_reduce_shape
                for cols in (8, 32):
                    y = _launch.partial_reduce_shape(4096, slices, 132)[1]
                    out[_compile.BWD_SOURCE].add(_launch.reduce_expr(x_dtype, tw, tb, cols, y))
        for n, vec in ((4096, 1), (32768, 16 // x_dtype.itemsize)):  # reg, cluster
            p = _launch.backward_plan(n, x_dtype, tw, vec, SMEM_H100, _launch.MAX_CLUSTER)
            out[_compile.BWD_SOURCE].add(p.expr)
    out[_compile.BWD_SOURCE].add(_launch.dwdb_cols_expr(x_dtype))
    return {k: sorted(v) for k, v in out.items()}


def _spill_allowed(expr: str, arch: int = 90) -> int:
    """Bytes of stack frame, spill stores and spill loads a kernel variant may report."""
    if expr.startswith("cupyln::ln_fwd_stream<"):
        return STREAM_SPILL if expr.endswith(", true, true>") else STREAM_BARE_SPILL
    if arch < 90 and expr.startswith("cupyln::ln_fwd_reg<"):
        # sm_90's launch bounds (FWD_LEAN_THREADS as loaded, FWD_REG_THREADS for centered rows
        # in a launch of one wave): taken only on devices with clusters
        tail = expr[:-1].split(", ")[6:9]
        threads = int(tail[0]) * int(tail[1])
        centered = tail[2] == "true"
        if threads > (_launch.FWD_CENTER_THREADS if centered else _launch.FWD_REG_THREADS):
            return SM90_BOUNDS_SPILL
    if expr.startswith("cupyln::ln_bwd_reg_cluster<"):
        return BOUNDED_SPILL
    if expr.startswith("cupyln::ln_bwd_reg<") and expr[:-1].split(", ")[6] == "true":
        return AHEAD_SPILL
    return 0


def test_spill_allowances():
    """Only the two backward register kernels, the second only with AHEAD, the forward's
    stream tier, and on sm_80 the forward's sm_90 launch bounds."""
    bf16 = "cupyln::bf16_t"
    cluster = f"cupyln::ln_bwd_reg_cluster<{bf16}, {bf16}, 8, 4, 256, 8, true>"
    assert _spill_allowed(cluster) == 48
    ahead = f"cupyln::ln_bwd_reg<{bf16}, {bf16}, 8, 2, 512, 512, true, true, true>"
    assert _spill_allowed(ahead) == AHEAD_SPILL
    small = f"cupyln::ln_bwd_reg<{bf16}, {bf16}, 8, 2, 64, 64, false, false, false>"
    assert _spill_allowed(small) == 0
    assert (
        _spill_allowed(f"cupyln::ln_fwd_reg<{bf16}, {bf16}, {bf16}, 8, 8, 512, 512, 2, false, 0>")
        == 0
    )
    lean = f"cupyln::ln_fwd_reg<{bf16}, {bf16}, {bf16}, 8, 4, 384, 384, 4, false, 0>"
    assert _spill_allowed(lean) == 0 and _spill_allowed(lean, 80) == 8
    wave = f"cupyln::ln_fwd_reg<{bf16}, {bf16}, {bf16}, 8, 4, 64, 64, 16, true, 4>"
    assert _spill_allowed(wave) == 0 and _spill_allowed(wave, 80) == 8
    many = f"cupyln::ln_fwd_reg<{bf16}, {bf16}, {bf16}, 8, 4, 64, 64, 12, true, 4>"
    assert _spill_allowed(many, 80) == 0
    shape = "8, 512, 512, 4, 4, false, false, false"
    stream = f"cupyln::ln_fwd_stream<{bf16}, {bf16}, {bf16}, {shape}, true, true>"
    assert _spill_allowed(stream) == _spill_allowed(stream, 80) == STREAM_SPILL == 8
    bare = f"cupyln::ln_fwd_stream<{bf16}, {bf16}, {bf16}, {shape}, true, false>"
    assert _spill_allowed(bare) == _spill_allowed(bare, 80) == STREAM_BARE_SPILL == 16


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", [_compile.FWD_SOURCE, _compile.BWD_SOURCE, _compile.JAG_SOURCE])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: d.name)
def test_every_variant_compiles_without_spills(x_dtype, source, arch):
    exprs = variants(x_dtype)[source]
    cubin, log, lowered = _compile.compile_cubin(source, exprs, arch)
    assert cubin[:4] == b"\x7fELF"
    reports = {m.group(1): tuple(map(int, m.group(2, 3, 4))) for m in _REPORT.finditer(log)}
    names = {v: k for k, v in lowered.items()}
    assert set(reports) == set(names), "ptxas did not report every kernel"
    spilled = {names[f]: r for f, r in reports.items() if any(r)}
    # the backward's register clusters, two rows a thread, spill a value in some shapes (bf16
    # blocks of 160 threads: 4 bytes at 136 registers a thread); they measured faster than
    # every other tier anyway (cupyln/_launch.py _bwd_reg_cluster), so they may, up to
    # BOUNDED_SPILL bytes each. The register rows that copy the next row ahead issue those
    # copies before the block's barrier (kernels/layer_norm_bwd.cu); at 64 or 80 registers
    # ptxas then spills a value or two in some (fp16 blocks of 384 threads with w staged: 12
    # bytes of spill stores), measured faster anyway
    spilled = {e: r for e, r in spilled.items() if any(b > _spill_allowed(e, arch) for b in r)}
    assert not spilled, f"stack frame / spill stores / spill loads: {spilled}"


def jagged_variants(x_dtype):
    """Every jagged kernel role for both offset types and vector widths, with w/b of x's dtype
    and of float32, and every short-kernel shape: forward block and warp groups (16 and 8 warps
    per block), backward sharing an SM or alone on it."""
    out = set()
    warp8 = 16384 // (256 * x_dtype.itemsize)  # a 16 KB sequence: 8 warps' rings fit
    for tw in {x_dtype, TABLE_F32}:
        for o in ("int", "long long"):
            for vec in _vecs(x_dtype):
                for seqlen in (None, 1, warp8, 128):
                    fwd = _launch.jagged_plan(256, x_dtype, vec, SMEM_H100, seqlen, False)
                    bwd = _launch.jagged_plan(256, x_dtype, vec, SMEM_H100, seqlen, True)
                    out.update(_launch.jagged_exprs(x_dtype, tw, tw, o, vec, fwd, bwd).values())
            out.add(_launch.jagged_check_expr(o))
    return sorted(out)


TABLE_F32 = next(d for d in TABLE if d.name == "float32")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: d.name)
def test_jagged_kernels_compile_without_spills(x_dtype, arch):
    exprs = jagged_variants(x_dtype)
    _, log, lowered = _compile.compile_cubin(_compile.JAG_SOURCE, exprs, arch)
    reports = {m.group(1): tuple(map(int, m.group(2, 3, 4))) for m in _REPORT.finditer(log)}
    names = {v: k for k, v in lowered.items()}
    assert set(reports) == set(names), "ptxas did not report every kernel"
    spilled = {names[f]: r for f, r in reports.items() if any(r)}
    assert not spilled, f"stack frame / spill stores / spill loads: {spilled}"


def test_includes_are_inlined_and_hashed():
    text, digest = _compile.source(_compile.FWD_SOURCE)
    assert '#include "common.cuh"' not in text and "struct bf16_t" in text
    assert len(digest) == 64
    assert _compile.template("k", "float", 4, True) == "cupyln::k<float, 4, true>"
