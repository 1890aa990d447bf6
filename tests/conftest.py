from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter
# (tests/kernels/test_fused_scores.py). It
# must be chosen before anything imports Triton (timm and Lightning do): a kernel defined after
# a plain import cannot call its helper functions in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.data import write_flickr8k_folder  # noqa: E402 - after TRITON_INTERPRET

# Under pytest-xdist (-n N) the workers share the cores: each takes its share of torch's threads,
# as two processes each running a thread per core would spin for each other's cores
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def synthetic_flickr(tmp_path_factory) -> Path:
    return write_flickr8k_folder(tmp_path_factory.mktemp("flickr8k_synthetic"))


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory) -> Path:
    """An exported model file (soft attention) trained in seconds on synthetic shapes."""
    from tiny_model import train_tiny_model

    return train_tiny_model(tmp_path_factory.mktemp("models") / "tiny.safetensors")


@pytest.fixture(scope="session")
def tiny_hard_model_file(tmp_path_factory) -> Path:
    """The same with hard attention (decoded with the argmax location)."""
    from tiny_model import train_tiny_model

    return train_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny_hard.safetensors", attention="hard"
    )
