"""torch.hub entry points: one per bundled model, each returning a ready ``Captioner``.

    import torch
    captioner = torch.hub.load("OWNER/showattendtell", "flickr8k_lite2_soft")
    captioner.caption(["photo.jpg"])[0].caption

``torch.hub.list`` names the models (the catalog's bundled files, captioning/catalog.py) and
``torch.hub.help`` describes each. The package is imported from this checkout's src/ folder
(what torch.hub downloads), or from an installed showattendtell where there is no src/.
"""

import sys as _sys
from pathlib import Path as _Path

dependencies = ["torch", "torchvision", "safetensors", "numpy", "PIL", "nltk"]

_SRC = _Path(__file__).resolve().parent / "src"
if (_SRC / "showattendtell").is_dir() and str(_SRC) not in _sys.path:
    _sys.path.insert(0, str(_SRC))  # this checkout's code and bundled models

from showattendtell.captioning.catalog import bundled_models as _bundled_models  # noqa: E402


def _entry(path: _Path):
    def load(device: str = "auto", precision: str = "32"):
        from showattendtell.captioning.captioner import load_model

        return load_model(path, device, precision)

    load.__name__ = load.__qualname__ = path.stem
    load.__doc__ = (
        f"The bundled model {path.stem} as a ready Captioner (its stored decoding; "
        "`sat models` describes it). device: auto, cpu, cuda or cuda:N; precision: 32, bf16 "
        "or 16 (mixed precision; 16 on a GPU only)."
    )
    return load


for _path in _bundled_models():
    globals()[_path.stem] = _entry(_path)
