"""`sat train`: LightningCLI over CaptionModule + CaptionDataModule, driven by YAML configs."""

from __future__ import annotations

import warnings

from lightning.pytorch.cli import LightningCLI

from showattendtell.data.datamodule import CaptionDataModule
from showattendtell.lit_module import CaptionModule


class SatCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The feature cache must match the model's encoder; the model's vocabulary comes from
        # the training captions.
        parser.link_arguments("model.encoder", "data.encoder", apply_on="parse")
        parser.link_arguments("data.vocab_words", "model.vocab", apply_on="instantiate")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="resume training from this checkpoint (e.g. .../last.ckpt)")


def build_cli(args: list[str]) -> SatCLI:
    # The frozen encoder stays in eval mode on purpose (BatchNorm statistics are not trained).
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    # `sat train ARGS` hands ARGS over explicitly, so sys.argv holding them too is intended
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
    return SatCLI(
        CaptionModule,
        CaptionDataModule,
        run=False,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "sat train", "default_env": False},
    )


def train(args: list[str]) -> None:
    cli = build_cli(args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.ckpt_path)


def extract_features(args: list[str]) -> None:
    """`sat features --config X.yaml`: fill the feature cache exactly as `sat train` would."""
    cli = build_cli(args)
    cli.datamodule.prepare_data()
