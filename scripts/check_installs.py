"""Each install line of the README's "Install" section, resolved by pip (``--dry-run
--ignore-installed``, as on a fresh machine), against what the README says it brings: the
CuPy of the extra's CUDA, NVRTC recent enough for sm_120 (12.8), JAX's CUDA plugin of the same
CUDA, and for the torch line the CUDA 13 torch that the README warns of.

    python scripts/check_installs.py        # from the repository root; exits 1 on a mismatch
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_lines() -> list[str]:
    """The extras of the README's ``pip install ".[...]"`` lines, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    return re.findall(r'^pip install "\.\[([^\]]+)\]"', section, re.M)


def resolve(extras: str) -> dict:
    """{distribution name: version} that pip would install for ``.[extras]``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--report", str(report), f".[{extras}]"]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        got = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in got}


def version(v: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:2])


def check(extras: str, got: dict) -> list[str]:
    """What ``got`` lacks of the README's promise for ``extras``."""
    wrong = []
    cuda = "12" if "cuda12" in extras else "13"
    if f"cupy-cuda{cuda}x" not in got:
        wrong.append(f"no cupy-cuda{cuda}x")
    nvrtc = got.get("nvidia-cuda-nvrtc-cu12" if cuda == "12" else "nvidia-cuda-nvrtc")
    if nvrtc is None or (cuda == "12" and version(nvrtc) < (12, 8)):
        wrong.append(f"NVRTC {nvrtc}: sm_120 needs 12.8 or newer")
    if "jax-cuda" in extras and f"jax-cuda{cuda}-plugin" not in got:
        wrong.append(f"no jax-cuda{cuda}-plugin")
    if "torch" in extras and "torch" not in got:
        wrong.append("no torch")
    if "torch" in extras and cuda == "12" and "cuda-toolkit" in got:  # the README's warning
        print(f"  .[{extras}]: torch {got['torch']} for CUDA 13 (the README says to install "
              "torch for CUDA 12 first)")  # fmt: skip
    return wrong


def main() -> int:
    lines = readme_lines()
    if not lines:
        print("no install lines found in README.md")
        return 1
    bad = 0
    for extras in lines:
        got = resolve(extras)
        wrong = check(extras, got)
        print(f"{'ok ' if not wrong else 'BAD'} .[{extras}]: {len(got)} distributions"
              + ("" if not wrong else "; " + "; ".join(wrong)))  # fmt: skip
        bad += bool(wrong)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
