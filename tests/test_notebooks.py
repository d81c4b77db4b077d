"""Notebooks: the CPU tier checks the committed copies (valid nbformat, executed top to bottom
with no error output, a first markdown cell, only cupyln's public names); the GPU tier executes
each one with nbclient (skipped where there is no GPU, nbclient or ipykernel)."""

import ast
import re
from pathlib import Path

import pytest

from .conftest import requires_gpu

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
nbformat = pytest.importorskip("nbformat")

_PRIVATE = re.compile(r"\b(cupyln|bench|reference|clt|cj)\._[^_]")  # dunders are public


def test_every_notebook_is_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_speed_of_light.ipynb",
        "03_jagged.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_was_executed_cleanly(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "markdown" and "Needs:" in nb.cells[0].source
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run in order"
    for c in code:
        assert c.outputs, f"cell {c.execution_count} has no output"
        errors = [o for o in c.outputs if o.output_type == "error"]
        assert not errors, f"cell {c.execution_count}: {errors[0].get('ename')}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_cells_have_ids_and_cite_only_the_repository(path):
    import json

    cells = json.loads(path.read_text())["cells"]  # as committed, before nbformat fills ids in
    assert all(c.get("id") for c in cells), [i for i, c in enumerate(cells) if not c.get("id")]
    for c in cells:
        assert "shared/" not in "".join(c["source"]), "a file outside the repository is cited"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_only_the_public_api(path):
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        assert not _PRIVATE.search(c.source), f"private name in: {c.source[:80]}"
        for node in ast.walk(ast.parse(c.source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cupyln"):
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("cupyln")]
            else:
                continue
            for name in names:
                assert not any(part.startswith("_") for part in name.split(".")), name


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_on_the_gpu(path, tmp_path):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # fmt: skip
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]  # fmt: skip
    assert not errors
