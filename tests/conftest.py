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

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
FLICKR8K = SHARED / "data" / "flickr8k"
COCO_SUBSET = SHARED / "data" / "coco2017_val_subset"
RESNET50_CAFFE = SHARED / "weights" / "resnet50-caffe-imagenet-fp16-ca826be8.pth"

needs_flickr8k = pytest.mark.skipif(
    not (FLICKR8K / "Flickr8k.token.txt").is_file(),
    reason=f"real Flickr8k data not found at {FLICKR8K} (see data/README.md)",
)
needs_coco_subset = pytest.mark.skipif(
    not (COCO_SUBSET / "annotations" / "captions_val2017.json").is_file(),
    reason=f"COCO val2017 subset not found at {COCO_SUBSET}",
)
needs_resnet50 = pytest.mark.skipif(
    not RESNET50_CAFFE.is_file(), reason=f"ImageNet ResNet-50 weights not found at {RESNET50_CAFFE}"
)


def write_flickr8k_folder(root: Path, n_train: int = 24, n_dev: int = 8, seed: int = 0) -> Path:
    """A Flickr8k-format dataset (token + split files, images/) of synthetic shape images."""
    import numpy as np
    from synthetic import make_example

    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    token_lines, names = [], []
    for i in range(n_train + n_dev):
        img, caption, _ = make_example(rng)
        name = f"{1000 + i}_synthetic.jpg"
        img.save(root / "images" / name, quality=95)
        names.append(name)
        for k in range(5):
            token_lines.append(f"{name}#{k}\t{'A ' if k % 2 else ''}{caption} .")
    (root / "Flickr8k.token.txt").write_text("\n".join(token_lines) + "\n")
    (root / "Flickr_8k.trainImages.txt").write_text("\n".join(names[:n_train]) + "\n")
    (root / "Flickr_8k.devImages.txt").write_text("\n".join(names[n_train:]) + "\n")
    (root / "Flickr_8k.testImages.txt").write_text("")
    return root


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
