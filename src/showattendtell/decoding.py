"""Caption generation: the decoding options (``DecodingConfig``, checked here for every entry
point), greedy and batched beam search, and sampling for self-critical training.

Search talks to the model through two calls only: ``decoder.start(annotations) -> state`` and
``decoder.step(words, state, hard_mode) -> (log_probs, alpha, location, state)``, with
``state.select(rows)`` to reorder or drop rows. Greedy and beam search return, for every image,
hypotheses with their tokens, the attention map of every emitted word (and, for hard attention
decoded from one cell per word, the chosen location) and the caption's log-probability.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from showattendtell.decoder import Decoder, DecoderState
from showattendtell.errors import UsageError

PAD, START, END, UNK = 0, 1, 2, 3

HARD_MODES = ("argmax", "sample", "expectation")  # hard attention at inference
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

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """``value`` as this option's type, or a DecodingError naming the option and its range."""
        what = f"{self.label} ({self.flag})"
        if self.kind == "int":
            return _integer(what, value, int(self.low), int(self.high))
        if self.kind == "float":
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or not self.low <= value <= self.high):
                raise DecodingError(f"{what} must be a number from {self.low:g} to "
                                    f"{self.high:g}, not {value!r}")
            return float(value)
        if not isinstance(value, str) or value not in self.choices:
            raise DecodingError(f"{what} must be one of {', '.join(self.choices)}, not "
                                f"{value!r}")
        return value


def option(kind: str, label: str, help: str, **more: Any) -> dict[str, DecodingOption]:
    """A DecodingConfig field's metadata: its DecodingOption (named after the field later)."""
    return {"option": DecodingOption("", kind, label, help, **more)}


@dataclass
class DecodingConfig:
    """How captions are generated: stored with a model as its default, overridden per call.

    Every entry point (the CLI, the Python API, the web service, validation during training)
    builds its settings through this class, so every value is checked here and nowhere else:
    out of range is a DecodingError (exit status 2 in the CLI), never a silent default. Each
    field's ``option`` is the one declaration of its flag, UI control and API input.
    """

    beam_size: int = field(default=3, metadata=option(
        "int", "beam size", "beam width, 1-20 (1: greedy)", low=1, high=MAX_BEAM_SIZE,
        ui_label="Beam size (1: greedy)"))
    max_length: int = field(default=20, metadata=option(
        "int", "maximum length", "maximum words per caption, 1-100", low=1,
        high=MAX_CAPTION_LENGTH, ui_label="Maximum length (words)"))
    length_penalty: float = field(default=0.0, metadata=option(
        "float", "length penalty", "rank beams by log p / length**alpha, alpha from 0 to 5",
        low=0, high=MAX_LENGTH_PENALTY, step=0.1, advanced=True,
        ui_label="Length penalty (beams ranked by log p / length^penalty)"))
    hard_mode: str = field(default="argmax", metadata=option(
        "choice", "hard-attention mode",
        "hard attention only: attend to the most likely location (argmax), a sampled one "
        "(sample), or use the expected context (expectation)",
        choices=HARD_MODES, widget="radio", needs="hard",
        ui_label="Hard attention at inference",
        ui_info="argmax and sample decode each word from one grid cell (framed in white); the "
                "expected context averages all cells by their weights, like soft attention",
        ui_choices=("argmax: the most likely cell", "sample: a cell drawn from the weights",
                    "expected context (like soft attention)")))
    no_repeat_ngram: int = field(default=0, metadata=option(
        "int", "no-repeat n-gram size",
        "never repeat an N-word sequence within a caption (0: allow)", low=0,
        high=MAX_CAPTION_LENGTH, metavar="N", widget="number", advanced=True,
        ui_label="No repeated n-grams of this size (0: allow)"))
    rerank: str = field(default="none", metadata=option(
        "choice", "reranking",
        "consensus: choose among the beam's captions the one that best agrees with the "
        "captions of similar training photos (models with a consensus index; `sat models` "
        "says which)", choices=RERANKERS, widget="radio", advanced=True, needs="consensus",
        ui_label="Rerank the beam's captions",
        ui_info="consensus: the one that best agrees with the captions of similar training "
                "photos"))

    def __post_init__(self) -> None:
        for name, opt in DECODING_OPTIONS.items():
            setattr(self, name, opt.check(getattr(self, name)))

    def with_overrides(self, **overrides: Any) -> DecodingConfig:
        """A copy with the given options changed (None: keep this one's), all checked."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise DecodingError(f"unknown decoding option {unknown[0]!r}; the options are "
                                f"{', '.join(sorted(known))}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Every decoding option, in DecodingConfig's field order: the table the CLI, UI and API read.
DECODING_OPTIONS: dict[str, DecodingOption] = {
    f.name: replace(f.metadata["option"], name=f.name) for f in fields(DecodingConfig)
}


@dataclass
class Hypothesis:
    tokens: list[int]  # emitted words, without <start>/<end>
    log_prob: float  # log p(caption), <end> included when it was emitted
    score: float  # log_prob / (len ** length_penalty), what beams are ranked by
    alphas: torch.Tensor  # (len(tokens), L): attention when each word was emitted
    locations: list[int] | None  # hard attention: the location chosen for each word


def banned_tokens(vocab_size: int, device, allow_unk: bool = False) -> torch.Tensor:
    """(V,) True for the tokens no caption may contain: <pad>, <start> (and <unk>)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[[PAD, START]] = True
    if not allow_unk:
        mask[UNK] = True
    return mask


def _block_repeats(logp: torch.Tensor, histories: torch.Tensor, n: int) -> torch.Tensor:
    """-inf for every word that would repeat an n-gram already in its row's caption.

    The ``no_repeat_ngram_size`` of Hugging Face's generate, written out here because that
    function is tied to its own models; histories (N, t) is each row's caption so far. A few
    tensor ops per step, whatever the number of rows (a Python loop over the rows' histories
    cost more than a beam-3 step's bookkeeping).
    """
    t = histories.size(1)
    if n <= 0 or t < n:
        return logp
    following = histories[:, n - 1:]  # (N, t-n+1): the word after each (n-1)-gram
    if n == 1:
        match = torch.ones_like(following, dtype=torch.bool)
    else:
        windows = histories.unfold(1, n - 1, 1)[:, : t - n + 1]  # (N, t-n+1, n-1)
        match = (windows == histories[:, t - n + 1:].unsqueeze(1)).all(2)  # same as the prefix
    rows, at = match.nonzero(as_tuple=True)
    if len(rows) == 0:
        return logp
    return logp.index_put((rows, following[rows, at]), logp.new_tensor(float("-inf")))


@torch.inference_mode()
def greedy_decode(
    decoder: Decoder,
    annotations: torch.Tensor,
    max_length: int = 20,
    hard_mode: str = "argmax",
    allow_unk: bool = False,
    no_repeat_ngram: int = 0,
) -> list[list[Hypothesis]]:
    """The most likely word at each step, for a batch of images (B, L, D).

    no_repeat_ngram > 0: no n-gram of that size occurs twice in a caption. The words, maps and
    log-probabilities go into preallocated tensors, one indexed write per step, read back to
    Python once at the end: per-row Python work per word costs as much as a small batch's step.
    """
    B, L, _ = annotations.shape
    dev = annotations.device
    T = max_length + 1  # steps at most: max_length words and <end>
    state = decoder.start(annotations, word_gates=True)
    words = torch.full((B,), START, dtype=torch.long, device=dev)  # (N,) N rows still running
    active = torch.arange(B, device=dev)  # (N,) the image of each running row
    tokens = torch.full((B, T), END, dtype=torch.long, device=dev)  # (B, T): <end> after the end
    alphas = annotations.new_zeros(0)  # (B, T, L) once the maps' type is known
    locs = torch.zeros(B, T, dtype=torch.long, device=dev)
    logps = torch.zeros(B, dtype=torch.float64, device=dev)  # summed in float64, as before
    one_cell = False
    for t in range(T):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (N, V), (N, L), (N,)
        if t == 0:
            banned = banned_tokens(logp.size(1), dev, allow_unk)
            not_end = torch.arange(logp.size(1), device=dev) != END
            one_cell = s is not None
            alphas = alpha.new_zeros(B, T, L)  # bfloat16 under autocast
        logp = logp.masked_fill(banned, float("-inf"))
        if no_repeat_ngram > 0:
            logp = _block_repeats(logp, tokens[active, :t], no_repeat_ngram)
        if t == max_length:  # no room for another word: only <end> may follow
            logp = logp.masked_fill(not_end, float("-inf"))
        best, words = logp.max(1)  # (N,), (N,)
        logps[active] += best.double()
        tokens[active, t] = words
        alphas[active, t] = alpha
        if s is not None:
            locs[active, t] = s
        running = words != END
        n = int(running.sum())
        if n == 0:
            break
        if n < len(active):  # captions that ended leave the batch
            keep = running.nonzero().squeeze(1)
            active, words, state = active[keep], words[keep], state.select(keep)
    lengths = (tokens != END).sum(1).tolist()  # <end> once, at the end: words before it
    token_lists, logp_list = tokens.tolist(), logps.tolist()
    loc_lists = locs.tolist() if one_cell else None
    return [
        [Hypothesis(token_lists[b][:n], logp_list[b], logp_list[b], alphas[b, :n],
                    loc_lists[b][:n] if loc_lists is not None else None)]
        for b, n in enumerate(lengths)
    ]


@torch.inference_mode()
def beam_search(
    decoder: Decoder,
    annotations: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    length_penalty: float = 0.0,
    hard_mode: str = "argmax",
    allow_unk: bool = False,
    no_repeat_ngram: int = 0,
) -> list[list[Hypothesis]]:
    """Beam search for a batch of images (B, L, D), the beams of all images stepped together.

    A beam that emits <end> among the top K candidates of its image is finished; an image is done
    when it has K finished captions (or at max_length). Hypotheses are ranked by
    log_prob / len**length_penalty, len counting <end>. no_repeat_ngram > 0: no n-gram of that
    size occurs twice in a caption. Returns the K best per image.

    Only work that can change a result is done: the first word is predicted once per image (its
    K beams would be identical), an image that is done leaves the batch, and each image's grid
    is stored once for its K beams (DecoderState.beams).
    """
    B, L, _ = annotations.shape
    K, dev = beam_size, annotations.device
    # one row per image until the first word
    state: DecoderState = decoder.start(annotations, word_gates=True)
    words = torch.full((B,), START, dtype=torch.long, device=dev)
    scores = annotations.new_zeros(B, 1)  # (G, k): the G images still running, k beams each
    images = list(range(B))  # the image of each running group
    hist_tokens = torch.zeros(B, 0, dtype=torch.long, device=dev)  # (G*k, t)
    hist_alpha = annotations.new_zeros(B, 0, L)  # (G*k, t, L)
    hist_loc = torch.zeros(B, 0, dtype=torch.long, device=dev)  # (G*k, t)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    one_cell = False

    def norm(logp: float, n: int) -> float:
        return logp / (n**length_penalty) if length_penalty else logp

    for t in range(max_length + 1):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (G*k, V), (G*k, L)
        G, k = scores.shape
        V = logp.size(1)
        if t == 0:
            banned = banned_tokens(V, dev, allow_unk)
            not_end = torch.arange(V, device=dev) != END
            one_cell = s is not None
        logp = logp.masked_fill(banned, float("-inf"))
        if no_repeat_ngram > 0:
            logp = _block_repeats(logp, hist_tokens, no_repeat_ngram)
        if t == max_length:  # no room for another word: only <end> may follow
            logp = logp.masked_fill(not_end, float("-inf"))
        cand = (scores.view(G * k, 1) + logp).view(G, k * V)
        if k * V < 2 * K:  # a vocabulary smaller than twice the beam: pad with dead candidates
            cand = F.pad(cand, (0, 2 * K - k * V), value=float("-inf"))
        top, idx = cand.topk(2 * K, dim=1)  # (G, 2K): enough to refill K after some end
        idx = idx.clamp_max(k * V - 1)  # a padded (-inf) candidate continues a real beam, dead
        beam, word = idx // V, idx % V
        is_end = (word == END) & torch.isfinite(top)

        # Finish: <end> candidates ranked within the image's top K.
        ends = is_end[:, :K].nonzero().tolist()
        if ends:
            n = hist_tokens.size(1)
            top_l, beam_l = top.tolist(), beam.tolist()
            for g, j in ends:
                src = g * k + beam_l[g][j]
                finished[images[g]].append(Hypothesis(
                    hist_tokens[src].tolist(), top_l[g][j], norm(top_l[g][j], n + 1),
                    hist_alpha[src].clone(), hist_loc[src].tolist() if one_cell else None,
                ))
        running = [g for g, b in enumerate(images) if len(finished[b]) < K]
        if not running or t == max_length:
            break

        # Continue: the K best candidates that are not <end>, for the images still running.
        rank = torch.where(is_end | ~torch.isfinite(top), 2 * K + 1, 0) + torch.arange(
            2 * K, device=dev
        )
        keep = rank.argsort(1)[:, :K]  # (G, K) positions in the top-2K list
        new_scores = top.gather(1, keep)
        src = beam.gather(1, keep) + torch.arange(G, device=dev).unsqueeze(1) * k  # (G, K)
        words = word.gather(1, keep)  # (G, K)
        groups = None
        if len(running) < G:  # images that are done leave the batch
            groups = torch.tensor(running, device=dev)
            new_scores, src, words = new_scores[groups], src[groups], words[groups]
            images = [images[g] for g in running]
        scores = torch.where(words == END, float("-inf"), new_scores)
        src, words = src.view(-1), words.view(-1)
        state = state.regroup(src, K, groups)  # src stays within each image's rows
        hist_tokens = torch.cat([hist_tokens[src], words.unsqueeze(1)], 1)
        hist_alpha = torch.cat([hist_alpha[src], alpha[src].unsqueeze(1)], 1)
        if s is not None:
            hist_loc = torch.cat([hist_loc[src], s[src].unsqueeze(1)], 1)

    results = []
    for b in range(B):
        hyps = sorted(finished[b], key=lambda hy: hy.score, reverse=True)[:K]
        results.append(hyps)
    return results


def generate(decoder: Decoder, annotations: torch.Tensor,
             config: DecodingConfig) -> list[list[Hypothesis]]:
    """Captions for a batch of annotation grids (B, L, D) with every option of ``config``: the
    one place a decoding option reaches the search (beam 1 decodes greedily)."""
    if config.beam_size == 1:
        return greedy_decode(decoder, annotations, config.max_length, config.hard_mode,
                             no_repeat_ngram=config.no_repeat_ngram)
    return beam_search(decoder, annotations, config.beam_size, config.max_length,
                       config.length_penalty, config.hard_mode,
                       no_repeat_ngram=config.no_repeat_ngram)


@dataclass
class SampledCaptions:
    """Captions drawn from the model, laid out for a teacher-forced pass over them."""

    captions: torch.Tensor  # (B, T+1): <start> w1 .. wn <end> <pad>.. (<end> absent if cut)
    lengths: torch.Tensor  # (B,) predicted tokens: n + 1, or n for a caption cut at max_length
    locations: torch.Tensor | None  # (B, T) the sampled s_t of hard attention (-1: padding)

    def words(self, b: int) -> list[int]:
        n = int(self.lengths[b])
        return [w for w in self.captions[b, 1 : n + 1].tolist() if w != END]


@torch.no_grad()
def sample_captions(
    decoder: Decoder, annotations: torch.Tensor, max_length: int = 20,
    hard_mode: str = "sample",
) -> SampledCaptions:
    """One caption per image, each word (and, for hard attention with hard_mode "sample", each
    location) drawn from the model, for self-critical training: the caption's log-probability is
    then recomputed with gradients by a teacher-forced pass (mode "forced" for the locations).
    <pad>, <start> and <unk> are never drawn, as in decoding. A caption with no <end> after
    max_length words is cut there, without an <end>: forcing one would put a token the model did
    not choose, often at a tiny probability, into the gradient."""
    B, dev = annotations.size(0), annotations.device
    state = decoder.start(annotations)
    words = torch.full((B,), START, dtype=torch.long, device=dev)
    captions, locations = [words], []
    ended = torch.zeros(B, dtype=torch.bool, device=dev)
    for t in range(max_length + 1):
        logp, _, s, state = decoder.step(words, state, hard_mode)  # (B, V), _, (B,)
        if t == 0:
            banned = banned_tokens(logp.size(1), dev, allow_unk=False)
        logp = logp.masked_fill(banned, float("-inf"))
        words = torch.multinomial(logp.exp(), 1).squeeze(1)
        done = ended | ((words != END) if t == max_length else torch.zeros_like(ended))
        words = words.masked_fill(done, PAD)
        captions.append(words)
        if s is not None:
            locations.append(s.masked_fill(done, -1))
        ended |= words == END
        if bool(ended.all()):
            break
    caps = torch.stack(captions, 1)  # (B, T+1)
    lengths = (caps[:, 1:] != PAD).sum(1)
    return SampledCaptions(caps, lengths, torch.stack(locations, 1) if locations else None)
