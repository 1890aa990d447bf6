"""Caption generation: greedy and batched beam search over the decoder's ``step``.

Both return, for every image, hypotheses with their tokens, the attention map of every emitted
word (and, for hard attention, the chosen location) and the caption's log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from showattendtell.decoder import Decoder

PAD, START, END, UNK = 0, 1, 2, 3


@dataclass
class Hypothesis:
    tokens: list[int]  # emitted words, without <start>/<end>
    log_prob: float  # log p(caption), <end> included when it was emitted
    score: float  # log_prob / (len ** length_penalty), what beams are ranked by
    alphas: torch.Tensor  # (len(tokens), L): attention when each word was emitted
    locations: list[int] | None  # hard attention: the location chosen for each word


def _banned(vocab_size: int, device, allow_unk: bool) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[[PAD, START]] = True
    if not allow_unk:
        mask[UNK] = True
    return mask


def _mode(decoder: Decoder, hard_mode: str) -> str:
    if decoder.config.attention == "soft" or hard_mode == "expectation":
        return "soft"
    return hard_mode  # "argmax" or "sample"


@torch.inference_mode()
def greedy_decode(
    decoder: Decoder,
    annotations: torch.Tensor,
    max_length: int = 20,
    hard_mode: str = "argmax",
    allow_unk: bool = False,
) -> list[list[Hypothesis]]:
    """The most likely word at each step, for a batch of images (B, L, D)."""
    B = annotations.size(0)
    mode = _mode(decoder, hard_mode)
    banned = _banned(decoder.vocab_size, annotations.device, allow_unk)
    projected = decoder.attention.project_annotations(annotations)
    h, c = decoder.init_state(annotations)
    words = torch.full((B,), START, dtype=torch.long, device=annotations.device)
    active = torch.arange(B, device=annotations.device)
    tokens = [[] for _ in range(B)]
    alphas = [[] for _ in range(B)]
    locs = [[] for _ in range(B)]
    logps = [0.0] * B
    end_only = torch.arange(decoder.vocab_size, device=annotations.device) == END
    for t in range(max_length + 1):
        logp, h, c, alpha, s = decoder.step(
            words, h, c, projected[active], annotations[active], mode
        )
        logp = logp.masked_fill(banned, float("-inf"))
        if t == max_length:  # no room for another word: only <end> may follow
            logp = logp.masked_fill(~end_only, float("-inf"))
        best, words = logp.max(1)
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
        keep_t = torch.tensor(keep, device=annotations.device)
        active, words, h, c = active[keep_t], words[keep_t], h[keep_t], c[keep_t]
    L = annotations.size(1)
    return [
        [Hypothesis(tokens[b], logps[b], logps[b],
                    torch.stack(alphas[b]) if alphas[b] else annotations.new_zeros(0, L),
                    locs[b] if mode != "soft" else None)]
        for b in range(B)
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
) -> list[list[Hypothesis]]:
    """Beam search for a batch of images (B, L, D), all B*K beams stepped together.

    A beam that emits <end> among the top K candidates of its image is finished; an image is done
    when it has K finished captions (or at max_length). Hypotheses are ranked by
    log_prob / len**length_penalty, len counting <end>. Returns the K best per image.
    """
    B, L, D = annotations.shape
    K, dev = beam_size, annotations.device
    V = decoder.vocab_size
    mode = _mode(decoder, hard_mode)
    banned = _banned(V, dev, allow_unk)

    feats = annotations.repeat_interleave(K, 0)  # (B*K, L, D)
    projected = decoder.attention.project_annotations(feats)
    h, c = decoder.init_state(feats)
    words = torch.full((B * K,), START, dtype=torch.long, device=dev)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # all beams start identical: keep one
    hist_tokens = torch.zeros(B * K, 0, dtype=torch.long, device=dev)
    hist_alpha = torch.zeros(B * K, 0, L, device=dev)
    hist_loc = torch.zeros(B * K, 0, dtype=torch.long, device=dev)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)

    def norm(logp: float, n: int) -> float:
        return logp / (n**length_penalty) if length_penalty else logp

    for t in range(max_length + 1):
        logp, h, c, alpha, s = decoder.step(words, h, c, projected, feats, mode)
        logp = logp.masked_fill(banned, float("-inf"))
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
            finished[b].append(Hypothesis(
                hist_tokens[src].tolist(), float(top[b, j]), norm(float(top[b, j]), n + 1),
                hist_alpha[src].clone(), hist_loc[src].tolist() if mode != "soft" else None,
            ))
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
        h, c = h[src], c[src]
        hist_tokens = torch.cat([hist_tokens[src], words.unsqueeze(1)], 1)
        hist_alpha = torch.cat([hist_alpha[src], alpha[src].unsqueeze(1)], 1)
        if s is not None:
            hist_loc = torch.cat([hist_loc[src], s[src].unsqueeze(1)], 1)

    results = []
    for b in range(B):
        hyps = sorted(finished[b], key=lambda hy: hy.score, reverse=True)[:K]
        results.append(hyps)
    return results
