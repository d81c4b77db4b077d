"""Shared test setup: the GPU tier is skipped, with the reason, where no GPU is usable."""

import os

import pytest

# JAX takes 75% of GPU memory at start unless told otherwise; CuPy (the kernels' scratch
# memory, the reference) and torch share the GPU in these tests.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# NVRTC 13 takes a kernel's ptxas step from the CUDA compute cache where an earlier build left it,
# and then writes no report for that kernel: tests/test_compile.py reads those reports.
os.environ.setdefault("CUDA_CACHE_DISABLE", "1")

from cupyln._plans.devices import PROFILES
from cupyln.cli import _gpu_count

GPU_COUNT, NO_GPU_REASON = _gpu_count()

requires_gpu = pytest.mark.skipif(GPU_COUNT == 0, reason=f"no usable CUDA GPU: {NO_GPU_REASON}")


def pytest_addoption(parser):
    parser.addoption(
        "--sweep", action="store_true", help="also build every kernel variant (minutes; CI)"
    )
    parser.addoption(
        "--emulate",
        choices=sorted(PROFILES),
        help="plan as on this GPU (cupyln._plans.devices.PROFILES): the GPU tests run its plans "
        "on the GPU in use, under its limits",
    )


def pytest_configure(config):
    profile = config.getoption("--emulate")
    if profile:
        from cupyln import _control

        _control.emulate(profile)


def pytest_report_header(config):
    profile = config.getoption("--emulate")
    return f"cupyln plans as on: {PROFILES[profile].name}" if profile else None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--sweep"):
        return
    skip = pytest.mark.skip(reason="the NVRTC build of every kernel variant: run with --sweep")
    for item in items:
        if "sweep" in item.keywords:
            item.add_marker(skip)
