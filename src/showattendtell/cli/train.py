"""`sat train` and `sat features`: LightningCLI over CaptionModule + CaptionDataModule, driven by
YAML configs."""

from __future__ import annotations

import csv
import logging
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from jsonargparse import ArgumentError
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.exceptions import SIGTERMException

from showattendtell.captioning.distributed import Processes, share_batches
from showattendtell.cli.train_checks import (
    check_config_files,
    check_data_settings,
    check_new_run,
    check_resume_checkpoint,
    check_run_settings,
    resume_command,
    short_type_error,
)
from showattendtell.data.datamodule import CaptionDataModule
from showattendtell.data.datasets import list_datasets
from showattendtell.errors import UsageError, UserError
from showattendtell.model_file import ModelFileError
from showattendtell.network.encoder import list_backbones
from showattendtell.network.tokenizers import list_tokenizers
from showattendtell.outputs import prepare_folder
from showattendtell.torch_files import TorchFileError, read_torch_file
from showattendtell.training.checkpoint_io import SafeCheckpointIO
from showattendtell.training.config_files import BASE_KEY, expand_bases
from showattendtell.training.lit_module import CaptionModule, read_checkpoint

INTERRUPTED_CHECKPOINT = "interrupted.ckpt"


# What every run shares unless its config says otherwise (nanoGPT's defaults-in-code spirit):
# an experiment's YAML holds only what differs. `sat train --config X --print_config` shows all.
TRAINER_DEFAULTS = {"gradient_clip_val": 5.0}
SEED_DEFAULT = 1234


@dataclass
class RunConfig:
    """Where a run writes and which checkpoint it keeps.

    Args:
        dir: the run's folder: checkpoints/ (best-EPOCH.ckpt by ``monitor``, last.ckpt every
            epoch, interrupted.ckpt on Ctrl-C), logs/ (CSV) and tb/ (TensorBoard).
        monitor: the validation score that picks the best checkpoint and stops early
            (val/bleu1, val/bleu4, val/rouge_l or val/cider; higher is better).
        patience: stop after this many validations without a better ``monitor`` (null: never).
        save_every_n_steps: also keep checkpoints/steps.ckpt, rewritten every N training steps
            (null: only at epoch ends), for long runs that may be stopped mid-epoch: resume with
            --ckpt_path on whichever of it and last.ckpt is newer.
        threads: CPU threads for the network when training on the CPU (null: chosen for the
            machine, its cores less its load: threads that wait for a core slow every step).
            Said at the start.
    """

    dir: str = "runs/default"
    monitor: str = "val/cider"
    patience: int | None = 5
    save_every_n_steps: int | None = None
    threads: int | None = None


def _latest_version(folder: Path) -> int | None:
    """N of the newest ``version_N`` folder under ``folder`` (None: none yet)."""
    found = [int(p.name[8:]) for p in folder.glob("version_*") if p.name[8:].isdigit()]
    return max(found, default=None)


class _ContinuedWriter(ExperimentWriter):
    """A resumed run's metrics.csv, continued instead of deleted (Lightning's writer removes
    the file it finds). Rows the checkpoint's training covers are kept; later ones, trained
    again after the resume, are dropped so that no step is logged twice."""

    def __init__(self, log_dir: str, from_step: int) -> None:
        self.from_step = from_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            rows, keys = list(reader), list(reader.fieldnames or [])

        def kept(row: dict) -> bool:
            try:
                step = int(float(row.get("step") or 0))
            except ValueError:
                return True
            validation = any(row.get(k) for k in keys if k.startswith("val/"))
            return step < self.from_step or (validation and step <= self.from_step)

        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(r for r in rows if kept(r))
        self.metrics_keys = sorted(keys)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """Lightning rewrites the file when a new metric appears; keep the columns the file
        already has (the earlier run's validation scores) beside the new ones."""
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            rows, old = list(reader), list(reader.fieldnames or [])
        self.metrics_keys[:] = sorted(set(fieldnames) | set(old))
        with open(self.metrics_file_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)


class ContinuedCSVLogger(CSVLogger):
    """CSVLogger writing on in an existing version folder (see _ContinuedWriter)."""

    def __init__(self, *args, from_step: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._from_step = from_step

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            Path(self.root_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir, self._from_step)
        return self._experiment


def run_loggers(run: RunConfig, ckpt_path: str | None = None) -> list:
    """CSV (logs/) and TensorBoard (tb/) logs. A run resumed from a checkpoint goes on in its
    newest version folder (one log per run, not a new version_N at every resume)."""
    csv_version = tb_version = None
    if ckpt_path is not None and Path(ckpt_path).is_file():
        csv_version = _latest_version(Path(run.dir) / "logs")
        tb_version = _latest_version(Path(run.dir) / "tb")
    if csv_version is None:
        csv_logger = CSVLogger(run.dir, name="logs")
    else:
        step = read_checkpoint(ckpt_path, "--ckpt_path", mmap=True).get("global_step", 0)
        csv_logger = ContinuedCSVLogger(
            run.dir, name="logs", version=csv_version, from_step=int(step)
        )
    return [csv_logger, TensorBoardLogger(run.dir, name="tb", version=tb_version)]


def run_callbacks(run: RunConfig) -> list[L.Callback]:
    folder = f"{run.dir}/checkpoints"
    callbacks: list[L.Callback] = [
        ModelCheckpoint(
            dirpath=folder,
            filename="best-{epoch:02d}",
            monitor=run.monitor,
            mode="max",
            save_top_k=1,
        ),
        ModelCheckpoint(dirpath=folder, filename="last"),  # the latest epoch, for resuming
    ]
    if run.save_every_n_steps:
        callbacks.append(
            ModelCheckpoint(
                dirpath=folder, filename="steps", every_n_train_steps=run.save_every_n_steps
            )
        )
    if run.patience is not None:
        callbacks.append(
            EarlyStopping(
                monitor=run.monitor,
                mode="max",
                patience=run.patience,
                check_on_train_epoch_end=False,
            )
        )
    return callbacks


class SatCLI(LightningCLI):
    check_run_dir = False  # `sat train`: the run folder must be writable before any work
    resume_from: Path | None = None  # the checkpoint --ckpt_path names (check_resume_checkpoint)

    def __init__(self, *args, command_line: list[str] | None = None, **kwargs) -> None:
        # the arguments as the user typed them, for the commands an error line suggests
        self.command_line = command_line
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(RunConfig, "run")
        parser.link_arguments("run.dir", "trainer.default_root_dir")
        # The feature cache must match the model's encoder; the model's vocabulary comes from
        # the training captions.
        parser.link_arguments("model.encoder", "data.encoder", apply_on="parse")
        parser.link_arguments("data.vocab_words", "model.vocab", apply_on="instantiate")
        # ... split by the data's tokenizer, which the model stores (its captions are joined so)
        parser.link_arguments("data.tokenizer", "model.tokenizer", apply_on="parse")
        # a config file's base (config_files.py): build_cli already put it before the file
        parser.add_argument(
            f"--{BASE_KEY}",
            type=str | None,
            default=None,
            help="in a config file: the config it builds on (relative to it)",
        )
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume training from this checkpoint (e.g. .../last.ckpt)",
        )

    def parse_arguments(self, parser, args) -> None:
        """Parse, then check what torch or Lightning would refuse only after the model and data
        are built (seconds) or training started (hours): one line now, before anything else
        is printed (the seed)."""
        super().parse_arguments(parser, args)
        check_data_settings(self.config.data)
        if self.check_run_dir:
            check_run_settings(self.config.run)
            self.resume_from = check_resume_checkpoint(
                self.config.ckpt_path, Path(self.config.run.dir)
            )
            if self.config.ckpt_path is None:
                check_new_run(Path(self.config.run.dir), self.command_line)

    def before_instantiate_classes(self) -> None:
        # the run's saved config.yaml is the whole resolved config: it builds on no other file
        self.config[BASE_KEY] = None
        # `sat train`: before the model and data are built (seconds) and training starts
        # (hours), a run folder that cannot be written is one line, not a traceback later
        if self.check_run_dir:
            prepare_folder("--run.dir", Path(self.config.run.dir))

    def instantiate_classes(self) -> None:
        """A setting that its class refuses (``--model.decoder.attention fuzzy``) is one line.
        jsonargparse wraps the class's ValueError for an ``X | None`` setting in a dump of the
        union's subtypes, chained to the class's own message, which is the one that helps."""
        try:
            super().instantiate_classes()
        except ValueError as e:
            cause = e.__cause__
            if (
                isinstance(e, UserError)
                or not isinstance(cause, ValueError)
                or not str(e).startswith("Does not validate against any of the Union subtypes")
            ):
                raise
            while isinstance(cause.__cause__, ValueError):
                cause = cause.__cause__
            raise UsageError(f"{cause} (`{self.parser.prog} --help` lists the options)") from None

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        """The Trainer with the run's loggers and checkpoints (and any the config adds)."""
        run: RunConfig = self._get(self.config_init, "run")
        trainer = self._get(self.config_init, "trainer", default={})
        if trainer.get("logger") in (None, True):
            kwargs.setdefault("logger", run_loggers(run, self._get(self.config_init, "ckpt_path")))
        kwargs["callbacks"] = [*(trainer.get("callbacks") or []), *run_callbacks(run)]
        # every checkpoint Lightning reads (--ckpt_path PATH, last, hpc, a SLURM requeue's)
        # is read without running code it names, whatever torch's defaults or environment
        kwargs["plugins"] = [*_as_list(trainer.get("plugins")), SafeCheckpointIO()]
        return super().instantiate_trainer(**kwargs)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class TrainCLI(SatCLI):
    check_run_dir = True


class SaveOnInterrupt(L.Callback):
    """On Ctrl-C or SIGTERM (``kill``, a scheduler's preemption), a checkpoint of exactly where
    training stopped (not only the last finished epoch), next to the run's other checkpoints.
    Lightning then ends the process itself. On SIGTERM Lightning first finishes the batch in
    flight and stops with a SIGTERMException (a SystemExit), which would otherwise end the run
    with exit status 0 and lose every step since the last checkpoint."""

    def __init__(self) -> None:
        self.saved: Path | None = None
        self.interrupted = False
        self.exit_status = 130  # 128 + SIGINT; 143 (128 + SIGTERM) for SIGTERM

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            return
        self.interrupted = True
        if isinstance(exception, SIGTERMException):
            self.exit_status = 143
        if trainer.global_step == 0:  # stopped before the first step (e.g. caching features)
            return
        ckpt = trainer.checkpoint_callback
        folder = (
            Path(ckpt.dirpath)
            if ckpt is not None and ckpt.dirpath
            else (Path(trainer.default_root_dir) / "checkpoints")
        )
        self.saved = folder / INTERRUPTED_CHECKPOINT
        _count_steps_for_the_logger(trainer)
        for callback in trainer.checkpoint_callbacks:
            _forget_unwritten_best(callback)
        trainer.save_checkpoint(self.saved, weights_only=False)  # a whole one, to resume


def _count_steps_for_the_logger(trainer: L.Trainer) -> None:
    """Set the step the loggers count from (Lightning's ``_batches_that_stepped``) so that the
    resumed run logs its next step at ``global_step``.

    Why: Lightning's own checkpoints are saved at a few points of a batch (its end, the end of
    validation), and on resuming it corrects the logger's count for those points. Ctrl-C
    stops training anywhere: after a step's row was logged but before it was counted, the
    resumed run logged that step twice; before the weights were updated, it skipped one.
    Lightning adds one on resuming unless the checkpoint was taken after a completed batch
    (``_TrainingEpochLoop.reset`` and ``update_restart_stage``), so the count saved is the
    steps done, less that one. With gradient accumulation its count follows other rules,
    which are left to it."""
    if trainer.accumulate_grad_batches != 1:
        return
    loop = trainer.fit_loop.epoch_loop
    done = loop.batch_progress.total
    completed = done.started == done.ready and done.completed == done.processed == done.started
    loop._batches_that_stepped = trainer.global_step - (0 if completed else 1)


def _run_dir_alias(args: list[str]) -> list[str]:
    """Lightning's usual ``--trainer.default_root_dir DIR`` means this project's ``--run.dir
    DIR`` (the run folder; the Trainer's is linked to it): rewritten, unless both are given."""
    out, given = [], []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--trainer.default_root_dir" and i + 1 < len(args):
            given.append(args[i + 1])
            out += ["--run.dir", args[i + 1]]
            i += 2
            continue
        if arg.startswith("--trainer.default_root_dir="):
            given.append(arg.split("=", 1)[1])
            arg = "--run.dir=" + given[-1]
        out.append(arg)
        i += 1
    if given and any(a == "--run.dir" or a.startswith("--run.dir=") for a in args):
        raise UsageError(
            "--trainer.default_root_dir and --run.dir name the same folder (the "
            "run's): give only --run.dir"
        )
    return out


# Lines of Lightning's (and torch's, through it) that a user of `sat train` cannot act on: an
# advert for a logging service, the loader's advice to add workers (the configs choose them; the
# feature cache needs none), Lightning's own use of deprecated torch names.
LIBRARY_ADVICE = (
    r".*does not have many workers which may be a bottleneck",
    r".*`isinstance\(treespec, LeafSpec\)` is deprecated",
    r".*weights_only",
)


class _DropAdvice(logging.Filter):
    """Drops Lightning's litlogger tip from its info lines (the rest stay)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def _quiet_library_advice() -> None:
    for pattern in LIBRARY_ADVICE:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvice) for f in log.filters):
            log.addFilter(_DropAdvice())


def registered() -> str:
    """--help's last lines: the registered backbones, datasets and tokenizers (each registry's
    names)."""
    return (
        f"backbones (--model.encoder.backbone): {', '.join(list_backbones())}. "
        f"datasets (--data.dataset): {', '.join(list_datasets())}. "
        f"tokenizers (--data.tokenizer): {', '.join(list_tokenizers())}."
    )


def build_cli(
    args: list[str], cli_class: type[SatCLI] | None = None, prog: str = "sat train"
) -> SatCLI:
    """The LightningCLI of ``prog`` (`sat train`, `sat features`): its name is what ``--help``'s
    usage line and the error lines show."""
    typed = list(args)
    # --config OVERLAY -> --config BASE --config OVERLAY; Lightning's name for the run folder
    args = _run_dir_alias(expand_bases(args))
    check_config_files(args)
    # The frozen encoder stays in eval mode on purpose (BatchNorm statistics are not trained).
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    # `sat train ARGS` hands ARGS over explicitly, so sys.argv holding them too is intended
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
    _quiet_library_advice()
    try:
        return (cli_class or SatCLI)(
            CaptionModule,
            CaptionDataModule,
            run=False,
            args=args,
            trainer_defaults=TRAINER_DEFAULTS,
            seed_everything_default=SEED_DEFAULT,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": prog,
                "default_env": False,
                "exit_on_error": False,
                "epilog": registered(),
            },
            command_line=typed,
        )
    except ArgumentError as e:
        message = short_type_error(str(e)) or str(e)
        raise UsageError(f"{message} (`{prog} --help` lists the options)") from None


def cpu_threads(given: int | None, cores: int, load: float) -> int:
    """The CPU threads to train with: ``given`` (--run.threads), else the cores the machine's
    other work leaves (``load``: its one-minute load average), at least one. Threads that
    wait for a core slow every step: torch's default of one per core made the README's
    one-minute try many times slower on a 2-core machine running other jobs."""
    if given:
        return given
    return max(1, min(cores, round(cores - load)))


def _machine_load() -> tuple[int, float]:
    """(cores this process may use, the one-minute load average; 0 where there is none)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load = 0.0
    return cores or 1, load


def _set_cpu_threads(cli: SatCLI) -> None:
    """On the CPU: set and say the threads (--run.threads, or cpu_threads' choice)."""
    if isinstance(cli.trainer.accelerator, CUDAAccelerator) or cli.trainer.global_rank != 0:
        return
    cores, load = _machine_load()
    given = cli.config.run.threads
    threads = cpu_threads(given, cores, load)
    torch.set_num_threads(threads)
    why = "--run.threads" if given else f"{cores} cores, load {load:.1f}; --run.threads sets it"
    print(
        f"training on the CPU with {threads} thread{'s' * (threads > 1)} ({why})", file=sys.stderr
    )


def train(args: list[str]) -> int:
    """Fit; on Ctrl-C or SIGTERM save where it stopped, say how to resume, and return exit
    status 130 (Ctrl-C) or 143 (SIGTERM)."""
    cli = build_cli(args, TrainCLI)
    if cli.resume_from is not None:  # before any work: the checkpoint fits this run's model
        ckpt = read_checkpoint(cli.resume_from, "--ckpt_path", mmap=True)
        try:
            cli.model.check_checkpoint(ckpt, cli.resume_from)
        except ModelFileError as e:
            raise UsageError(str(e)) from None
        del ckpt
    _set_cpu_threads(cli)  # said once the run is known to start
    on_interrupt = SaveOnInterrupt()
    cli.trainer.callbacks.append(on_interrupt)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.ckpt_path)
    except SystemExit:  # Lightning's own exit after a KeyboardInterrupt, or SIGTERM's
        if not on_interrupt.interrupted:
            raise
    if not on_interrupt.interrupted:
        _finished(cli.trainer, cli.config.ckpt_path)
        return 0
    if on_interrupt.saved is not None:
        print(
            f"interrupted at epoch {cli.trainer.current_epoch}, step "
            f"{cli.trainer.global_step}; saved {on_interrupt.saved}\nresume with:\n  "
            f"{resume_command(args, on_interrupt.saved)}",
            file=sys.stderr,
        )
    else:
        print(
            "interrupted before the first training step; run the same command again to "
            "start (features cached so far are kept)",
            file=sys.stderr,
        )
    return on_interrupt.exit_status


def _shown(path: str | Path) -> str:
    """A path as a user would type it: relative to the current folder when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _best_on_disk(best: ModelCheckpoint | None) -> Path | None:
    """The best checkpoint of ``best``'s folder that is on disk: its own best_model_path, or,
    after a stop that came while Lightning wrote a new best (its state names the file that was
    never written, and the one before it is still there), the newest best-*.ckpt."""
    if best is None or not best.best_model_path:
        return None
    path = Path(best.best_model_path)
    if path.is_file():
        return path
    kept = sorted(path.parent.glob("best-*.ckpt"), key=lambda p: p.stat().st_mtime)
    return kept[-1] if kept else None


def _forget_unwritten_best(callback: object) -> None:
    """Make ``callback``'s state name only best checkpoints that are on disk, before it is saved
    to resume from.

    Why: Lightning's ModelCheckpoint records a new best (and forgets the one it replaces)
    before it writes the file; a stop during that write leaves a state naming a file that was
    never written while the previous best is still on disk. Resumed from that state, the run's
    ``best_model_path`` would stay wrong until a new best, and the previous best file would
    never be removed. The previous best's score is read from its own file (Lightning saves
    the callback's state in it, as it was when that file was the best)."""
    if not isinstance(callback, ModelCheckpoint) or not callback.monitor:
        return
    if not callback.best_model_path or Path(callback.best_model_path).is_file():
        return
    kept = {p: s for p, s in callback.best_k_models.items() if Path(p).is_file()}
    on_disk = _best_on_disk(callback)
    if on_disk is not None and str(on_disk) not in kept:
        try:
            state = read_torch_file(on_disk, mmap=True)["callbacks"][callback.state_key]
            kept[str(on_disk)] = state["best_model_score"]
        except (TorchFileError, KeyError, TypeError):  # not a checkpoint of this callback
            pass
    callback.best_k_models = kept
    if not kept:
        callback.best_model_path, callback.best_model_score = "", None
        callback.kth_best_model_path = ""
        callback.kth_value = torch.tensor(float("inf") if callback.mode == "min" else -float("inf"))
        return
    best, worst = (min, max) if callback.mode == "min" else (max, min)
    callback.best_model_path = best(kept, key=lambda p: float(kept[p]))
    callback.best_model_score = kept[callback.best_model_path]
    callback.kth_best_model_path = worst(kept, key=lambda p: float(kept[p]))
    callback.kth_value = kept[callback.kth_best_model_path]


def _finished(trainer: L.Trainer, resumed_from: str | None) -> None:
    """The end of a run: its best validation score and where the best and last checkpoints
    are (what to export next); and a stale interrupted.ckpt removed: this run resumed from it,
    or went past it, so it could only resume an older state of the run."""
    if trainer.global_rank != 0:
        return
    best = next(
        (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.monitor),
        None,
    )
    last = next(
        (
            c
            for c in trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint) and c.filename == "last"
        ),
        None,
    )
    lines = [f"finished: {trainer.current_epoch} epochs, {trainer.global_step} steps"]
    best_path = _best_on_disk(best)
    if best_path is not None:
        score = best.best_model_score if best_path == Path(best.best_model_path) else None
        where = _shown(best_path)
        lines.append(
            f"best {best.monitor} {float(score):.4f}: {where}"
            if score is not None
            else f"best: {where}"
        )
    # the file Lightning wrote (last-v1.ckpt when a last.ckpt was in the way), not the name
    # asked for; a callback without a monitor keeps it as its best_model_path
    written = (last.last_model_path or last.best_model_path) if last is not None else ""
    if written and Path(written).is_file():
        lines.append(f"last: {_shown(written)}")
    if best_path is not None:
        lines.append(
            f"make a model file of the best: sat export "
            f"{shlex.quote(_shown(best_path))} MODEL.safetensors"
        )
    folder = Path(last.dirpath) if last is not None and last.dirpath else None
    stale = folder / INTERRUPTED_CHECKPOINT if folder is not None else None
    if stale is not None and stale.is_file():
        resumed = resumed_from is not None and Path(resumed_from).resolve() == stale.resolve()
        try:
            step = read_torch_file(stale, mmap=True).get("global_step", 0)
        except TorchFileError:  # not one this run can have gone past: kept
            step = trainer.global_step + 1
        if resumed or step <= trainer.global_step:
            stale.unlink()
            lines.append(f"removed {_shown(stale)} (this run went past it)")
    print("\n".join(lines), file=sys.stderr)


def extract_features(args: list[str]) -> int:
    """`sat features --config X.yaml`: fill the feature cache exactly as `sat train` would;
    with ``--trainer.devices N`` (and ``--trainer.num_nodes M``) N x M processes share it out."""
    cli = build_cli(args, prog="sat features")
    trainer, dm = cli.trainer, cli.datamodule
    accelerator = "cuda" if isinstance(trainer.accelerator, CUDAAccelerator) else "cpu"
    procs = Processes(trainer.num_devices, trainer.num_nodes, accelerator)
    procs.launch()
    try:
        found = dm.features_to_extract()  # on every process, before any of them writes
        procs.barrier()
        if found is not None and found[1]:
            cache, todo = found
            batches, mine = share_batches(
                len(todo), dm.hparams.extract_batch_size, procs.rank, procs.world_size
            )
            procs.share_cores(None)
            dm.extract_features(
                cache,
                [todo[i] for g in mine for i in batches[g]],
                procs.device(accelerator),
                writer=f"-r{procs.rank:03d}" if procs.world_size > 1 else "",
            )
        procs.barrier()
        if procs.rank == 0:
            dm.log_cache()
    finally:
        procs.close()
    return 0
