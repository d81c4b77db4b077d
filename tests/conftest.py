"""Shared test setup: the GPU tier is skipped, with the reason, where no GPU is usable."""

import pytest

from cupyln.cli import _gpu_count

GPU_COUNT, NO_GPU_REASON = _gpu_count()

requires_gpu = pytest.mark.skipif(GPU_COUNT == 0, reason=f"no usable CUDA GPU: {NO_GPU_REASON}")
