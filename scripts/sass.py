"""Machine code of every planned kernel, hashed, to show that a change of the kernels' sources
leaves their code as it was (or which kernels it changed). CPU only: NVRTC builds cubins
without a GPU or a driver.

    python scripts/sass.py hash OUT.json [--arch 90] [--dtype bfloat16 ...]
    python scripts/sass.py compare OLD.json NEW.json

``hash`` builds, for sm_ARCH, every kernel variant that the plans of that architecture's GPU
profiles can return (the CI sweep's set, tests/test_compile.py ``variants``) and writes
{name expression: sha256 of its .text section} (the SASS, without symbol names). ``compare``
lists the kernels whose code differs, or that only one side has. Run it from the project root,
once on each tree (``git worktree`` or a checkout of the other commit).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def text_sections(cubin: bytes) -> dict[str, bytes]:
    """{section name: bytes} of an ELF64 little-endian file's .text.* sections."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

    names = header(shstrndx)
    out = {}
    for i in range(shnum):
        name_off, _, _, _, offset, size = header(i)[:6]
        start = names[4] + name_off
        name = cubin[start : cubin.index(b"\0", start)].decode()
        if name.startswith(".text."):
            out[name[len(".text.") :]] = cubin[offset : offset + size]
    return out


def _hash_file(job) -> dict:
    from cupyln import _compile

    kernels, arch = job
    cubin, _, lowered = _compile.compile_cubin(kernels, arch, verbose=False)
    code = text_sections(cubin)
    return {_compile.expression(k): hashlib.sha256(code[lowered[k]]).hexdigest() for k in kernels}


def hash_all(out: str, arch: int, dtypes: list[str], workers: int) -> None:
    import numpy as np

    from cupyln._dtypes import TABLE
    from tests.test_compile import variants

    chosen = [d for d in TABLE if not dtypes or d.name in dtypes]
    jobs = []
    for dt in chosen:
        for kernels in variants(dt, arch).values():
            for i in range(0, len(kernels), 24):  # NVRTC builds of a few dozen kernels each
                jobs.append((kernels[i : i + 24], arch))
    hashes: dict = {}
    with ProcessPoolExecutor(workers) as pool:
        for part in pool.map(_hash_file, jobs):
            hashes.update(part)
    Path(out).write_text(json.dumps(dict(sorted(hashes.items())), indent=0))
    print(f"{len(hashes)} kernels for sm_{arch} ({', '.join(d.name for d in chosen)}) -> {out}")
    del np


def compare(old: str, new: str) -> int:
    a, b = json.loads(Path(old).read_text()), json.loads(Path(new).read_text())
    changed = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    only = sorted(a.keys() ^ b.keys())
    print(f"{len(a.keys() & b.keys())} kernels in both: {len(changed)} changed; "
          f"{len(only)} in one only")  # fmt: skip
    for k in changed:
        print("changed ", k)
    for k in only:
        print("only old" if k in a else "only new", k)
    return 1 if changed or only else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hash")
    h.add_argument("out")
    h.add_argument("--arch", type=int, default=90)
    h.add_argument("--dtype", action="append", default=[])
    h.add_argument("--workers", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    args = p.parse_args()
    if args.cmd == "hash":
        hash_all(args.out, args.arch, args.dtype, args.workers)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
