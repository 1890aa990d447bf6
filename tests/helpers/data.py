"""Where the real data and weights are (the project's shared folder, documented by its READMEs),
the marks that skip a test without them, and a synthetic Flickr8k folder: imported by the
tests by name (``from helpers.data import ...``), as a conftest.py cannot be: pytest gives
every folder's conftest.py the same module name."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
