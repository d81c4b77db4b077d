"""What a user installs: the version the changelog names, an sdist that carries what the README
links, extras that name CUDA, and a clear message where CuPy is missing."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import cupyln

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_changelog_latest():
    heading = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert heading and heading.group(1) == cupyln.__version__, heading


def _sdist_files() -> set:
    """The files MANIFEST.in adds to the sdist (its include / recursive-include lines)."""
    files = set()
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "include":
            files |= {p for w in words[1:] for p in ROOT.glob(w)}
        elif words[0] == "recursive-include":
            files |= {p for w in words[2:] for p in (ROOT / words[1]).rglob(w)}
        else:
            raise AssertionError(f"MANIFEST.in: a line this test does not read: {line}")
    return {p.relative_to(ROOT).as_posix() for p in files}


def test_sdist_carries_what_the_readme_links():
    links = re.findall(r"\]\(([^)#]+)\)", (ROOT / "README.md").read_text())
    local = {u for u in links if "://" not in u}
    assert {"docs/guide.md", "docs/bench_h200_bf16.png"} <= local
    missing = sorted(u for u in local if u not in _sdist_files() and not u.startswith("cupyln/"))
    assert not missing, f"README links outside the sdist: {missing}"


def test_missing_cupy_names_the_extras():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import numpy, cupyln\n"
        "cupyln.forward(numpy.ones((2, 4), numpy.float32))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "ModuleNotFoundError" in r.stderr and 'pip install "cupyln[cuda12]"' in r.stderr


def test_the_readme_installs_name_defined_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])  # fmt: skip
    named = set()
    for line in re.findall(
        r'pip install (?:-e )?"\.\[([^\]]+)\]"', (ROOT / "README.md").read_text()
    ):
        named |= set(line.split(","))
    assert {"cuda12", "cuda13", "torch", "jax-cuda12", "test"} <= named
    assert named <= extras, named - extras
