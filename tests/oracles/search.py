"""Plain greedy and beam search, the tests' oracle: both search strategies of decoding.py must
give the same captions, scores, attention maps and locations. Here every beam has its own copy
of its image's grid, every row is stepped until the last image is done and each row's words are
handled in Python: slower, plain, and what the models were evaluated with."""

from __future__ import annotations

import torch

from showattendtell.network.decoder import Decoder, DecoderState
from showattendtell.search.decoding import END, START, Hypothesis, banned_tokens


def _block_repeats(logp: torch.Tensor, histories: list[list[int]], n: int) -> torch.Tensor:
    """-inf for every word that would repeat an n-gram already in its row's caption.

    The ``no_repeat_ngram_size`` of Hugging Face's generate, written out here because that
    function is tied to its own models; histories[r] is row r's caption so far.
    """
    if n <= 0:
        return logp
    rows, words = [], []
    for r, hist in enumerate(histories):
        if len(hist) < n - 1:
            continue
        prefix = hist[len(hist) - n + 1 :]
        for i in range(len(hist) - n + 1):
            if hist[i : i + n - 1] == prefix:
                rows.append(r)
                words.append(hist[i + n - 1])
    if rows:
        logp = logp.clone()
        logp[rows, words] = float("-inf")
    return logp


@torch.inference_mode()
def reference_greedy_decode(
    decoder: Decoder,
    annotations: torch.Tensor,
    max_length: int = 20,
    hard_mode: str = "argmax",
    allow_unk: bool = False,
    no_repeat_ngram: int = 0,
    min_length: int = 0,
) -> list[list[Hypothesis]]:
    """The most likely word at each step, for a batch of images (B, L, D).

    no_repeat_ngram > 0: no n-gram of that size occurs twice in a caption. min_length: no
    <end> before that many words.
    """
    B, L, _ = annotations.shape
    dev = annotations.device
    state = decoder.start(annotations)
    words = torch.full((B,), START, dtype=torch.long, device=dev)  # (N,) N rows still running
    active = torch.arange(B, device=dev)  # (N,) the image of each running row
    tokens: list[list[int]] = [[] for _ in range(B)]
    alphas: list[list[torch.Tensor]] = [[] for _ in range(B)]
    locs: list[list[int]] = [[] for _ in range(B)]
    logps = [0.0] * B
    one_cell = False
    for t in range(max_length + 1):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (N, V), (N, L), (N,)
        if t == 0:
            banned = banned_tokens(logp.size(1), dev, allow_unk)
            not_end = torch.arange(logp.size(1), device=dev) != END
            one_cell = s is not None
        logp = logp.masked_fill(banned, float("-inf"))
        logp = _block_repeats(logp, [tokens[b] for b in active.tolist()], no_repeat_ngram)
        if t < min_length:  # too short to end
            logp = logp.clone()
            logp[:, END] = float("-inf")
        if t == max_length:  # no room for another word: only <end> may follow
            logp = logp.masked_fill(not_end, float("-inf"))
        best, words = logp.max(1)  # (N,), (N,)
        keep = []
        for j, b in enumerate(active.tolist()):
            logps[b] += float(best[j])
            if int(words[j]) == END:
                continue
            tokens[b].append(int(words[j]))
            alphas[b].append(alpha[j])
            if s is not None:
                locs[b].append(int(s[j]))
            keep.append(j)
        if not keep:
            break
        if len(keep) < len(active):  # captions that ended leave the batch
            keep_t = torch.tensor(keep, device=dev)
            active, words, state = active[keep_t], words[keep_t], state.select(keep_t)
    return [
        [
            Hypothesis(
                tokens[b],
                logps[b],
                logps[b],
                torch.stack(alphas[b]) if alphas[b] else annotations.new_zeros(0, L),
                locs[b] if one_cell else None,
            )
        ]
        for b in range(B)
    ]


@torch.inference_mode()
def reference_beam_search(
    decoder: Decoder,
    annotations: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    length_penalty: float = 0.0,
    hard_mode: str = "argmax",
    allow_unk: bool = False,
    no_repeat_ngram: int = 0,
    min_length: int = 0,
) -> list[list[Hypothesis]]:
    """Beam search for a batch of images (B, L, D), all B*K beams stepped together.

    A beam that emits <end> among the top K candidates of its image is finished; an image is done
    when it has K finished captions (or at max_length). Hypotheses are ranked by
    log_prob / len**length_penalty, len counting <end>. no_repeat_ngram > 0: no n-gram of that
    size occurs twice in a caption; min_length: no <end> before that many words. Returns the K
    best per image.
    """
    B, L, _ = annotations.shape
    K, dev = beam_size, annotations.device
    # W_a a once per image, then K rows per image: beam k of image b is row b*K + k
    state: DecoderState = decoder.start(annotations).select(
        torch.arange(B, device=dev).repeat_interleave(K)
    )
    words = torch.full((B * K,), START, dtype=torch.long, device=dev)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: keep one
    hist_tokens = torch.zeros(B * K, 0, dtype=torch.long, device=dev)  # (B*K, t)
    hist_alpha = torch.zeros(B * K, 0, L, device=dev)  # (B*K, t, L)
    hist_loc = torch.zeros(B * K, 0, dtype=torch.long, device=dev)  # (B*K, t)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    one_cell = False

    def norm(logp: float, n: int) -> float:
        return logp / (n**length_penalty) if length_penalty else logp

    for t in range(max_length + 1):
        logp, alpha, s, state = decoder.step(words, state, hard_mode)  # (B*K, V), (B*K, L)
        V = logp.size(1)
        if t == 0:
            banned = banned_tokens(V, dev, allow_unk)
            one_cell = s is not None
        logp = logp.masked_fill(banned, float("-inf"))
        logp = _block_repeats(logp, hist_tokens.tolist(), no_repeat_ngram)
        if t < min_length:  # too short to end
            logp[:, END] = float("-inf")
        if t == max_length:  # no room for another word: only <end> may follow
            logp[:, torch.arange(V, device=dev) != END] = float("-inf")
        cand = (scores.view(B * K, 1) + logp).view(B, K * V)
        top, idx = cand.topk(2 * K, dim=1)  # (B, 2K): enough to refill K after some end
        beam, word = idx // V, idx % V
        is_end = (word == END) & torch.isfinite(top)

        # Finish: <end> candidates ranked within the image's top K.
        for b, j in (is_end[:, :K] & ~done.unsqueeze(1)).nonzero().tolist():
            src = b * K + int(beam[b, j])
            n = hist_tokens.size(1)
            finished[b].append(
                Hypothesis(
                    hist_tokens[src].tolist(),
                    float(top[b, j]),
                    norm(float(top[b, j]), n + 1),
                    hist_alpha[src].clone(),
                    hist_loc[src].tolist() if one_cell else None,
                )
            )
        done |= torch.tensor([len(f) >= K for f in finished], device=dev)
        if bool(done.all()) or t == max_length:
            break

        # Continue: the K best candidates that are not <end>.
        rank = torch.where(is_end | ~torch.isfinite(top), 2 * K + 1, 0) + torch.arange(
            2 * K, device=dev
        )
        keep = rank.argsort(1)[:, :K]  # (B, K) positions in the top-2K list
        new_scores = top.gather(1, keep)
        src = (beam.gather(1, keep) + torch.arange(B, device=dev).unsqueeze(1) * K).view(-1)
        words = word.gather(1, keep).view(-1)
        new_scores = torch.where(words.view(B, K) == END, float("-inf"), new_scores)
        scores = new_scores.masked_fill(done.unsqueeze(1), float("-inf"))
        state = state.select(src, same_images=True)  # src stays within each image's K rows
        hist_tokens = torch.cat([hist_tokens[src], words.unsqueeze(1)], 1)
        hist_alpha = torch.cat([hist_alpha[src], alpha[src].unsqueeze(1)], 1)
        if s is not None:
            hist_loc = torch.cat([hist_loc[src], s[src].unsqueeze(1)], 1)

    results = []
    for b in range(B):
        hyps = sorted(finished[b], key=lambda hy: hy.score, reverse=True)[:K]
        results.append(hyps)
    return results
