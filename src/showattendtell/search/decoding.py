"""Caption generation: greedy and batched beam search, and sampling for self-critical training;
the decoding options (``DecodingConfig``, checked there for every entry point) are declared in
search/options.py, which imports no torch; the one resolved ``DecodingConfig`` is what the step
loops read (``_Masks`` turns it into the words a step may not emit).

Search talks to the model through two calls only: ``decoder.start(annotations) -> state`` and
``decoder.step(words, state, hard_mode) -> (log_probs, alpha, location, state)``, with
``state.select(rows)`` to reorder or drop rows. Greedy and beam search return, for every image,
hypotheses with their tokens, the attention map of every emitted word (and, for hard attention
decoded from one cell per word, the chosen location) and the caption's log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from showattendtell.kernels.graphed import GraphedFunction
from showattendtell.network.decoder import Decoder
from showattendtell.network.vocab import END, PAD, START, UNK

# the option table, declared where the CLI reads it without importing torch
from showattendtell.search.options import (  # noqa: F401
    DECODING_OPTIONS,
    HARD_MODES,
    MAX_BEAM_SIZE,
    MAX_CAPTION_LENGTH,
    MAX_LENGTH_PENALTY,
    RERANKERS,
    DecodingConfig,
    DecodingError,
    DecodingOption,
    option,
)


@dataclass
class Hypothesis:
    tokens: list[int]  # emitted words, without <start>/<end>
    log_prob: float  # log p(caption), <end> included when it was emitted
    score: float  # log_prob / (len ** length_penalty), what beams are ranked by
    alphas: torch.Tensor  # (len(tokens), L): attention when each word was emitted (on the
    # grids' device; on the host with the fixed strategy, copied there once per batch)
    locations: list[int] | None  # hard attention: the location chosen for each word
    consensus: float | None = None  # its consensus score when the beam was reranked by it
    # (CaptionModel.generate, consensus.py): the number that decided its rank
    word_log_probs: list[float] | None = None  # log p of each word, <end> last when emitted:
    # the numbers summed into log_prob, kept by the search for the confidence (confidence.py)


def banned_tokens(vocab_size: int, device, allow_unk: bool = False) -> torch.Tensor:
    """(V,) True for the tokens no caption may contain: <pad>, <start> (and <unk>)."""
    ids = torch.arange(vocab_size, device=device)  # compared, not indexed with a host list:
    mask = (ids == PAD) | (ids == START)  # no host-to-device copy (a CUDA graph records none)
    return mask if allow_unk else mask | (ids == UNK)


def _block_repeats(logp: torch.Tensor, histories: torch.Tensor, n: int) -> torch.Tensor:
    """-inf for every word that would repeat an n-gram already in its row's caption.

    The ``no_repeat_ngram_size`` of Hugging Face's generate, written out here because that
    function is tied to its own models; histories (N, t) is each row's caption so far. A few
    tensor ops per step, whatever the number of rows; the banned words are found with one
    ``nonzero`` (a host synchronisation, cheap on a CPU; ``_ban_repeats`` is the sync-free form).
    """
    match, following = _repeat_matches(histories, n)
    if match is None:
        return logp
    rows, at = match.nonzero(as_tuple=True)
    if len(rows) == 0:
        return logp
    return logp.index_put((rows, following[rows, at]), logp.new_tensor(float("-inf")))


def _ban_repeats(logp: torch.Tensor, histories: torch.Tensor, n: int) -> torch.Tensor:
    """What ``_block_repeats`` bans, as a fixed-shape tensor op with no host synchronisation:
    the matches are scattered as counts into an (N, V) table (a word may follow several
    matching and non-matching prefixes, so a plain boolean scatter could race)."""
    match, following = _repeat_matches(histories, n)
    if match is None:
        return logp
    counts = torch.zeros(logp.shape, dtype=torch.int32, device=logp.device)
    counts.scatter_add_(1, following, match.to(torch.int32))
    return logp.masked_fill(counts > 0, float("-inf"))


def _repeat_matches(histories: torch.Tensor, n: int):
    """(match, following), both (N, t-n+1): whether the (n-1)-gram at each position equals the
    caption's last n-1 words, and the word after it; (None, None) when nothing can repeat."""
    t = histories.size(1)
    if n <= 0 or t < n:
        return None, None
    following = histories[:, n - 1 :]  # (N, t-n+1): the word after each (n-1)-gram
    if n == 1:
        return torch.ones_like(following, dtype=torch.bool), following
    windows = histories.unfold(1, n - 1, 1)[:, : t - n + 1]  # (N, t-n+1, n-1)
    return (windows == histories[:, t - n + 1 :].unsqueeze(1)).all(2), following


SEARCH_STRATEGIES = ("auto", "shrink", "fixed", "graph")


def _strategy(strategy: str, device: torch.device) -> str | None:
    """Which search runs: None for "shrink", else "fixed" or "graph".

    "shrink": finished rows leave the batch (the least arithmetic: the fastest on a CPU).
    "fixed": every row runs every step, finished ones masked, with no host synchronisation
    inside the loop (a GPU waits for none of it, and a step keeps its shapes). "graph": the
    fixed loop recorded once per batch size as a CUDA graph and replayed (``_graphed``): on a
    GPU the host launching the loop's few hundred small kernels one by one takes longer than the
    GPU running them. "auto": graph on a GPU, shrink on a CPU. All give the same hypotheses
    (tests/search/test_decoding.py)."""
    if strategy not in SEARCH_STRATEGIES:
        raise ValueError(
            f"search strategy must be one of {', '.join(SEARCH_STRATEGIES)}, not {strategy!r}"
        )
    if strategy == "auto":
        return None if device.type == "cpu" else ("graph" if device.type == "cuda" else "fixed")
    return None if strategy == "shrink" else strategy


def _graphed(decoder: Decoder, name: str, fn, annotations: torch.Tensor, options: tuple):
    """``fn(annotations)`` (a fixed-shape loop, start included) replayed as the decoder's CUDA
    graph for this batch size and these options (the config's ``search_key``). The batch is
    padded (with empty grids, whose rows are dropped after) up to the smallest recorded graph
    that holds it, or else to a power of two, so that batches of any size share a few graphs.
    Returns ``fn``'s outputs for the real rows.

    Where there is no CUDA graph to record (a CPU: the tests) the padded batch goes through
    ``fn`` itself: the same padding, the same results."""
    B = annotations.size(0)
    padded = 1 << (B - 1).bit_length()
    graph = None
    if annotations.device.type == "cuda":
        graph = decoder.__dict__.setdefault("_search_graphs", {}).setdefault(
            name, GraphedFunction(fn)
        )
        graph.fn = fn  # records what a new key needs: the same code, this call's options
        # new weights (training, between validations): the graphs hold tables derived from the
        # old ones (the word-gate table), so they are dropped and recorded again
        graph.forget_unless(tuple((p.data_ptr(), p._version) for p in decoder.parameters()))
        # a graph recorded for a larger batch replays the padded batch sooner than a new one
        # records (the first took 0.5 s on an H100): a folder's last batch, a small request
        recorded = graph.batch_sizes(annotations, key=options)
        padded = min((n for n in recorded if n >= B), default=padded)
    if padded > B:
        annotations = F.pad(annotations, (0, 0, 0, 0, 0, padded - B))
    outputs = fn(annotations) if graph is None else graph(annotations, key=options)
    return tuple(o[:B] for o in outputs)


class _Masks:
    """The words a step may not emit, as ``config`` says: banned tokens, repeated n-grams,
    <end> before the minimum length, and anything but <end> at the last step. A mask-type
    decoding option is one line in ``__call__``. ``sync_free``: the n-gram ban without a host
    synchronisation. Whether a mask applies depends on the step ``t`` (a Python int) only, so
    the fixed-shape loops stay free of host synchronisations."""

    def __init__(self, V: int, device, config: DecodingConfig, allow_unk: bool, sync_free: bool):
        self.config = config
        self.banned = banned_tokens(V, device, allow_unk)
        self.end = torch.arange(V, device=device) == END
        self.block = _ban_repeats if sync_free else _block_repeats

    def __call__(self, logp: torch.Tensor, t: int, histories: torch.Tensor) -> torch.Tensor:
        """``logp`` (N, V) of step ``t`` (t words emitted so far, ``histories`` (N, t))."""
        c, inf = self.config, float("-inf")
        logp = logp.masked_fill(self.banned, inf)
        if c.no_repeat_ngram > 0:
            logp = self.block(logp, histories, c.no_repeat_ngram)
        if t < c.min_length:  # too short to end
            logp = logp.masked_fill(self.end, inf)
        if t == c.max_length:  # no room for another word: only <end> may follow
            logp = logp.masked_fill(~self.end, inf)
        return logp


def _config(config: DecodingConfig | None, default: DecodingConfig, options: Any):
    """``config`` (else ``default``) with keyword ``options``: what greedy_decode and
    beam_search take, a whole config or single options (the tests, benchmarks)."""
    return (config or default).with_overrides(**options) if options else (config or default)


@torch.inference_mode()
def greedy_decode(
    decoder: Decoder,
    annotations: torch.Tensor,
    config: DecodingConfig | None = None,
    *,
    allow_unk: bool = False,
    strategy: str = "auto",
    **options: Any,
) -> list[list[Hypothesis]]:
    """The most likely word at each step, for a batch of images (B, L, D), with ``config``'s
    options (its beam size and ranking aside; keyword ``options`` override single ones).

    ``allow_unk``: <unk> may be emitted (never by the entry points; the tests' oracles).
    ``strategy``: see ``_strategy``. The words, maps and log-probabilities go into preallocated
    tensors, one indexed write per step, read back to Python once at the end.
    """
    config = _config(config, DecodingConfig(beam_size=1), options)
    how = _strategy(strategy, annotations.device)
    if how is None:
        state = decoder.start(annotations, word_gates=True)
        tokens, logps, word_lps, alphas, locs = _greedy_shrink_loop(
            decoder, state, annotations, config, allow_unk
        )
    else:

        def run(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state = decoder.start(a, word_gates=True)
            out = _greedy_fixed_loop(decoder, state, a, config, allow_unk)
            return out if out[4] is not None else out[:4]

        key = (config.search_key(), allow_unk)
        out = _graphed(decoder, "greedy", run, annotations, key) if how == "graph" else None
        tokens, logps, word_lps, alphas, *locs = out or run(annotations)
        locs = locs[0] if locs else None
        alphas = alphas.cpu()  # the maps to the host in one copy, not one per caption
    lengths = (tokens != END).sum(1).tolist()  # <end> once, at the end: words before it
    token_lists, logp_list, word_lists = tokens.tolist(), logps.tolist(), word_lps.tolist()
    loc_lists = locs.tolist() if locs is not None else None
    return [
        [
            Hypothesis(
                token_lists[b][:n],
                logp_list[b],
                logp_list[b],
                alphas[b, :n],
                loc_lists[b][:n] if loc_lists is not None else None,
                word_log_probs=word_lists[b][: n + 1],
            )
        ]
        for b, n in enumerate(lengths)
    ]


def _greedy_shrink_loop(decoder, state, annotations, config: DecodingConfig, allow_unk: bool):
    """Greedy steps where a row whose caption ended leaves the batch. Returns tokens (B, T)
    (<end> after the end), log p (B,) in float64, each word's log p (B, T) in float32, maps
    (B, T, L), locations (B, T) or None."""
    B, L, _ = annotations.shape
    hard_mode = config.hard_mode
    dev, T = annotations.device, config.max_length + 1  # steps at most: the words and <end>
    words = torch.full((B,), START, dtype=torch.long, device=dev)  # (N,) N rows still running
    active = torch.arange(B, device=dev)  # (N,) the image of each running row
    tokens = torch.full((B, T), END, dtype=torch.long, device=dev)
    locs = torch.zeros(B, T, dtype=torch.long, device=dev)
    logps = torch.zeros(B, dtype=torch.float64, device=dev)  # summed in float64
    word_lps = torch.zeros(B, T, dtype=torch.float32, device=dev)
    for t in range(T):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (N, V), (N, L), (N,)
        if t == 0:
            masks = _Masks(logp.size(1), dev, config, allow_unk, False)
            alphas = alpha.new_zeros(B, T, L)  # bfloat16 under autocast
        best, words = masks(logp, t, tokens[active, :t]).max(1)  # (N,), (N,)
        logps[active] += best.double()
        word_lps[active, t] = best.float()
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
    return tokens, logps, word_lps, alphas, locs if s is not None else None


def _greedy_fixed_loop(decoder, state, annotations, config: DecodingConfig, allow_unk: bool):
    """Greedy steps over all B rows for all max_length + 1 steps, finished rows masked: no host
    synchronisation (``_greedy_shrink_loop``'s results, the same values)."""
    B, L, _ = annotations.shape
    hard_mode = config.hard_mode
    dev, T = annotations.device, config.max_length + 1
    words = torch.full((B,), START, dtype=torch.long, device=dev)
    tokens = torch.full((B, T), END, dtype=torch.long, device=dev)
    logps = torch.zeros(B, dtype=torch.float64, device=dev)
    word_lps = torch.zeros(B, T, dtype=torch.float32, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    locs = None
    for t in range(T):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (B, V), (B, L), (B,)
        if t == 0:
            masks = _Masks(logp.size(1), dev, config, allow_unk, True)
            alphas = alpha.new_zeros(B, T, L)
            if s is not None:
                locs = torch.zeros(B, T, dtype=torch.long, device=dev)
        best, words = masks(logp, t, tokens[:, :t]).max(1)
        words = words.masked_fill(done, END)
        logps += best.double().masked_fill(done, 0.0)
        word_lps[:, t] = best.float().masked_fill(done, 0.0)
        tokens[:, t], alphas[:, t] = words, alpha
        if locs is not None:
            locs[:, t] = s
        done = done | (words == END)
    return tokens, logps, word_lps, alphas, locs


def _candidates(logp: torch.Tensor, scores: torch.Tensor, K: int):
    """The 2K best continuations of each image's k beams (scores (G, k), logp (G*k, V)):
    enough to refill K after some end. Returns their scores, beams and words (G, 2K), which
    are <end>, and each one's word's log p (G, 2K) in float32."""
    G, k = scores.shape
    V = logp.size(1)
    cand = (scores.view(G * k, 1) + logp).view(G, k * V)
    if k * V < 2 * K:  # a vocabulary smaller than twice the beam: pad with dead candidates
        cand = F.pad(cand, (0, 2 * K - k * V), value=float("-inf"))
    top, idx = cand.topk(2 * K, dim=1)
    idx = idx.clamp_max(k * V - 1)  # a padded (-inf) candidate continues a real beam, dead
    beam, word = idx // V, idx % V
    rows = (beam + torch.arange(G, device=beam.device).unsqueeze(1) * k).view(-1)
    word_lp = logp[rows, word.view(-1)].view(G, 2 * K).float()  # a gather: no host sync
    return top, beam, word, (word == END) & torch.isfinite(top), word_lp


def _survivors(top, beam, word, is_end, word_lp, K: int):
    """The K best candidates that are not <end>: their scores (-inf: dead), beams, words and
    words' log p."""
    rank = torch.where(is_end | ~torch.isfinite(top), 2 * K + 1, 0) + torch.arange(
        2 * K, device=top.device
    )
    keep = rank.argsort(1)[:, :K]  # (G, K) positions in the top-2K list
    words = word.gather(1, keep)
    scores = torch.where(words == END, float("-inf"), top.gather(1, keep))
    return scores, beam.gather(1, keep), words, word_lp.gather(1, keep)


@torch.inference_mode()
def beam_search(
    decoder: Decoder,
    annotations: torch.Tensor,
    config: DecodingConfig | None = None,
    *,
    allow_unk: bool = False,
    strategy: str = "auto",
    **options: Any,
) -> list[list[Hypothesis]]:
    """Beam search for a batch of images (B, L, D), the beams of all images stepped together,
    with ``config``'s options (its ranking aside; keyword ``options`` override single ones).

    A beam that emits <end> among the top K candidates of its image is finished; an image is done
    when it has K finished captions (or at max_length). Hypotheses are ranked by
    log_prob / len**length_penalty, len counting <end>. Returns the K best per image.
    ``allow_unk``, ``strategy``: as greedy_decode's.

    The first word is predicted once per image (its K beams would be identical) and each
    image's grid is stored once for its K beams (DecoderState.beams).
    """
    config = _config(config, DecodingConfig(), options)
    beam_size, length_penalty = config.beam_size, config.length_penalty
    how = _strategy(strategy, annotations.device)
    if how is None:
        state = decoder.start(annotations, word_gates=True)  # a row per image
        finished = _beam_shrink_loop(decoder, state, annotations, config, allow_unk)
    else:

        def run(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state = decoder.start(a, word_gates=True)
            pool, count = _beam_fixed_steps(decoder, state, a, config, allow_unk)
            return (count, *(p for p in pool if p is not None))

        key = (config.search_key(), allow_unk)
        out = _graphed(decoder, "beam", run, annotations, key) if how == "graph" else None
        count, *pool = out or run(annotations)
        finished = _beam_finished(pool, count, beam_size)

    def norm(logp: float, n: int) -> float:
        return logp / (n**length_penalty) if length_penalty else logp

    return [
        sorted(
            (
                Hypothesis(tokens, logp, norm(logp, len(tokens) + 1), alphas, locs, None, lps)
                for tokens, logp, alphas, locs, lps in image
            ),
            key=lambda hy: hy.score,
            reverse=True,
        )[:beam_size]
        for image in finished
    ]


def _beam_shrink_loop(decoder, state, annotations, config: DecodingConfig, allow_unk: bool):
    """Beam steps where an image that is done leaves the batch. Returns, per image, its
    finished captions in the order they ended: (tokens, log p, maps, locations or None, each
    word's log p)."""
    B, L, _ = annotations.shape
    K, max_length, hard_mode = config.beam_size, config.max_length, config.hard_mode
    dev = annotations.device
    words = torch.full((B,), START, dtype=torch.long, device=dev)
    scores = annotations.new_zeros(B, 1)  # (G, k): the G images still running, k beams each
    images = list(range(B))  # the image of each running group
    hist_tokens = torch.zeros(B, 0, dtype=torch.long, device=dev)  # (G*k, t)
    hist_alpha = annotations.new_zeros(B, 0, L)  # (G*k, t, L)
    hist_loc = torch.zeros(B, 0, dtype=torch.long, device=dev)  # (G*k, t)
    hist_lp = torch.zeros(B, 0, dtype=torch.float32, device=dev)  # (G*k, t)
    finished: list[list[tuple]] = [[] for _ in range(B)]
    for t in range(max_length + 1):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (G*k, V), (G*k, L)
        if t == 0:
            masks = _Masks(logp.size(1), dev, config, allow_unk, False)
        k = scores.size(1)
        top, beam, word, is_end, word_lp = _candidates(masks(logp, t, hist_tokens), scores, K)
        ends = is_end[:, :K].nonzero().tolist()  # <end> within the image's top K: finished
        if ends:
            top_l, beam_l, lp_l = top.tolist(), beam.tolist(), word_lp.tolist()
            for g, j in ends:
                src = g * k + beam_l[g][j]
                finished[images[g]].append(
                    (
                        hist_tokens[src].tolist(),
                        top_l[g][j],
                        hist_alpha[src].clone(),
                        hist_loc[src].tolist() if s is not None else None,
                        [*hist_lp[src].tolist(), lp_l[g][j]],
                    )
                )
        running = [g for g, b in enumerate(images) if len(finished[b]) < K]
        if not running or t == max_length:
            break
        scores, src, words, lps = _survivors(top, beam, word, is_end, word_lp, K)  # (G, K) each
        src = src + torch.arange(len(images), device=dev).unsqueeze(1) * k
        groups = None
        if len(running) < len(images):  # images that are done leave the batch
            groups = torch.tensor(running, device=dev)
            scores, src, words, lps = scores[groups], src[groups], words[groups], lps[groups]
            images = [images[g] for g in running]
        src, words = src.view(-1), words.view(-1)
        state = state.regroup(src, K, groups)  # src stays within each image's rows
        hist_tokens = torch.cat([hist_tokens[src], words.unsqueeze(1)], 1)
        hist_lp = torch.cat([hist_lp[src], lps.view(-1, 1)], 1)
        hist_alpha = torch.cat([hist_alpha[src], alpha[src].unsqueeze(1)], 1)
        if s is not None:
            hist_loc = torch.cat([hist_loc[src], s[src].unsqueeze(1)], 1)
    return finished


def _beam_finished(pool: list[torch.Tensor], count: torch.Tensor, K: int) -> list[list[tuple]]:
    """``_beam_shrink_loop``'s finished captions from ``_beam_fixed_steps``'s pool (tokens,
    log p, lengths, words' log p, maps[, locations]) and counts: one copy to the host."""
    p_tokens, p_logp, p_len, p_lp, p_alpha, *p_loc = pool
    p_alpha = p_alpha.cpu()  # one copy of every finished caption's maps, not one per caption
    tokens, logps, lengths = p_tokens.tolist(), p_logp.tolist(), p_len.tolist()
    word_lps = p_lp.tolist()
    locs = p_loc[0].tolist() if p_loc else None
    return [
        [
            (
                tokens[b][j][: lengths[b][j]],
                logps[b][j],
                p_alpha[b, j, : lengths[b][j]],
                locs[b][j][: lengths[b][j]] if locs is not None else None,
                word_lps[b][j][: lengths[b][j] + 1],
            )
            for j in range(n)
        ]
        for b, n in enumerate(count.clamp_max(2 * K).tolist())
    ]


def _beam_fixed_steps(decoder, state, annotations, config: DecodingConfig, allow_unk: bool):
    """Beam steps over all images for all max_length + 1 steps, with no host synchronisation:
    images that are done are masked, beams reordered with gathers, finished captions scattered
    into a pool of 2K slots per image (K - 1 before the last step that can add K), in the order
    they ended. Returns the pool (tokens, log p, lengths, words' log p, maps, locations) and the
    counts (B,)."""
    B, L, _ = annotations.shape
    K, max_length, hard_mode = config.beam_size, config.max_length, config.hard_mode
    dev, T, P = annotations.device, max_length + 1, 2 * K
    words = torch.full((B,), START, dtype=torch.long, device=dev)
    scores = annotations.new_zeros(B, 1)  # (B, k)
    image = torch.arange(B, device=dev).unsqueeze(1)  # (B, 1)
    hist = [  # tokens, words' log p, maps, s
        torch.full((B, T), END, dtype=torch.long, device=dev),
        torch.zeros(B, T, dtype=torch.float32, device=dev),
        None,
        None,
    ]
    pool = [
        torch.full((B, P + 1, T), END, dtype=torch.long, device=dev),  # slot P: discarded
        torch.zeros(B, P + 1, device=dev),
        torch.zeros(B, P + 1, dtype=torch.long, device=dev),
        torch.zeros(B, P + 1, T, dtype=torch.float32, device=dev),
        None,
        None,
    ]
    count = torch.zeros(B, dtype=torch.long, device=dev)
    for t in range(T):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (B*k, V), (B*k, L)
        if t == 0:
            masks = _Masks(logp.size(1), dev, config, allow_unk, True)
            # maps in the grids' type, as the shrinking search's (float32 under autocast)
            hist[2], pool[4] = annotations.new_zeros(B, T, L), annotations.new_zeros(B, P + 1, T, L)
            if s is not None:
                hist[3], pool[5] = torch.zeros_like(hist[0]), torch.zeros_like(pool[0])
        k = scores.size(1)
        top, beam, word, is_end, word_lp = _candidates(masks(logp, t, hist[0][:, :t]), scores, K)
        ends = is_end[:, :K] & (count < K).unsqueeze(1)  # (B, K): finished, images not done
        slot = torch.where(ends, count.unsqueeze(1) + ends.cumsum(1) - 1, P)  # (B, K)
        rows = beam[:, :K] + image * k  # (B, K) the rows they end
        for p, h in zip(pool[:1] + pool[3:], hist, strict=True):
            if h is not None:
                idx = slot.view(B, K, *[1] * (h.dim() - 1)).expand(B, K, *h.shape[1:])
                p.scatter_(1, idx, h[rows])
        pool[3][:, :, t].scatter_(1, slot, word_lp[:, :K])  # the <end>'s own log p
        pool[1].scatter_(1, slot, top[:, :K].float())
        pool[2].scatter_(1, slot, torch.full_like(slot, t))
        count = count + ends.sum(1)
        if t == max_length:
            break
        scores, src, words, lps = _survivors(top, beam, word, is_end, word_lp, K)  # (B, K) each
        src, words = (src + image * k).view(-1), words.view(-1)
        state = state.regroup(src, K)  # src stays within each image's rows
        hist = [None if h is None else h[src] for h in hist]
        hist[0][:, t] = words
        hist[1][:, t] = lps.view(-1)
        hist[2][:, t] = alpha[src]
        if s is not None:
            hist[3][:, t] = s[src]
    return (
        pool[0][:, :P],
        pool[1][:, :P],
        pool[2][:, :P],
        pool[3][:, :P],
        pool[4][:, :P],
        None if pool[5] is None else pool[5][:, :P],
    ), count


def generate(
    decoder: Decoder, annotations: torch.Tensor, config: DecodingConfig, strategy: str = "auto"
) -> list[list[Hypothesis]]:
    """Captions for a batch of annotation grids (B, L, D) with every option of ``config``: the
    config handed whole to the search (beam 1 decodes greedily). ``strategy``: the search's
    strategy (see ``_strategy``), "auto" unless a test or a benchmark forces one."""
    search = greedy_decode if config.beam_size == 1 else beam_search
    return search(decoder, annotations, config, strategy=strategy)


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
    decoder: Decoder,
    annotations: torch.Tensor,
    max_length: int = 20,
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
