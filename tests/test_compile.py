"""CPU tier: the kernels compile with NVRTC for every supported architecture (no GPU or driver
needed) with the run-time build's options, and ptxas reports no stack frame, spill stores or
loads beyond the few kernels ``spill_allowed`` names, each by a bound.

``test_each_kernel_compiles`` builds one variant of every kernel (seconds);
``test_every_variant_compiles_without_spills`` builds, for each architecture of
``_plans.devices.ARCHS``, every variant the plans of its GPUs' profiles can return (minutes of
NVRTC builds a worker): it is marked ``sweep`` and runs with ``--sweep`` (CI does).
"""

import re
from functools import cache

import numpy as np
import pytest

from cupyln import _compile
from cupyln._dtypes import INDEX, TABLE
from cupyln._plans import backward as B
from cupyln._plans import common as C
from cupyln._plans import forward as F
from cupyln._plans import jagged as J
from cupyln._plans.common import kernel
from cupyln._plans.devices import ARCHS, PROFILES

from .test_plans import NS, SMEM_H100, _vecs

DTYPES = list(TABLE)
FILES = sorted(set(_compile.SOURCES.values()))
BOUNDED_SPILL = 48  # bytes of stack, spill stores or spill loads (ln_bwd_reg_cluster only)
AHEAD_SPILL = 12  # ...and of ln_bwd_reg copying the next row ahead (AHEAD)
# ...and of the forward's stream tier at 32 registers a thread (ln_fwd_stream, NVRTC 12, either
# arch: with w and b given; 16 without one or both)
STREAM_SPILL = 8
STREAM_BARE_SPILL = 16
# ...and of the norm family's variants (RMSNorm, a residual add, dh), whose extra values cost the
# stream tier's 32 registers and the backward's 16-bit rows a few; LayerNorm's own variants keep
# the bounds above (the family's flags are compile-time: without them the code is LayerNorm's)
FAMILY_SPILL = 64
# ...and of a quantized y's register rows (the Store holds a block's values and its scale), at
# 8 packs a thread only where the rows are too wide for 4 (16-bit rows past 32768)
QUANT_SPILL = 32
# ...and of any variant built for sm_100 or sm_120 (never run, never tuned; their launch bounds
# ask for three quarters of sm_90's threads, common.cuh's sm_blocks): blocks that cannot lower
# their register cap further (a lone block of 960 or 1024 threads at 64 registers, of 512 float64
# threads at 128) still spill a value or two there
NEWER_ARCH_SPILL = 8

_REPORT = re.compile(
    r"Compiling entry function '(\w+)' for 'sm_\d+'\n"
    r".*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
    re.S,
)


@cache
def limits(arch: int) -> tuple:
    """(shared bytes a block, largest cluster, whether long launches stream) of each distinct
    profile of ``arch``: what the plans see of those GPUs."""
    out = set()
    for name in ARCHS[arch]:
        p = PROFILES[name]
        fast = p.dram_per_sm >= F.FWD_STREAM_DRAM_PER_SM and p.threads_sm >= F.FWD_STREAM_THREADS
        out.add((p.smem_block, p.max_cluster, fast))
    return tuple(sorted(out))


def forward_modes(clusters: int, streams: bool) -> list:
    """forward_plan's keyword sets forward_launch_plan can take on such a device: the long
    launch's packs a thread, the short one's, short launches of one wave (devices with
    clusters), and the stream tier (devices that stream)."""
    modes = [{}, {"items": F.FWD_REG_ITEMS_SHORT}]
    if clusters > 1:
        modes.append({"items": F.FWD_REG_ITEMS_SHORT, "one_wave": True})
    if streams:
        modes.append({"stream": True})
    return modes


@cache  # (the parametrized tests share it: planning every variant takes seconds)
def variants(x_dtype, arch: int) -> dict:
    """{source file: kernel records} over every width, pack width and profile of ``arch``
    (forward_modes; the backward's long and short launches), plus every w/b dtype pairing for
    two register-tier, one row-tier and one ring-tier shapes (and the stream tier's with and
    without w and b), and a backward register and cluster tier; the norm family's; and the
    jagged kernels."""
    out = set()
    for smem, c, streams in limits(arch):
        modes = forward_modes(c, streams)
        for vec in _vecs(x_dtype):
            for n in NS:
                if n % vec == 0:
                    xs = (n, x_dtype, x_dtype, x_dtype, vec, smem, c)
                    out.update(F.forward_plan(*xs, **mode).kernel for mode in modes)
                    for short in (False, True):
                        out.add(B.backward_plan(n, x_dtype, x_dtype, vec, smem, c, short).kernel)
            if streams:  # the stream tier's rows past NS
                xs = (20480, x_dtype, x_dtype, x_dtype, vec, smem, c)
                out.add(F.forward_plan(*xs, stream=True).kernel)
        for tw in DTYPES:
            for tb in DTYPES:
                full = 16 // x_dtype.itemsize
                for n, vec in ((4096, 1), (16384, full), (65536, 1), (65536, full)):
                    xs = (n, x_dtype, tw, tb, vec, smem, c)
                    out.add(F.forward_plan(*xs).kernel)  # reg, row, ring, cluster
                    for affine in ((True, True), (True, False), (False, True), (False, False)):
                        if streams:  # and stream, with and without w and b
                            out.add(F.forward_plan(*xs, stream=True, affine=affine).kernel)
                for slices in (1, B.PARTIAL_REDUCE_FEW):
                    for sms in (132, 10**4):  # 32 and 8 columns a block
                        out.add(B.reduce_kernel(4096, slices, sms, x_dtype, tw, tb)[0])
            for n, vec in ((4096, 1), (32768, 16 // x_dtype.itemsize)):  # reg, cluster
                out.add(B.backward_plan(n, x_dtype, tw, vec, smem, c).kernel)
        out.update(family_variants(x_dtype, smem, c, streams))
        out.update(jagged_variants(x_dtype, smem))
    out.add(B.dwdb_cols_kernel(x_dtype))
    out.add(B.dwdb_cols_kernel(x_dtype, True))
    files: dict = {f: set() for f in FILES}
    for k in out:
        files[_compile.source_of(k.name)].add(k)
    return {f: sorted(v, key=_compile.expression) for f, v in files.items()}


@cache
def family_variants(x_dtype, smem: int = SMEM_H100, c: int = C.MAX_CLUSTER,
                    streams: bool = True) -> set:  # fmt: skip
    """The norm family's kernels on a device of these limits: RMSNorm's forward and backward
    plans, and the residual add's (h of x's dtype and of float32, with either norm), with w
    and b of x's dtype, at every width and pack width, in every forward mode; the unfused
    plans' ln_fwd_add."""
    out = set()
    f32 = np.dtype(np.float32)
    hs = [x_dtype] if x_dtype.itemsize == 8 else sorted({x_dtype, f32}, key=str)
    modes = forward_modes(c, streams)
    for n in NS:
        for h in hs:
            for rms in (False, True):
                widest = max(x_dtype.itemsize, h.itemsize)
                for vec in _vecs(x_dtype):
                    if n % vec or vec * widest > 16:
                        continue
                    xs = (n, x_dtype, x_dtype, x_dtype, vec, smem, c)
                    plans = [F.forward_plan(*xs, rms=rms, residual=(h, h), **m) for m in modes]
                    if h == x_dtype:
                        plans += [F.forward_plan(*xs, rms=rms, **m) for m in modes]
                        for short, dh in ((False, True), (False, False), (True, True)):
                            plans.append(B.backward_plan(n, x_dtype, x_dtype, vec, smem, c,
                                                         short, rms, dh))  # fmt: skip
                    for p in plans:
                        out.add(p.kernel)
                        if p.unfused:
                            out.add(F.add_kernel(x_dtype, h, h, vec))
    return out


@cache
def jagged_variants(x_dtype, smem: int = SMEM_H100) -> set:
    """Every jagged kernel role for both offset types and pack widths, with w/b of x's dtype
    and of float32, and every short-kernel shape: forward block and warp groups (16 and 8 warps
    a block), backward sharing an SM or alone on it."""
    out = set()
    warp8 = 16384 // (256 * x_dtype.itemsize)  # a 16 KB sequence: 8 warps' rings fit
    for tw in {x_dtype, np.dtype(np.float32)}:
        for o in INDEX:
            for vec in _vecs(x_dtype):
                for seqlen in (None, 1, warp8, 128):
                    fwd = J.jagged_plan(256, x_dtype, vec, smem, seqlen, False)
                    bwd = J.jagged_plan(256, x_dtype, vec, smem, seqlen, True)
                    roles = J.jagged_kernels(x_dtype, tw, tw, o, vec, fwd, bwd)
                    out.update(k for k, _, _ in roles.values())
            out.add(J.check_kernel(o))
            out.add(J.clamp_kernel(o))
    return out


def family(k) -> bool:
    """Whether kernel record ``k`` is a norm-family variant (RMSNorm's Store, or a Load with
    a residual: the forward's add, the backward's dh)."""
    params = C.params(k.name)
    rms = "RMS" in params and k.arg("RMS")
    return rms or ("TR" in params and k.name != "ln_fwd_add" and k.arg("TR") is not None)


def spill_allowed(k, arch: int = 90) -> int:
    """spill_allowed_ln's bound, or FAMILY_SPILL for the norm family's variants, at least
    QUANT_SPILL for a quantizing Store's."""
    own = spill_allowed_ln(k, arch)
    own = max(own, FAMILY_SPILL) if family(k) else own
    quant = "QF" in C.params(k.name) and k.arg("QF")
    return max(own, QUANT_SPILL) if quant else own


def spill_allowed_ln(k, arch: int = 90) -> int:
    """Bytes of stack frame, spill stores and spill loads kernel record ``k`` may report: the
    backward's register clusters, two rows a thread, spill a value in some shapes, and the
    register rows that copy the next row ahead a value or two (both measured faster than every
    alternative anyway); the stream tier at 32 registers; a value or two on sm_100 and later."""
    if arch >= 100:
        return max(spill_allowed_ln(k), NEWER_ARCH_SPILL)
    if k.name == "ln_fwd_stream":
        affine = k.arg("TW") is not None and k.arg("TB") is not None
        return STREAM_SPILL if affine else STREAM_BARE_SPILL
    if k.name == "ln_bwd_reg_cluster":
        return BOUNDED_SPILL
    if k.name == "ln_bwd_reg" and k.arg("AHEAD"):
        return AHEAD_SPILL
    return 0


def test_spill_allowances():
    """Only the two backward register kernels, the second only with AHEAD, and the forward's
    stream tier; a value or two anywhere on sm_100 and later."""
    bf = ref_bf16()

    def reg(items, tpr, block, minb, center, whole):
        return kernel("ln_fwd_reg", T=bf, RMS=False, TW=bf, TB=bf, VEC=8, ITEMS=items, TPR=tpr,
                      BLOCK=block, MINB=minb, CENTER=center, WHOLE=whole)  # fmt: skip

    def bwd(tpr, block, flag):
        return kernel("ln_bwd_reg", T=bf, RMS=False, TW=bf, TB=None, VEC=8, ITEMS=2, TPR=tpr,
                      BLOCK=block, AHEAD=flag, SHARED_SUMS=flag, STAGE_W=flag)  # fmt: skip

    def stream(has_b):
        return kernel("ln_fwd_stream", T=bf, RMS=False, TW=bf, TB=bf if has_b else None, VEC=8,
                      TPR=512, BLOCK=512, NCH=4, MINB=4, PARTIAL=False, ROLL=False,
                      COHERENT_WB=False)  # fmt: skip

    cluster = kernel("ln_bwd_reg_cluster", T=bf, RMS=False, TW=bf, TB=None, VEC=8, ITEMS=4,
                     BLOCK=256, C=8, STAGE_W=True)  # fmt: skip
    assert spill_allowed(cluster) == 48
    assert spill_allowed(bwd(512, 512, True)) == AHEAD_SPILL
    assert spill_allowed(bwd(64, 64, False)) == 0
    assert spill_allowed(reg(8, 512, 512, 2, False, 0)) == 0
    assert spill_allowed(reg(4, 384, 384, 4, False, 0), 80) == 0
    assert spill_allowed(stream(True)) == spill_allowed(stream(True), 80) == STREAM_SPILL == 8
    assert spill_allowed(stream(False)) == spill_allowed(stream(False), 80) == 16
    assert spill_allowed(bwd(64, 64, False), 100) == spill_allowed(bwd(64, 64, False), 120) == 8
    assert spill_allowed(cluster, 100) == 48


def ref_bf16():
    return next(d for d in DTYPES if d.name == "bfloat16")


def _check_build(kernels, arch, unchecked=frozenset()):
    """Build ``kernels`` for sm_``arch``: every one reported by ptxas, and each not in
    ``unchecked`` within spill_allowed."""
    cubin, log, lowered = _compile.compile_cubin(kernels, arch)
    assert cubin[:4] == b"\x7fELF"
    reports = {m.group(1): tuple(map(int, m.group(2, 3, 4))) for m in _REPORT.finditer(log)}
    names = {v: k for k, v in lowered.items()}
    assert set(reports) == set(names), "ptxas did not report every kernel"
    spilled = {names[f]: r for f, r in reports.items() if any(r) and names[f] not in unchecked}
    spilled = {k: r for k, r in spilled.items() if any(b > spill_allowed(k, arch) for b in r)}
    assert not spilled, f"stack frame / spill stores / spill loads: {spilled}"


@pytest.mark.sweep
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("source", FILES)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=lambda d: d.name)
def test_every_variant_compiles_without_spills(x_dtype, source, arch):
    kernels = variants(x_dtype, arch)[source]
    if kernels:
        _check_build(kernels, arch)


@cache
def first_variants(smem: int, c: int, streams: bool) -> dict:
    """{kernel name: its first variant} that a device of these limits plans at a few widths:
    bf16 rows with bf16 and float32 w and b, RMSNorm and the residual add's forms, the sums
    and add kernels, and the jagged kernels with int64 offsets."""
    bf, f32 = ref_bf16(), np.dtype(np.float32)
    modes = forward_modes(c, streams)
    seen: dict = {}
    for n in (256, 1024, 4096, 8192, 16384, 32768, 65536, 65537, 270000, 10**6):
        for vec in (8, 4, 1):
            for x, w in ((bf, bf), (bf, f32)):
                for rms, res in (
                    (False, None),
                    (True, None),
                    (True, (f32, f32)),
                    (False, (bf, bf)),
                ):
                    if res and vec * res[1].itemsize > 16:
                        continue  # (packs are of the widest of x, the residual and h)
                    plans = [F.forward_plan(n, x, w, w, vec, smem, c, rms=rms, residual=res, **m)
                             for m in modes]  # fmt: skip
                    for dh in (False, True):
                        plans.append(B.backward_plan(n, x, w, vec, smem, c, False, rms, dh))
                    for p in plans:
                        seen.setdefault(p.kernel.name, p.kernel)
    seen["ln_partial_reduce"] = B.reduce_kernel(4096, 1, 132, bf, f32, f32)[0]
    seen["ln_bwd_dwdb_cols"] = B.dwdb_cols_kernel(bf)
    seen["ln_fwd_add"] = F.add_kernel(bf, f32, f32, 4)
    for k in jagged_variants(bf, smem):
        seen.setdefault(k.name, k)
    return seen


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("source", FILES)
def test_each_kernel_compiles(source, arch):
    """One variant of every kernel of a source file: the quick form of the sweep. The variants
    the architecture's own profiles plan are held to the spill bounds; kernels those plans never
    reach (clusters on sm_80, the stream tier where DRAM is slow) build in the H200's variant,
    only to compile."""
    own: dict = {}
    for lim in limits(arch):
        for name, k in first_variants(*lim).items():
            own.setdefault(name, k)
    h200 = PROFILES["h200"]
    rest = {
        k
        for name, k in first_variants(h200.smem_block, h200.max_cluster, True).items()
        if name not in own
    }
    kernels = {k for k in set(own.values()) | rest if _compile.source_of(k.name) == source}
    names = {k.name for k in kernels}
    every = {name for name in C.SIGNATURES if _compile.source_of(name) == source}
    assert names == every, f"no plan reached {every - names}"
    _check_build(sorted(kernels, key=_compile.expression), arch, unchecked=rest)


QUANT_OPTIONS = (  # each variant of the quantizing Store's code
    ("fp8", {}),
    ("fp8", {"fp8_dtype": "e5m2"}),
    ("fp8_row", {}),
    ("fp8_block", {}),
    ("fp8_block", {"block": 64, "pow2_scale": True}),
    ("mxfp8", {}),
    ("mxfp8", {"fp8_dtype": "e5m2", "scale_layout": "cublas"}),
    ("nvfp4", {}),
    ("nvfp4", {"scale_layout": "cublas"}),
)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantized_stores_compile(arch):
    """Every format and option of a quantized y in the register rows the plans give it: bf16
    LayerNorm at 4096 (a block's lanes in a warp), RMSNorm with a residual add at 1024 (rows of
    a warp's part) and at 65536 (8 packs a thread, whole warps a block), float32 and float64
    rows; within QUANT_SPILL."""
    from cupyln import _formats as Q

    bf, f32, f64 = ref_bf16(), np.dtype(np.float32), np.dtype(np.float64)
    kernels = set()
    for quant, opts in QUANT_OPTIONS:
        for n, x, vec, rms, res in ((4096, bf, 8, False, None), (1024, bf, 8, True, (bf, bf)),
                                    (65536, bf, 8, True, None), (4096, f32, 4, True, None),
                                    (1024, f64, 2, False, None)):  # fmt: skip
            p = F.quant_plan(n, x, x, x, vec, F.FWD_REG_ITEMS, rms=rms, residual=res,
                             quant=Q.spec(quant, n, **opts))  # fmt: skip
            kernels.add(p.kernel)
    _check_build(sorted(kernels, key=_compile.expression), arch)


def test_includes_are_inlined_and_hashed():
    text, digest = _compile.source("layer_norm_fwd.cu")
    assert '#include "common.cuh"' not in text and "struct bf16_t" in text
    assert len(digest) == 64


def test_expressions_render_the_dtype_table():
    bf, f32 = ref_bf16(), np.dtype(np.float32)
    k = kernel("ln_fwd_row", T=bf, RMS=False, TW=f32, TB=f32, VEC=8, BLOCK=256, STAGE=True)
    assert _compile.expression(k) == (
        "cupyln::ln_fwd_row<cupyln::Load<cupyln::bf16_t, void, void>, "
        "cupyln::Store<false, cupyln::bf16_t, float, float>, 8, 256, true>"
    )
    assert k.arg("TY") == bf and k.arg("TR") is None  # the defaults: y of x's dtype, no residual
    assert _compile.expression(F.add_kernel(bf, bf, f32, 8)) == (
        "cupyln::ln_fwd_add<cupyln::Load<cupyln::bf16_t, cupyln::bf16_t, float>, 8>"
    )
    assert _compile.expression(J.check_kernel(np.dtype(np.int64))) == (
        "cupyln::jag_check_offsets<long long>"
    )
    with pytest.raises(TypeError, match="takes"):
        kernel("ln_fwd_row", T=bf)


def test_every_kernel_has_a_source():
    for name in C.SIGNATURES:
        assert name in _compile.source(_compile.source_of(name))[0], name


def test_machine_code_is_read_per_kernel():
    """scripts/sass.py's reading of a cubin: each kernel's .text section, found by its lowered
    name, the same bytes in two builds of one source, other bytes for another instantiation."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "sass.py"
    spec = importlib.util.spec_from_file_location("sass", path)
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    bf, f32 = ref_bf16(), np.dtype(np.float32)
    a, b = F.add_kernel(bf, f32, f32, 4), F.add_kernel(bf, f32, f32, 8)
    codes = []
    for _ in range(2):
        cubin, _, lowered = _compile.compile_cubin([a, b], 90, verbose=False)
        code = sass.text_sections(cubin)
        codes.append((code[lowered[a]], code[lowered[b]]))
    assert codes[0] == codes[1] and codes[0][0] and codes[0][0] != codes[0][1]
