"""`sat train` / `sat export` on bad input: one `error:` line and exit status 2, said before any
training (no test here trains), never a traceback."""

import os
import pickle
import shlex
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# imported here, not in a test: Lightning's loggers write to the stderr of the moment they are
# imported, which inside a test is that test's capture, closed after it
from showattendtell.cli import train as train_command
from showattendtell.cli.main import main
from showattendtell.cli.train_checks import short_type_error

ROOT = Path(__file__).resolve().parents[2]


def tiny(data_root: Path, run_dir: Path, *extra: str) -> list[str]:
    """`sat train` of configs/tiny.yaml (no feature cache) on ``data_root`` into ``run_dir``."""
    config = str(ROOT / "configs" / "tiny.yaml")
    return ["train", "--config", config, "--data.root", str(data_root), "--run.dir", str(run_dir)]


def one_error_line(capsys) -> str:
    """What the command wrote to stderr, checked to be one `error:` line."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    "setting, value, said",
    [
        ("data.batch_size", "0", "--data.batch_size 0: must be 1 or more"),
        ("data.val_batch_size", "-3", "--data.val_batch_size -3: must be 1 or more"),
        ("data.num_workers", "-1", "--data.num_workers -1: must be 0"),
        ("run.monitor", "val/bleu", "--run.monitor val/bleu: choose one of val/bleu1"),
        ("run.save_every_n_steps", "-2", "--run.save_every_n_steps -2: must be 0 or more"),
    ],
)
def test_a_setting_out_of_range_is_refused_before_any_work(
    setting, value, said, synthetic_flickr, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    assert main([*tiny(synthetic_flickr, run_dir), f"--{setting}", value]) == 2
    assert one_error_line(capsys).startswith(f"error: {said}")
    assert not (run_dir / "logs").exists() and not (run_dir / "checkpoints").exists()


def test_a_value_the_settings_class_refuses_is_one_line(synthetic_flickr, tmp_path, capsys):
    args = [*tiny(synthetic_flickr, tmp_path / "run"), "--model.decoder.attention", "fuzzy"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("error: attention must be 'soft' or")
    assert "Union subtypes" not in err and "'fuzzy'" in err


@pytest.mark.parametrize(
    "value, said",
    [
        ("two", "--trainer.max_epochs two: expected a whole number"),
        ("1.5x", "--trainer.max_epochs 1.5x: expected a whole number"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line(value, said, capsys):
    config = str(ROOT / "configs" / "tiny.yaml")
    assert main(["train", "--config", config, "--trainer.max_epochs", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"error: {said} (")
    assert main(["train", "--config", config, "--model.decoder.hidden_dim", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model.decoder.hidden_dim x: expected a whole number (")


def test_other_argument_errors_keep_jsonargparse_s_words():
    assert short_type_error("unrecognized arguments: --trainer.nonsense 1") is None
    literal = "Parser key \"x\":\n  Expected a <class 'Path'>. Got value: y"
    assert short_type_error(literal) is None  # a type it has no words for


def _touch(path: str) -> None:
    Path(path).touch()


class _Tripwire:
    """Unpickling it (what weights_only=True refuses) would create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def _not_a_checkpoint(kind: str, tmp_path: Path) -> Path:
    if kind == "missing":
        return tmp_path / "nope.ckpt"
    path = tmp_path / f"{kind}.ckpt"
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"weights": [1, 2]}, protocol=4))
    else:  # a torch.save zip with a global that weights_only loading does not allow
        torch.save({"x": _Tripwire(tmp_path / "unpickled")}, path)
    return path


@pytest.mark.parametrize("kind", ["missing", "pickle", "forbidden global"])
def test_a_ckpt_path_that_is_not_a_checkpoint_is_one_line(kind, synthetic_flickr, tmp_path, capsys):
    ckpt = _not_a_checkpoint(kind, tmp_path)
    run_dir = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*tiny(synthetic_flickr, run_dir), "--ckpt_path", str(ckpt)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --ckpt_path: {ckpt}") and "sat train wrote" in line
    assert "weights_only" not in line and not (tmp_path / "unpickled").exists()
    assert not [w for w in caught if "pickle protocol" in str(w.message)]
    assert not (run_dir / "logs").exists()


def _plant(where: str, run_dir: Path, marker: Path) -> tuple[str, Path]:
    """A checkpoint whose unpickling would create ``marker``, where --ckpt_path ``where``
    (last, hpc, or a path) finds it: the --ckpt_path value and the file."""
    file = {
        "last": run_dir / "checkpoints" / "last.ckpt",
        "hpc": run_dir / "hpc_ckpt_3.ckpt",
        "path": run_dir / "elsewhere.ckpt",
    }[where]
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "hyper_parameters": {"vocab": []}, "x": _Tripwire(marker)}, file)
    return (str(file) if where == "path" else where), file


@pytest.mark.parametrize("where", ["last", "hpc", "path"])
def test_a_malicious_checkpoint_never_runs_whatever_its_name_or_the_environment(
    where, synthetic_flickr, tmp_path, capsys, monkeypatch
):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes torch unpickle anything where a caller does not
    pass weights_only: Lightning's own reading of last and hpc did not."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    run_dir, marker = tmp_path / "run", tmp_path / "unpickled"
    value, file = _plant(where, run_dir, marker)
    assert main([*tiny(synthetic_flickr, run_dir), "--ckpt_path", value]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --ckpt_path: {file} is not a plain PyTorch file")
    assert "weights_only" not in line and not marker.exists()
    assert not (run_dir / "logs").exists()


def test_lightning_reads_checkpoints_without_running_them(synthetic_flickr, tmp_path, monkeypatch):
    """Whichever file Lightning itself picks (a SLURM requeue's, a checkpoint written after the
    check), its reading goes through the run's SafeCheckpointIO."""
    from showattendtell.model_file import ModelFileError
    from showattendtell.training.checkpoint_io import SafeCheckpointIO

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    cli = train_command.build_cli(tiny(synthetic_flickr, tmp_path / "run")[1:])
    assert isinstance(cli.trainer.strategy.checkpoint_io, SafeCheckpointIO)
    marker = tmp_path / "unpickled"
    _, file = _plant("path", tmp_path, marker)
    with pytest.raises(ModelFileError, match="not a plain PyTorch file"):
        cli.trainer.strategy.load_checkpoint(file)
    assert not marker.exists()


def test_a_checkpoint_of_other_sizes_is_one_line(synthetic_flickr, tmp_path, capsys):
    """Resuming with settings other than the run's (here the hidden size) is said before any
    work, not in the size-mismatch traceback of load_state_dict."""
    other = train_command.build_cli(
        [*tiny(synthetic_flickr, tmp_path / "other")[1:], "--model.decoder.hidden_dim", "48"]
    ).model
    ckpt = tmp_path / "other.ckpt"
    torch.save(
        {"hyper_parameters": {"vocab": other.hparams.vocab}, "state_dict": other.state_dict()},
        ckpt,
    )
    run_dir = tmp_path / "run"
    assert main([*tiny(synthetic_flickr, run_dir), "--ckpt_path", str(ckpt)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --ckpt_path: {ckpt} holds a model of other sizes (")
    assert "(48" in line and "config.yaml" in line
    assert not (run_dir / "logs").exists()


def test_a_malicious_encoder_weights_file_is_one_line(synthetic_flickr, tmp_path, capsys):
    """torch's own message for it advises weights_only=False, i.e. running the file."""
    marker, weights = tmp_path / "unpickled", tmp_path / "weights.pth"
    torch.save({"conv1.weight": _Tripwire(marker)}, weights)
    args = [*tiny(synthetic_flickr, tmp_path / "run"), "--model.encoder.weights", str(weights)]
    assert main(args) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"error: encoder weights {weights}: not a plain PyTorch file")
    assert "weights_only" not in line and not marker.exists()


def test_a_new_run_in_a_run_folder_with_checkpoints_is_refused(synthetic_flickr, tmp_path, capsys):
    """Lightning would write last-v1.ckpt beside the old run's last.ckpt, and the new run's
    Ctrl-C would replace the old run's interrupted.ckpt: refused, naming the resume command of
    the old run's newest checkpoint (not its best: that is kept for its score)."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for age, name in enumerate(["interrupted.ckpt", "last.ckpt", "best-epoch=03.ckpt"]):
        (folder / name).write_bytes(name.encode())
        os.utime(folder / name, (1e9 - age, 1e9 - age))
    args = tiny(synthetic_flickr, tmp_path / "run")
    assert main(args) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --run.dir {tmp_path / 'run'} already holds the checkpoints")
    assert "another --run.dir" in line
    argv = shlex.split(line.split("`")[1])
    assert argv == ["sat", *args, "--ckpt_path", str(folder / "interrupted.ckpt")]
    assert sorted(p.name for p in folder.iterdir()) == [
        "best-epoch=03.ckpt",
        "interrupted.ckpt",
        "last.ckpt",
    ]
    assert not (tmp_path / "run" / "logs").exists()


def test_the_end_of_a_run_names_the_files_lightning_wrote(tmp_path, capsys, monkeypatch):
    """A run that found last.ckpt in its way wrote last-v1.ckpt: the summary and its export
    command name that one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    best = ModelCheckpoint(dirpath=folder, filename="best-{epoch:02d}", monitor="val/bleu4")
    last = ModelCheckpoint(dirpath=folder, filename="last")
    for name in ("last.ckpt", "last-v1.ckpt", "best-epoch=00.ckpt", "best-epoch=00-v1.ckpt"):
        (folder / name).write_bytes(b"x")
    best.best_model_path = str(folder / "best-epoch=00-v1.ckpt")
    best.best_model_score = torch.tensor(0.25)
    last.best_model_path = str(folder / "last-v1.ckpt")  # a callback without a monitor
    trainer = SimpleNamespace(
        global_rank=0, checkpoint_callbacks=[best, last], current_epoch=1, global_step=2
    )
    train_command._finished(trainer, None)
    err = capsys.readouterr().err.splitlines()
    assert "best val/bleu4 0.2500: checkpoints/best-epoch=00-v1.ckpt" in err
    assert "last: checkpoints/last-v1.ckpt" in err
    assert err[-1] == (
        "make a model file of the best: sat export checkpoints/best-epoch=00-v1.ckpt "
        "MODEL.safetensors"
    )


def test_a_file_and_a_folder_given_for_each_other_are_named_so(synthetic_flickr, tmp_path, capsys):
    photo = next((synthetic_flickr / "images").glob("*.jpg"))
    assert main(tiny(photo, tmp_path / "run")) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --data.root {photo}: is a file, not a folder")
    assert main(["train", "--config", str(tmp_path)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --config {tmp_path}: is a folder, not a config file")


def test_a_data_root_that_is_not_there_is_refused_before_any_work(tmp_path, capsys):
    """The dataset readers would refuse it only once the model is built (exit status 1)."""
    run_dir, missing = tmp_path / "run", tmp_path / "missing"
    assert main(tiny(missing, run_dir)) == 2
    assert one_error_line(capsys) == (
        f"error: --data.root {missing}: no such folder: give the Flickr8k folder "
        "(Flickr8k.token.txt, Flickr_8k.*Images.txt and images/; see data/README.md)"
    )
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            ["--data.val_split", "bogus"],
            "--data.val_split bogus: the splits of flickr8k are train, dev, val, test",
        ),
        (
            ["--data.train_split", "trian"],
            "--data.train_split trian: the splits of flickr8k are train, dev, val, test",
        ),
        (
            ["--data.dataset", "coco", "--data.root", "{tmp}", "--data.train_split", "restval"],
            "--data.train_split restval: the splits of the official COCO files are train, val "
            "(test and restval need Karpathy's dataset_coco.json in {tmp})",
        ),
    ],
)
def test_a_split_the_dataset_does_not_have_is_refused_before_any_work(
    options, said, synthetic_flickr, tmp_path, capsys
):
    """load_split would refuse it only once the model is built, or the cache being filled."""
    run_dir, empty = tmp_path / "run", tmp_path / "coco"
    empty.mkdir()
    options = [o.replace("{tmp}", str(empty)) for o in options]
    assert main([*tiny(synthetic_flickr, run_dir), *options]) == 2
    assert one_error_line(capsys) == f"error: {said.replace('{tmp}', str(empty))}"
    assert not run_dir.exists()


# `sat export CKPT OUT ...`: arguments wrong in ways seen without reading CKPT, and the line
EXPORT_MISTAKES = [
    (["--interpolate", "{text}"], "{text} is a text file, not a model file: give a model file"),
    (["--interpolate", "no_such"], "--interpolate no_such: no such file, and no model of"),
    (["--interpolate", "{tmp}"], "--interpolate {tmp} is a folder: give a model file"),
    (["--interpolate", "flickr8k_lite2_soft", "--alpha", "1.5"], "--alpha 1.5: must be from 0"),
    (["--alpha", "0.3"], "--alpha 0.3 is the checkpoint's weight with --interpolate MODEL"),
    (["--consensus-root", "{tmp}/gone"], "--consensus-root {tmp}/gone: no such folder: give"),
    (
        ["--consensus-root", "{flickr}", "--consensus-split", "trian"],
        "--consensus-split trian: the splits of flickr8k are train, dev, val, test",
    ),
    (
        ["--consensus-root", "{flickr}", "--consensus-neighbours", "0"],
        "--consensus-neighbours 0: must be 1 or more",
    ),
    (["--feature-cache", "{tmp}"], "--feature-cache is for the consensus index of --consensus"),
    (
        ["--consensus-root", "{flickr}", "--feature-cache", "{tmp}"],
        "--feature-cache {tmp}: no feature cache there (no meta.json)",
    ),
]


@pytest.mark.parametrize(("options", "said"), EXPORT_MISTAKES)
def test_export_checks_its_arguments_before_reading_the_checkpoint(
    options, said, synthetic_flickr, tmp_path, monkeypatch, capsys
):
    """A checkpoint may be gigabytes on a network disk: a mistyped option is said first."""
    import showattendtell.training.lit_module

    def read(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(showattendtell.training.lit_module, "load_checkpoint", read)
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    ckpt, out = tmp_path / "last.ckpt", tmp_path / "out.safetensors"
    ckpt.write_bytes(b"not read")
    names = {"text": text, "tmp": tmp_path, "flickr": synthetic_flickr}
    options = [o.format(**names) for o in options]
    assert main(["export", str(ckpt), str(out), *options]) == 2
    assert one_error_line(capsys).startswith("error: " + said.format(**names))
    assert not out.exists()


@pytest.mark.parametrize("source", ["none.ckpt", "no_such_model"])
def test_export_of_a_checkpoint_that_is_not_there_is_a_usage_error(source, tmp_path, capsys):
    out = tmp_path / "out.safetensors"
    assert main(["export", str(tmp_path / source), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert err.startswith(f"error: checkpoint: {tmp_path / source} not found: give a .ckpt")
    assert not out.exists()


def test_export_of_a_plain_pickle_prints_only_its_error_line(tmp_path, capsys):
    src = _not_a_checkpoint("pickle", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["export", str(src), str(tmp_path / "out.safetensors")]) == 2
    assert not [w for w in caught if "pickle protocol" in str(w.message)]
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"error: checkpoint: {src} is not a")


def test_a_torchvision_built_for_another_torch_is_one_line(monkeypatch, capsys):
    """What pip leaves when it falls back to other wheels: torchvision's import fails with
    "operator torchvision::nms does not exist" deep in a traceback; `sat train --help` says
    which versions do not match and how to install a pair, in one line."""

    def broken(args):
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(train_command, "train", broken)
    assert main(["train", "--help"]) == 1
    line = one_error_line(capsys)
    from importlib import metadata

    assert f"torch {metadata.version('torch')} and torchvision " in line and "do not match" in line
    assert "pip install --force-reinstall torch==" in line


def test_export_refuses_an_output_named_other_than_safetensors(tmp_path, capsys):
    """The file holds safetensors: a .pt name would have torch.load try to unpickle it."""
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"not read")
    assert main(["export", str(ckpt), str(tmp_path / "x.pt")]) == 2
    assert one_error_line(capsys) == (
        f"error: output: {tmp_path / 'x.pt'} would hold a safetensors model file under another "
        "name; name it x.safetensors"
    )
    assert not (tmp_path / "x.pt").exists()


def test_a_data_root_that_is_not_there_is_said_before_lightning_is_imported(tmp_path):
    """The check needs only the command line and the config files: no Lightning, no torch
    (16 s on a busy machine before; now a fraction of a second)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from showattendtell.cli.main import main\n"
        f"rc = main({tiny(tmp_path / 'missing', tmp_path / 'run')!r})\n"
        "print(rc, 'lightning' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False", "False"], done.stderr
    assert "--data.root" in done.stderr and "no such folder" in done.stderr


@pytest.mark.parametrize(
    ("given", "cores", "load", "threads"),
    [
        (None, 2, 24.0, 1),  # a 2-core machine busy with other work: one thread
        (None, 2, 0.1, 2),  # an idle one: a thread a core
        (None, 16, 6.2, 10),  # what the others leave
        (3, 2, 24.0, 3),  # --run.threads decides
    ],
)
def test_training_threads_are_chosen_for_the_machine(given, cores, load, threads):
    assert train_command.cpu_threads(given, cores, load) == threads


def test_run_threads_below_one_is_refused(synthetic_flickr, tmp_path, capsys):
    assert main([*tiny(synthetic_flickr, tmp_path / "run"), "--run.threads", "0"]) == 2
    assert one_error_line(capsys) == "error: --run.threads 0: must be 1 or more (or null: chosen)"


def test_library_advice_is_not_printed(caplog):
    """Lightning's litlogger tip and the loader's advice to add workers: lines a user of
    `sat train` cannot act on. Lightning's other lines stay."""
    import logging

    train_command._quiet_library_advice()
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO):
        log.info("💡 Tip: try installing [litlogger](https://pypi.org/project/litlogger/)")
        log.info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(
            "The 'train_dataloader' does not have many workers which may be a bottleneck",
            stacklevel=1,
        )
    assert not caught


def test_the_allow_list_reads_paths_and_nothing_that_runs(tmp_path, monkeypatch):
    """A checkpoint whose hyperparameters hold a pathlib path (a setting given as one) loads;
    the allow-list adds only such plain types to torch's own."""
    from showattendtell.training.lit_module import read_checkpoint

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    ckpt = tmp_path / "paths.ckpt"
    hparams = {"vocab": ["a"], "root": Path("data/flickr8k")}
    torch.save({"state_dict": {}, "hyper_parameters": hparams}, ckpt)
    assert read_checkpoint(ckpt)["hyper_parameters"]["root"] == Path("data/flickr8k")


def test_the_best_checkpoint_named_at_the_end_is_one_on_disk(tmp_path):
    """A stop while Lightning wrote a new best leaves a state naming a file never written: the
    end of the run names the best kept on disk instead, never a missing file."""
    import os
    from types import SimpleNamespace

    from showattendtell.cli.train import _best_on_disk

    old, older = tmp_path / "best-epoch=00.ckpt", tmp_path / "best-epoch=01-v1.ckpt"
    older.write_bytes(b"x")
    old.write_bytes(b"x")
    os.utime(older, (1, 1))  # the newest on disk is epoch 00's
    missing = SimpleNamespace(best_model_path=str(tmp_path / "best-epoch=02.ckpt"))
    assert _best_on_disk(missing) == old
    assert _best_on_disk(SimpleNamespace(best_model_path=str(older))) == older
    assert _best_on_disk(SimpleNamespace(best_model_path="")) is None
    assert _best_on_disk(None) is None
    old.unlink()
    older.unlink()
    assert _best_on_disk(missing) is None


@pytest.mark.parametrize("previous", ["on disk", "none"])
def test_a_stop_while_a_new_best_is_written_saves_a_state_naming_the_one_on_disk(
    tmp_path, previous
):
    """Lightning records a new best before it writes it: the state saved to resume from names
    the previous best (with its score, read from its own file) instead of the unwritten one."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from showattendtell.cli.train import _forget_unwritten_best

    best = ModelCheckpoint(dirpath=tmp_path, monitor="val/cider", mode="max", save_top_k=1)
    old, new = tmp_path / "best-epoch=00.ckpt", tmp_path / "best-epoch=01.ckpt"
    if previous == "on disk":  # what Lightning saved in it, when it was the best
        state = {"best_model_score": torch.tensor(0.4), "best_model_path": str(old)}
        torch.save({"callbacks": {best.state_key: state}}, old)
    # mid-write: the old best forgotten, the new one recorded, its file not yet there
    best.best_k_models = {str(new): torch.tensor(0.5)}
    best.best_model_path, best.best_model_score = str(new), torch.tensor(0.5)
    best.kth_best_model_path, best.kth_value = str(new), torch.tensor(0.5)

    _forget_unwritten_best(best)

    saved = best.state_dict()
    if previous == "on disk":
        assert saved["best_model_path"] == str(old)
        assert float(saved["best_model_score"]) == pytest.approx(0.4)
        assert saved["best_k_models"] == {str(old): pytest.approx(torch.tensor(0.4))}
        assert saved["kth_best_model_path"] == str(old)
    else:
        assert saved["best_model_path"] == "" and saved["best_k_models"] == {}
        assert saved["best_model_score"] is None and saved["kth_best_model_path"] == ""
        assert float(saved["kth_value"]) == -float("inf")  # any score is a new best


def test_a_state_whose_best_is_on_disk_is_left_as_it_is(tmp_path):
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from showattendtell.cli.train import _forget_unwritten_best

    best = ModelCheckpoint(dirpath=tmp_path, monitor="val/cider", mode="max", save_top_k=1)
    written = tmp_path / "best-epoch=00.ckpt"
    written.write_bytes(b"x")
    best.best_k_models = {str(written): torch.tensor(0.5)}
    best.best_model_path, best.best_model_score = str(written), torch.tensor(0.5)
    before = dict(best.state_dict())
    _forget_unwritten_best(best)
    assert best.state_dict() == before
