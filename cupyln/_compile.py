"""Compilation: the one place that reads kernel sources and turns them into CUDA functions.

* ``source(file)`` reads ``kernels/<file>`` and inlines its local ``#include "..."`` files, so
  CuPy's disk cache (keyed on the source text) sees every change to a shared header.
* ``expression(k)`` renders a plan's kernel record (``_plans.common.Kernel``: a name and its
  template arguments) as the name expression NVRTC instantiates, from the one dtype table.
* ``function(k, device_id, smem)`` returns the ``cupy.RawKernel`` of one instantiation on a
  device, building one ``cupy.RawModule`` per (device, source hash, options, expression) on
  first use under a lock.
* ``compile_cubin(kernels, arch)`` compiles with NVRTC directly, without a GPU or driver, with
  the options of the run-time build: the CPU tests build every variant for each supported
  architecture with it and read ptxas' report.
"""

from __future__ import annotations

import hashlib
import re
import threading
from functools import cache
from pathlib import Path

import numpy

from ._dtypes import ctype
from ._plans.common import SIGNATURES, TRAILING

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

#: kernel (or kernel name prefix) -> the file that defines it
SOURCES = {
    "ln_fwd_reg": "layer_norm_fwd.cu",  # ln_fwd_reg and ln_fwd_reg_cluster
    "ln_fwd_stream": "layer_norm_fwd_stream.cu",
    "ln_fwd_": "layer_norm_fwd_staged.cu",  # ring, cluster, row
    "ln_bwd_reg": "layer_norm_bwd.cu",  # ln_bwd_reg and ln_bwd_reg_cluster
    "ln_bwd_dwdb_cols": "layer_norm_bwd_sums.cu",
    "ln_partial_reduce": "layer_norm_bwd_sums.cu",
    "ln_bwd_": "layer_norm_bwd_staged.cu",  # ring, cluster, row
    "jag_": "jagged.cu",
}

#: NVRTC options shared by the run-time build and the CPU compile check (CuPy adds -arch).
OPTIONS = ("-std=c++17",)
#: ...and what CuPy adds to every run-time build besides, which the CPU compile check adds too.
CUPY_OPTIONS = ("-ftz=true",)

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def _inline(path: Path, seen: set[Path]) -> str:
    if path in seen:  # included twice: the first copy holds it (files use #pragma once)
        return ""
    seen.add(path)
    text = path.read_text()

    def repl(m: re.Match) -> str:
        return _inline((path.parent / m.group(1)).resolve(), seen)

    return _INCLUDE.sub(repl, text).replace("#pragma once", "")


@cache
def source(file: str) -> tuple[str, str]:
    """(text of kernels/<file> with local includes inlined, its sha256)."""
    text = _inline((KERNEL_DIR / file).resolve(), set())
    return text, hashlib.sha256(text.encode()).hexdigest()


def source_of(name: str) -> str:
    """The kernels/ file that defines kernel ``name`` (the first entry of SOURCES it starts
    with)."""
    for prefix, file in SOURCES.items():
        if name.startswith(prefix):
            return file
    raise KeyError(f"no kernel source defines {name}")


def _arg(a) -> str:
    if a is None:  # an element type not used (a residual's TR and TH without one)
        return "void"
    if isinstance(a, bool):
        return "true" if a else "false"
    if isinstance(a, numpy.dtype):
        return ctype(a)
    return str(int(a))


@cache
def expression(k) -> str:
    """Name expression of a kernel record, e.g. ``cupyln::ln_fwd_reg<cupyln::Load<float, void,
    void>, cupyln::Store<false, float, float, float>, 4, ...>``."""
    args = iter(k.args)
    out = []
    for p in SIGNATURES[k.name]:
        if isinstance(p, tuple):
            given = [(q, next(args)) for q in p[1]]
            while given and given[-1][0] in TRAILING and given[-1][1] == TRAILING[given[-1][0]]:
                given.pop()  # the template's default
            out.append(f"cupyln::{p[0]}<{', '.join(_arg(a) for _, a in given)}>")
        else:
            out.append(_arg(next(args)))
    return f"cupyln::{k.name}<{', '.join(out)}>"


_lock = threading.Lock()
_modules: dict = {}  # (device, file, source hash, options, expression) -> cupy.RawModule
_functions: dict = {}  # (device, kernel record, shared-memory limit) -> cupy.RawKernel


def function(k, device_id: int, max_dynamic_smem: int = 0):
    """The RawKernel of kernel record ``k`` on ``device_id`` (which must be current).

    ``max_dynamic_smem`` (bytes, the device's opt-in limit a block) raises the kernel's dynamic
    shared-memory limit once, to that limit less the kernel's static shared memory.
    """
    key = (device_id, k, max_dynamic_smem)
    f = _functions.get(key)
    if f is not None:
        return f
    import cupy

    with _lock:
        f = _functions.get(key)
        if f is None:
            file, expr = source_of(k.name), expression(k)
            text, digest = source(file)
            mkey = (device_id, file, digest, OPTIONS, expr)
            mod = _modules.get(mkey)
            if mod is None:
                mod = cupy.RawModule(code=text, options=OPTIONS, name_expressions=(expr,))
                _modules[mkey] = mod
            f = mod.get_function(expr)
            if max_dynamic_smem:
                f.max_dynamic_shared_size_bytes = max_dynamic_smem - f.shared_size_bytes
            _functions[key] = f
    return f


def compile_cubin(kernels, arch: int, verbose: bool = True) -> tuple[bytes, str, dict]:
    """Compile kernel records of one source file for sm_``arch`` with NVRTC.

    Needs no GPU and no driver. Returns (cubin, NVRTC log, {kernel record: lowered name}); with
    ``verbose`` the log holds ptxas' per-kernel report (registers, spills, stack frame).
    """
    from cupy_backends.cuda.libs import nvrtc

    kernels = list(kernels)
    files = {source_of(k.name) for k in kernels}
    if len(files) != 1:
        raise ValueError(f"compile_cubin takes kernels of one source file; got {sorted(files)}")
    (file,) = files
    text, _ = source(file)
    opts = OPTIONS + CUPY_OPTIONS + (f"-arch=sm_{arch}",)
    opts += ("--ptxas-options=-v",) if verbose else ()
    prog = nvrtc.createProgram(text, file, (), ())
    try:
        for k in kernels:
            nvrtc.addNameExpression(prog, expression(k))
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {file}:\n{nvrtc.getProgramLog(prog)}") from err
        lowered = {k: nvrtc.getLoweredName(prog, expression(k)) for k in kernels}
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)
