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


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["rms", "add_rms", "add_ln"])
def test_bench_family(tmp_path, norm):
    out = tmp_path / "b.csv"
    r = run("bench", "--norm", norm, "--n", "1024,65536", "--log2-elements", "20", "--csv",
            str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = out.read_text().splitlines()
    assert len(rows) == 3 and all(row.startswith("cupyln") for row in rows[1:])  # no torch


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["ln", "add_rms"])
def test_bench_peers(tmp_path, norm):
    """--peers: cupyln.torch, torch and torch.compile (Liger where installed) at each width,
    fwd and bwd GB/s, each checked against the float64 reference (no WRONG)."""
    pytest.importorskip("torch")
    out = tmp_path / "p.json"
    r = run("bench", "--peers", "--norm", norm, "--n", "1024", "--log2-elements", "16",
            "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {"cupyln", "torch", "torch.compile"} <= {row["provider"] for row in rows}
    assert all(row["fwd_GBs"] > 0 and row["bwd_GBs"] > 0 for row in rows)
    assert "WRONG" not in r.stdout


@requires_gpu
@pytest.mark.gpu
def test_bench_quant_peers(tmp_path):
    """--quant with --peers: cupyln's one pass, torch.compile's fused norm and quantization,
    and cupyln's norm then the compiled quantization, at each width."""
    pytest.importorskip("torch")
    out = tmp_path / "qp.json"
    r = run("bench", "--quant", "mxfp8", "--peers", "--n", "4096", "--log2-elements", "16",
            "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["provider"] for row in rows] == ["cupyln mxfp8", "torch.compile",
                                                 "cupyln + compiled quant"]  # fmt: skip


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["mxfp8", "nvfp4"])
def test_bench_quant(tmp_path, quant):
    out = tmp_path / "q.json"
    r = run("bench", "--quant", quant, "--norm", "rms", "--n", "1000,4096", "--log2-elements",
            "18", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]  # N = 1000 is no multiple of the block: left out
    assert [(row["provider"], row["N"]) for row in rows] == [("cupyln", 4096),
                                                            (f"cupyln {quant}", 4096)]  # fmt: skip


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("direction,timed,skipped", [("forward", "fwd", "bwd"),
                                                     ("backward", "bwd", "fwd")])  # fmt: skip
def test_bench_one_direction(tmp_path, direction, timed, skipped):
    """--direction times one direction: its columns hold numbers, the other's None, and the
    table prints only the timed one."""
    out = tmp_path / "b.json"
    r = run("bench", "--n", "4096", "--log2-elements", "20", "--no-torch", "--direction",
            direction, "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["N"] == 4096 and row[f"{timed}_GBs"] > 0 and row[f"{timed}_ms"] > 0
    assert all(row[f"{skipped}_{k}"] is None for k in ("ms", "GBs", "of_copy"))
    table = [line for line in r.stdout.splitlines() if line.startswith("cupyln")]
    assert len(table) == 1 and f" {timed} " in table[0] and f" {skipped} " not in table[0]


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


def test_figure_draws_the_timed_directions():
    """Rows of one direction (bench --direction) give one panel; rows of both, two."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from cupyln import bench

    both = [
        {"provider": "cupyln", "N": n, "fwd_GBs": 3900.0, "bwd_GBs": 3700.0} for n in (512, 4096)
    ]
    fwd_only = [{**r, "bwd_GBs": None} for r in both]
    bwd_only = [{**r, "fwd_GBs": None} for r in both]
    for rows, titles in ((both, ["forward", "backward"]), (fwd_only, ["forward"]),
                         (bwd_only, ["backward"])):  # fmt: skip
        fig = bench.figure(rows, 4200.0)
        assert [ax.get_title() for ax in fig.axes] == titles
        for ax in fig.axes:  # the provider's line first, then the copy's
            assert len(ax.get_lines()[0].get_xdata()) == 2
        plt.close(fig)
    with pytest.raises(ValueError, match="no forward or backward"):
        bench.figure([{**r, "fwd_GBs": None} for r in fwd_only])


def test_bench_refuses_unknown_directions():
    from cupyln import bench

    for bad in ((), ("sideways",), ("forward", "fwd"), "both"):
        with pytest.raises(ValueError, match="directions"):
            bench.run(directions=bad)


def test_help_and_version():
    r = run("--help")
    assert r.returncode == 0 and "``" not in r.stdout, r.stdout  # no raw markup
    assert all(cmd in r.stdout for cmd in ("info", "check", "bench", "plot"))
    from cupyln import __version__

    for args in (("--version",), ("info", "--version")):
        r = run(*args)
        assert r.returncode == 0 and r.stdout.strip() == f"cupyln {__version__}", (args, r)


def test_plot_renders_jagged_results(tmp_path):
    """bench --jagged --json rows (B sequences of D) plot against B, a line per D and dtype."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from cupyln import bench

    rows = [
        {"provider": p, "dtype": dt, "B": b, "D": d, "fwd_GBs": g * b, "bwd_GBs": float("nan")}
        for p, g in (("cupyln", 3.0), ("torch vectorized", 1.0))
        for dt in ("float32", "bfloat16")
        for d in (32, 256)
        for b in (32, 256, 2048)
    ]
    src = tmp_path / "j.json"
    src.write_text(json.dumps({"copy_GBs": 4200.0, "rows": rows}))
    png = tmp_path / "j.png"
    r = run("plot", str(src), str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = bench.figure(rows, 4200.0)
    lines = [ln for ln in fig.axes[0].get_lines() if ln.get_label() != "copy 4200 GB/s"]
    assert len(lines) == 8 and "cupyln bfloat16 D=256" in {ln.get_label() for ln in lines}
    assert list(lines[0].get_xdata()) == [32, 256, 2048]
    assert fig.axes[0].get_xlabel() == "B (sequences)"
    plt.close(fig)
