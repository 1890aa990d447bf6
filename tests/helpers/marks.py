"""Skip marks for tests that need something outside Python."""

from __future__ import annotations

import pytest

from showattendtell.evaluation.metrics import java_available

needs_java = pytest.mark.skipif(
    not java_available(), reason="Java is not installed (the official METEOR and PTB tokenizer)"
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(
    not _cuda(),
    reason="no CUDA GPU (the GPU checks run on a GPU machine: pytest tests/kernels/test_cuda.py)",
)
