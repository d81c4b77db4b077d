"""The README's Python examples run as written (GPU tier; the torch and JAX ones where those
are installed)."""

import importlib.util
import re
from pathlib import Path

import pytest

from .conftest import requires_gpu

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_its_examples():
    assert len(BLOCKS) == 4  # CuPy, torch, JAX, jagged
    for block in BLOCKS:
        compile(block, "README.md", "exec")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("block", BLOCKS, ids=["cupy", "torch", "jax", "jagged"])
def test_readme_example_runs(block):
    for framework in ("torch", "jax"):
        if f"import {framework}" in block and importlib.util.find_spec(framework) is None:
            pytest.skip(f"{framework} is not installed")
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
