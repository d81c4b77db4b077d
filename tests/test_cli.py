"""``python -m cupyln``: info always works; check passes on a GPU and, without one, says so
and exits non-zero."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import requires_gpu


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cupyln", *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "cupyln" in r.stdout and "CuPy" in r.stdout and "kernel cache" in r.stdout


def test_check_without_gpu_fails_clearly():
    r = run("check", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # no GPU, on any machine
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr


@requires_gpu
@pytest.mark.gpu
def test_check_passes_on_gpu():
    r = run("check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Triton tutorial check" in r.stdout and "check passed" in r.stdout
    assert "FAIL" not in r.stdout


@requires_gpu
@pytest.mark.gpu
def test_bench_runs(tmp_path):
    out = tmp_path / "b.csv"
    r = run("bench", "--n", "1024,65536", "--log2-elements", "20", "--no-torch", "--csv", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "device-to-device copy" in r.stdout
    assert out.read_text().count("\n") == 3  # header + two widths


def test_plot_renders_saved_results(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        {"provider": p, "dtype": "bfloat16", "M": 2**27 // n, "N": n, "fwd_GBs": g,
         "bwd_GBs": g * 0.8}
        for p, g in (("cupyln", 3600.0), ("torch", 2000.0))
        for n in (512, 4096, 65536)
    ]  # fmt: skip
    src = tmp_path / "b.json"
    src.write_text(json.dumps({"copy_GBs": 4200.0, "rows": rows}))
    png = tmp_path / "b.png"
    r = run("plot", str(src), str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
