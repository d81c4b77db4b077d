"""Compilation: the one place that reads kernel sources and turns them into CUDA functions.

* ``source(name)`` reads ``kernels/<name>`` and inlines its local ``#include "..."`` files, so
  CuPy's disk cache (keyed on the source text) sees every change to a shared header.
* ``kernel(name, expr)`` returns the ``cupy.RawKernel`` for one template instantiation on the
  current device, building one ``cupy.RawModule`` per (device, source hash, options, expression)
  on first use under a lock.
* ``compile_cubin(name, exprs, arch)`` compiles with NVRTC directly, without a GPU or driver:
  the CPU tests use it to build every variant for sm_80/sm_90 and read ptxas' report.
"""

from __future__ import annotations

import hashlib
import re
import threading
from functools import cache
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
FWD_SOURCE = "layer_norm_fwd.cu"
BWD_SOURCE = "layer_norm_bwd.cu"
JAG_SOURCE = "jagged.cu"

#: NVRTC options shared by the run-time build and the CPU compile check (CuPy adds -arch).
OPTIONS = ("-std=c++17",)

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
def source(name: str) -> tuple[str, str]:
    """(text of kernels/<name> with local includes inlined, its sha256)."""
    text = _inline((KERNEL_DIR / name).resolve(), set())
    return text, hashlib.sha256(text.encode()).hexdigest()


def template(fn: str, *args) -> str:
    """Name expression of a kernel instantiation, e.g. ``cupyln::ln_fwd_reg<float, 4>``."""
    parts = [("true" if a else "false") if isinstance(a, bool) else str(a) for a in args]
    return f"cupyln::{fn}<{', '.join(parts)}>"


_lock = threading.Lock()
_modules: dict = {}  # (device, file, source hash, options, expression) -> cupy.RawModule
_kernels: dict = {}  # (device, file, expression, shared-memory limit) -> cupy.RawKernel


def kernel(name: str, expr: str, device_id: int, max_dynamic_smem: int = 0):
    """The RawKernel for template instantiation ``expr`` of kernels/``name`` on ``device_id``.

    ``max_dynamic_smem`` (bytes, the device's opt-in limit per block) raises the kernel's
    dynamic shared-memory limit once, to that limit less the kernel's static shared memory.
    Call it with ``device_id`` current (the API layer does).
    """
    key = (device_id, name, expr, max_dynamic_smem)
    k = _kernels.get(key)
    if k is not None:
        return k
    import cupy

    with _lock:
        k = _kernels.get(key)
        if k is None:
            text, digest = source(name)
            mkey = (device_id, name, digest, OPTIONS, expr)
            mod = _modules.get(mkey)
            if mod is None:
                mod = cupy.RawModule(code=text, options=OPTIONS, name_expressions=(expr,))
                _modules[mkey] = mod
            k = mod.get_function(expr)
            if max_dynamic_smem:
                k.max_dynamic_shared_size_bytes = max_dynamic_smem - k.shared_size_bytes
            _kernels[key] = k
    return k


def compile_cubin(name: str, exprs, arch: int, verbose: bool = True) -> tuple[bytes, str, dict]:
    """Compile instantiations ``exprs`` of kernels/``name`` for sm_``arch`` with NVRTC.

    Needs no GPU and no driver. Returns (cubin, NVRTC log, {expression: lowered name}); with
    ``verbose`` the log holds ptxas' per-kernel report (registers, spills, stack frame).
    """
    from cupy_backends.cuda.libs import nvrtc

    text, _ = source(name)
    opts = OPTIONS + (f"-arch=sm_{arch}",) + (("--ptxas-options=-v",) if verbose else ())
    prog = nvrtc.createProgram(text, name, (), ())
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {name}:\n{nvrtc.getProgramLog(prog)}") from err
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)
