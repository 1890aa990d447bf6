"""What the command line is made from, in a module that imports no torch, so that `sat --help`
and `sat --version` start without it: the decoding options (``DecodingConfig``, whose fields
each declare their CLI flag, web UI control and API input once, and check their range) and the
image pipeline's default batch size. ``showattendtell.search.decoding`` and
``showattendtell.captioning.pipeline`` use them from here.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from showattendtell.errors import UsageError

# How a step turns alpha_t into the context z_t, the one vocabulary of attention modes: the most
# likely location, one sampled from alpha_t, the expected context (soft attention; hard attention
# decoded as the authors' sampler does), or a location given (teacher-forced hard training). The
# first three are a hard model's --hard-mode; "forced" is for training only.
CONTEXT_MODES = ("argmax", "sample", "expectation", "forced")
HARD_MODES = CONTEXT_MODES[:3]  # how a hard model attends at inference (--hard-mode)
RERANKERS = ("none", "consensus")  # how the beam's finished captions are ranked (consensus.py)
MAX_BEAM_SIZE = 20  # beam 500 runs for minutes at 8.6 GB: a limit, not a surprise
MAX_CAPTION_LENGTH = 100
MAX_LENGTH_PENALTY = 5.0


class DecodingError(UsageError, ValueError):
    """A decoding option out of range; the message names the option and its allowed values."""


def _integer(name: str, value: Any, lo: int, hi: int) -> int:
    """An integer option in [lo, hi]; an integral float (a UI slider's 3.0) counts as one."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok or not lo <= value <= hi:
        raise DecodingError(f"{name} must be a whole number from {lo} to {hi}, not {value!r}")
    return value


@dataclass(frozen=True)
class DecodingOption:
    """One decoding option's declaration, beside its DecodingConfig field: its range, checked
    by DecodingConfig, and everything the CLI flag (cli_common.add_decoding_args), the web UI's
    control and the API's input (service/options.py) are built from. A new option is one field
    with its ``option(...)`` here and the search code that reads it."""

    name: str  # the DecodingConfig field (filled in by DECODING_OPTIONS)
    kind: str  # "int", "float" or "choice"
    label: str  # names the option in messages: "beam size"
    help: str  # the CLI's help text
    low: float = 0  # int and float: the allowed range, both ends included
    high: float = 0
    choices: tuple[str, ...] = ()  # choice: the allowed values
    metavar: str | None = None  # the CLI's placeholder (choices: {a,b})
    ui_label: str = ""  # the web UI's label (default: the label, capitalised)
    ui_info: str = ""  # the web UI's line of explanation under the control
    ui_choices: tuple[str, ...] = ()  # the web UI's label of each choice
    widget: str = "slider"  # the web UI's control: slider, number or radio
    step: float = 1  # a slider's step
    advanced: bool = False  # under the web UI's "More decoding options"
    needs: str = ""  # "hard": hard-attention models only; "consensus": models with an index
    ranks: bool = False  # read after the search, to rank its finished captions: not a part of
    # what the step loops run (``DecodingConfig.search_key``, a recorded CUDA graph's key)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """``value`` as this option's type, or a DecodingError naming the option and its range."""
        what = f"{self.label} ({self.flag})"
        if self.kind == "int":
            return _integer(what, value, int(self.low), int(self.high))
        if self.kind == "float":
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not self.low <= value <= self.high
            ):
                raise DecodingError(
                    f"{what} must be a number from {self.low:g} to {self.high:g}, not {value!r}"
                )
            return float(value)
        if not isinstance(value, str) or value not in self.choices:
            raise DecodingError(f"{what} must be one of {', '.join(self.choices)}, not {value!r}")
        return value


def option(kind: str, label: str, help: str, **more: Any) -> dict[str, DecodingOption]:
    """A DecodingConfig field's metadata: its DecodingOption (named after the field later)."""
    return {"option": DecodingOption("", kind, label, help, **more)}


@dataclass(frozen=True)
class DecodingConfig:
    """How captions are generated: stored with a model as its default, overridden per call.

    Every entry point (the CLI, the Python API, the web service, validation during training)
    resolves its overrides once into one of these, so every value is checked here and nowhere
    else: out of range is a DecodingError (exit status 2 in the CLI), never a silent default.
    Each field's ``option`` is the one declaration of its flag, UI control and API input. The
    object then travels whole, down to the search's step loops (search/decoding.py); frozen, so
    that it is hashable (the key of a recorded search) and nothing on the way changes it.
    New fields go last: the web API's inputs follow this order.
    """

    beam_size: int = field(
        default=3,
        metadata=option(
            "int",
            "beam size",
            "beam width, 1-20 (1: greedy)",
            low=1,
            high=MAX_BEAM_SIZE,
            ui_label="Beam size (1: greedy)",
        ),
    )
    max_length: int = field(
        default=20,
        metadata=option(
            "int",
            "maximum length",
            "maximum words per caption, 1-100",
            low=1,
            high=MAX_CAPTION_LENGTH,
            ui_label="Maximum length (words)",
        ),
    )
    length_penalty: float = field(
        default=0.0,
        metadata=option(
            "float",
            "length penalty",
            "rank beams by log p / length**alpha, alpha from 0 to 5",
            low=0,
            high=MAX_LENGTH_PENALTY,
            step=0.1,
            advanced=True,
            ranks=True,
            ui_label="Length penalty (beams ranked by log p / length^penalty)",
        ),
    )
    hard_mode: str = field(
        default="argmax",
        metadata=option(
            "choice",
            "hard-attention mode",
            "hard attention only: attend to the most likely location (argmax), a sampled one "
            "(sample), or use the expected context (expectation)",
            choices=HARD_MODES,
            widget="radio",
            needs="hard",
            ui_label="Hard attention at inference",
            ui_info="argmax and sample decode each word from one grid cell (framed in white); the "
            "expected context averages all cells by their weights, like soft attention",
            ui_choices=(
                "argmax: the most likely cell",
                "sample: a cell drawn from the weights",
                "expected context (like soft attention)",
            ),
        ),
    )
    no_repeat_ngram: int = field(
        default=0,
        metadata=option(
            "int",
            "no-repeat n-gram size",
            "never repeat an N-word sequence within a caption (0: allow)",
            low=0,
            high=MAX_CAPTION_LENGTH,
            metavar="N",
            widget="number",
            advanced=True,
            ui_label="No repeated n-grams of this size (0: allow)",
        ),
    )
    rerank: str = field(
        default="none",
        metadata=option(
            "choice",
            "reranking",
            "consensus: choose among the beam's captions the one that best agrees with the "
            "captions of similar training photos (models with a consensus index; `sat models` "
            "says which)",
            choices=RERANKERS,
            widget="radio",
            advanced=True,
            needs="consensus",
            ui_label="Rerank the beam's captions",
            ui_info="consensus: the one that best agrees with the captions of similar training "
            "photos",
            ranks=True,
        ),
    )
    min_length: int = field(
        default=0,
        metadata=option(
            "int",
            "minimum length",
            "at least N words per caption: <end> is not emitted before (0: no minimum; at most "
            "the maximum length)",
            low=0,
            high=MAX_CAPTION_LENGTH,
            metavar="N",
            widget="number",
            advanced=True,
            ui_label="Minimum length (words; 0: none)",
        ),
    )

    def __post_init__(self) -> None:
        for name, opt in DECODING_OPTIONS.items():  # frozen: set through object's own setattr
            object.__setattr__(self, name, opt.check(getattr(self, name)))
        if self.min_length > self.max_length:
            raise DecodingError(
                f"minimum length (--min-length) {self.min_length} is more than the maximum "
                f"length (--max-length) {self.max_length}: give at most {self.max_length}"
            )

    @property
    def reranks_by_consensus(self) -> bool:
        """Whether the beam's finished captions are reranked by consensus: asked for, and a
        beam to choose from (greedy search has one caption)."""
        return self.rerank == "consensus" and self.beam_size > 1

    def search_key(self) -> tuple:
        """The values the step loops run with (every option but those that only rank the
        finished captions): a recorded search is replayed for any config of the same key."""
        return tuple(getattr(self, n) for n, opt in DECODING_OPTIONS.items() if not opt.ranks)

    def with_overrides(self, **overrides: Any) -> DecodingConfig:
        """A copy with the given options changed (None: keep this one's), all checked."""
        return replace(self, **check_overrides(**overrides))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Every decoding option, in DecodingConfig's field order: the table the CLI, UI and API read.
DECODING_OPTIONS: dict[str, DecodingOption] = {
    f.name: replace(f.metadata["option"], name=f.name) for f in fields(DecodingConfig)
}


def check_overrides(**overrides: Any) -> dict[str, Any]:
    """The given options (None: not given), each checked on its own before a model is loaded:
    an unknown name or a value out of its range is a DecodingError. What depends on another
    option (a minimum length above the maximum) is checked when the overrides meet a model's
    stored settings (``DecodingConfig.with_overrides``)."""
    unknown = sorted(set(overrides) - set(DECODING_OPTIONS))
    if unknown:
        raise DecodingError(
            f"unknown decoding option {unknown[0]!r}; the options are "
            f"{', '.join(sorted(DECODING_OPTIONS))}"
        )
    return {k: DECODING_OPTIONS[k].check(v) for k, v in overrides.items() if v is not None}


DEFAULT_BATCH_SIZE = 32  # a search step reads all the decoder's weights whatever its rows, so
# 32 images share that cost better than 16 (benchmarks/README.md); the CNN runs in slices anyway


DEVICES = "auto, cpu, cuda or cuda:N"  # what --device and load_model(device=) take


def is_device_name(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value) is not None


def ignored_decoding(decoding: dict, captioner, api: bool = False) -> list[str]:
    """One sentence for each decoding option given (not None) for a model that ignores it
    (--hard-mode for a soft-attention model: ``Captioner.applies``), naming the option as the
    CLI (--hard-mode) or, with ``api``, the Python API (hard_mode) does. A reranking a model
    cannot do is refused instead (``Captioner.check_decoding``)."""
    return [
        f"{opt.name if api else opt.flag} is for hard-attention models; {captioner.name} has "
        "soft attention and ignores it"
        for opt in DECODING_OPTIONS.values()
        if decoding.get(opt.name) is not None and opt.needs == "hard" and not captioner.applies(opt)
    ]
