import pytest
import torch
from helpers.data import RESNET50_CAFFE, needs_resnet50

from showattendtell.network.encoder import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Encoder,
    EncoderConfig,
    EncoderWeightsError,
    UnknownBackbone,
    get_backbone,
    list_backbones,
)


@pytest.mark.parametrize(
    "backbone,size,grid,dim",
    [
        ("resnet50", 64, 2, 2048),
        ("resnet101", 64, 2, 2048),
        ("resnet152", 64, 2, 2048),
        ("vgg16", 64, 4, 512),
        ("vgg19", 64, 4, 512),
    ],
)
def test_backbones_give_annotation_grids(backbone, size, grid, dim):
    cfg = EncoderConfig(backbone=backbone, weights=None, input_size=size)
    assert (cfg.grid, cfg.feature_dim) == (grid, dim)
    with torch.no_grad():
        out = Encoder(cfg)(torch.randn(2, 3, size, size))
    assert out.shape == (2, grid * grid, dim)


def test_adaptive_pooling_sets_the_grid():
    cfg = EncoderConfig(backbone="resnet50", weights=None, input_size=96, grid_size=2)
    with torch.no_grad():
        assert Encoder(cfg)(torch.randn(1, 3, 96, 96)).shape == (1, 4, 2048)


def test_frozen_by_default_and_fine_tuning_last_stages():
    enc = Encoder(EncoderConfig(backbone="resnet50", weights=None, input_size=64))
    assert not enc.trainable
    enc = Encoder(
        EncoderConfig(backbone="resnet50", weights=None, input_size=64, fine_tune_stages=1)
    )
    assert all(p.requires_grad for p in enc.stages[-1].parameters())
    assert not any(p.requires_grad for p in enc.stages[-2].parameters())
    enc.train()
    assert not enc.training  # BatchNorm statistics stay frozen


def test_the_frozen_stages_and_the_top_compose_to_the_whole():
    """A fine-tuned encoder's cache keeps the frozen stages' output; the top finishes it."""
    torch.manual_seed(0)
    enc = Encoder(
        EncoderConfig(backbone="resnet50", weights=None, input_size=64, fine_tune_stages=2)
    )
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        below = enc.cached_features(x)
        assert below.shape == (2, 512, 8, 8)  # layer2's output: layer3 and layer4 are trained
        torch.testing.assert_close(enc.forward_top(below), enc(x))
    frozen = Encoder(EncoderConfig(backbone="resnet50", weights=None, input_size=64))
    assert frozen.cached_features(x).shape == (2, 4, 2048)  # frozen: the annotation grid


def test_caffe_style_moves_the_strides():
    enc = Encoder(EncoderConfig(backbone="resnet50", weights=None, caffe_style=True))
    for stage in enc.stages[2:]:
        assert stage[0].conv1.stride == (2, 2) and stage[0].conv2.stride == (1, 1)
    with pytest.raises(ValueError):
        EncoderConfig(backbone="vgg16", caffe_style=True)


def test_fingerprint_changes_with_what_changes_the_features():
    base = EncoderConfig(weights=None)
    assert base.fingerprint() == EncoderConfig(weights=None, fine_tune_stages=2).fingerprint()
    for other in (
        EncoderConfig(weights=None, input_size=448),
        EncoderConfig(backbone="resnet101", weights=None),
        EncoderConfig(weights=None, caffe_style=True),
        EncoderConfig(),
    ):
        assert other.fingerprint() != base.fingerprint()


def test_bad_weights_files_are_refused(tmp_path):
    with pytest.raises(EncoderWeightsError, match="none.pth: not found"):
        Encoder(EncoderConfig(weights=str(tmp_path / "none.pth")))
    bad = tmp_path / "bad.pth"
    bad.write_text("not a checkpoint")
    with pytest.raises(EncoderWeightsError, match="not a plain PyTorch file"):
        Encoder(EncoderConfig(weights=str(bad)))
    other = tmp_path / "other.pth"
    torch.save({"conv1.weight": torch.zeros(2, 2)}, other)  # a state dict of another network
    with pytest.raises(EncoderWeightsError, match="does not fit the backbone"):
        Encoder(EncoderConfig(weights=str(other)))


@needs_resnet50
def test_shared_caffe_resnet50_classifies_a_real_photo():
    """The v1 stride fix matters: with it the ImageNet head recognises a tennis racket."""
    import torchvision
    from helpers.data import COCO_SUBSET

    from showattendtell.images.files import open_image, preprocess

    photo = COCO_SUBSET / "images" / "000000078915.jpg"
    if not photo.is_file():
        pytest.skip(f"{photo} not found")
    enc = Encoder(EncoderConfig(weights=str(RESNET50_CAFFE), caffe_style=True))
    net = torchvision.models.resnet50()
    net.load_state_dict(torch.load(RESNET50_CAFFE, weights_only=True))
    with torch.no_grad():
        grid = enc(preprocess(open_image(photo), 224)[None])  # (1, 49, 2048)
        logits = net.fc(grid.mean(1))
    assert grid.shape == (1, 49, 2048)
    assert int(logits.argmax()) == 752  # racket


@pytest.mark.parametrize("fine_tune_stages", [0, 2])
def test_a_cpu_batch_goes_through_the_cnn_in_slices_with_the_same_result(fine_tune_stages):
    """On a CPU a batch runs a few images at a time (it is faster: the activations stay in the
    caches), with the same grids as the whole batch at once."""
    torch.manual_seed(0)
    enc = Encoder(
        EncoderConfig(
            backbone="resnet50", weights=None, input_size=64, fine_tune_stages=fine_tune_stages
        )
    )
    x = torch.randn(7, 3, 64, 64)
    sizes = []
    enc.stages[0].register_forward_pre_hook(lambda m, args: sizes.append(len(args[0])))
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)  # CPU_IMAGES_PER_THREAD = 2 images per slice
            sliced = enc.cached_features(x)
            torch.set_num_threads(4)  # slices of 8: the whole batch at once
            whole = enc.cached_features(x)
    finally:
        torch.set_num_threads(threads)
    assert sizes == [2, 2, 2, 1, 7]
    torch.testing.assert_close(sliced, whole, rtol=1e-3, atol=1e-3)  # float32 rounding
    with torch.no_grad():
        torch.testing.assert_close(enc.in_chunks(lambda t: t * 2, x), x * 2)


@pytest.mark.parametrize("name", list_backbones())
def test_every_registered_backbone_is_what_its_entry_says(name):
    """The registry's entry is the backbone: its stages give its feature size on the grid its
    stride and rounding say (at a size that is a multiple of the stride and one that is not),
    and the encoder converts ImageNet-normalised input to the entry's mean and std."""
    spec = get_backbone(name)
    for size in (64, 72):
        cfg = EncoderConfig(backbone=name, weights=None, input_size=size)
        enc = Encoder(cfg)
        with torch.no_grad():
            out = enc(torch.rand(1, 3, size, size))
        assert cfg.grid == spec.grid(size) and cfg.feature_dim == spec.feature_dim
        assert out.shape == (1, cfg.grid**2, spec.feature_dim), size
    pixel = torch.rand(1, 3, 1, 1)  # RGB in [0, 1]
    mean, std = (
        torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1),
        torch.tensor(IMAGENET_STD).view(1, 3, 1, 1),
    )
    theirs = (pixel - torch.tensor(spec.mean).view(1, 3, 1, 1)) / torch.tensor(spec.std).view(
        1, 3, 1, 1
    )
    ours = (
        (pixel - mean) / std * enc.input_scale + enc.input_shift
        if enc.renormalise
        else (pixel - mean) / std
    )
    torch.testing.assert_close(ours, theirs)


def test_an_unknown_backbone_is_an_error_listing_the_registered_ones():
    with pytest.raises(UnknownBackbone) as e:
        EncoderConfig(backbone="convnext_tiny", weights=None)
    assert all(name in str(e.value) for name in list_backbones()) and "\n" not in str(e.value)
    assert all(name in EncoderConfig.__doc__ for name in list_backbones())  # sat train --help
