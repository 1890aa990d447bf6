"""The LSTM decoder of Show, Attend and Tell.

    h_0, c_0 = f_init_h(mean_i a_i), f_init_c(mean_i a_i)
    [i f o g] = W [E y_{t-1}; h_{t-1}; z_t] + b ;  c_t = f*c_{t-1} + i*g ;  h_t = o*tanh(c_t)
    p(y_t) ~ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))          deep output layer (eq. 7)

with z_t = beta_t * sum_i alpha_ti a_i (attention.py) attending from h_{t-1}, before the LSTM
step (``attend="before"``, the paper). ``attend="after"`` is the spatial attention of Lu et al.
2017 ("Knowing when to look"), the decoder of the strongest CNN+LSTM results on Flickr: the LSTM
reads the mean annotation instead of z_t, [i f o g] = W [E y_{t-1}; h_{t-1}; mean_i a_i] + b,
and z_t attends from the new h_t, so it reaches only the output layer (and the word it helps
predict has already been fed in as y_{t-1}).

Fast path: what does not change per word is computed once per caption or once per batch: W_a a
(attention.project_annotations), the embedding part of the LSTM gates for all steps, and the deep
output + vocabulary projection for all tokens after the recurrence. The recurrent matmul, U_a h
and f_beta h are one fused matmul. On a CPU rows whose caption has ended are dropped (captions
sorted by length, as in pack_padded_sequence); on a GPU every row runs every step with a loss
mask (Decoder.forward's ``fixed_shape``). In a teacher-forced pass the per-word matmuls' weights
get their gradients in one product after the last word (deferred_linear.py), and the LSTM cell's
backward pass is written out (lstm_cell.py): a GPU runs a word's many small operations one
kernel each, so fewer of them make its step faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from showattendtell.kernels.deferred_linear import DeferredLinear
from showattendtell.kernels.lstm_cell import lstm_cell
from showattendtell.kernels.piecewise_scores import SharedKeys
from showattendtell.network.attention import (
    AdditiveAttention,
    attention_entropy,
    expected_context,
    gather_locations,
    sample_locations,
)
from showattendtell.network.vocab import END


@dataclass
class DecoderConfig:
    """Sizes of the decoder. ``attention``: "soft" or "hard". ``attend``: "before" the LSTM
    step, from h_{t-1} (the paper), or "after" it, from h_t (Lu et al. 2017's spatial
    attention; see the module docstring)."""

    attention: str = "soft"
    embed_dim: int = 512
    hidden_dim: int = 1024
    attention_dim: int = 512
    dropout: float = 0.5
    attend: str = "before"

    def __post_init__(self) -> None:
        if self.attention not in ("soft", "hard"):
            raise ValueError(f"attention must be 'soft' or 'hard', not {self.attention!r}")
        if self.attend not in ("before", "after"):
            raise ValueError(f"attend must be 'before' or 'after', not {self.attend!r}")


@dataclass
class TeacherForcedOutput:
    """Everything the losses need. Token tensors are time-major: packed (the N real tokens,
    captions by length) from the shrinking recurrence, or all B x T positions with
    ``token_mask`` from the fixed-shape one (no host synchronisation to pick the real ones)."""

    logits: torch.Tensor  # (N, V)
    targets: torch.Tensor  # (N,)
    caption_index: torch.Tensor  # (N,) which caption (original order) each token belongs to
    alphas: torch.Tensor  # (B, T, L), zero after a caption's end
    location_log_prob: torch.Tensor | None  # (B,) sum_t log alpha_{t, s_t} (hard only)
    entropy: torch.Tensor | None  # (B,) sum_t H[alpha_t] (hard only)
    locations: torch.Tensor | None  # (B, T) sampled s_t, -1 after the end (hard only)
    token_mask: torch.Tensor | None = None  # (N,) True for real tokens; None: all are real

    @property
    def n_tokens(self) -> torch.Tensor | int:
        """The real tokens' count (a tensor where it is masked: no host synchronisation)."""
        return self.targets.numel() if self.token_mask is None else self.token_mask.sum()


@dataclass
class DecoderState:
    """What search carries from one word to the next, one row per partial caption.

    Rows come in groups of ``beams`` consecutive rows per image (beam search: the K beams of an
    image), and the grids are stored once per image, not once per row: beams of one image
    attend to the same grid, and copying it K times would cost more memory traffic than the
    attention itself.
    """

    h: torch.Tensor  # (N, H) LSTM hidden state
    c: torch.Tensor  # (N, H) LSTM cell state
    projected: torch.Tensor  # (N / beams, L, A) W_a a_i + b of each image
    annotations: torch.Tensor  # (N / beams, L, D) each image's annotation grid
    beams: int = 1  # rows per image
    word_gates: torch.Tensor | None = None  # (V, 4H) Decoder.word_gates(), or None
    image_gates: torch.Tensor | None = None  # (N / beams, 4H) W mean_i a_i (attend "after")

    def _images(self, images: torch.Tensor) -> dict:
        gates = None if self.image_gates is None else self.image_gates[images]
        return {
            "projected": self.projected[images],
            "annotations": self.annotations[images],
            "image_gates": gates,
        }

    def select(self, rows: torch.Tensor, same_images: bool = False) -> DecoderState:
        """The state of rows ``rows`` (N',): reorders beams, repeats images, drops finished
        captions. ``same_images``: every selected row attends to the same image as the row at
        its new position (beams of one image re-ranked), so the grids need no copy."""
        if same_images:
            return replace(self, h=self.h[rows], c=self.c[rows])
        images = rows if self.beams == 1 else torch.div(rows, self.beams, rounding_mode="floor")
        return replace(self, h=self.h[rows], c=self.c[rows], beams=1, **self._images(images))

    def regroup(
        self, rows: torch.Tensor, beams: int, images: torch.Tensor | None = None
    ) -> DecoderState:
        """Rows ``rows`` as groups of ``beams`` rows per image, for the images ``images`` (the
        groups still running, in order; None: all of them). Each selected row must belong to
        the image of its new group: beam search keeps beams within their image."""
        if images is None:
            return replace(self, h=self.h[rows], c=self.c[rows], beams=beams)
        return replace(self, h=self.h[rows], c=self.c[rows], beams=beams, **self._images(images))


class Matmuls(NamedTuple):
    """The matmuls of one word that take h or z (Decoder.matmuls)."""

    hidden: Callable[[torch.Tensor], torch.Tensor]  # h (N, H) -> (N, 4H + A + 1) or (N, 4H)
    attend: Callable[[torch.Tensor], torch.Tensor] | None  # h_t -> (N, A + 1): attend "after"
    context: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # z (N, D), gates -> + W z
    beta_bias: torch.Tensor | None  # f_beta's bias where ``hidden`` / ``attend`` leave it out


class Step(NamedTuple):
    """One word of decoding for every row of a DecoderState."""

    log_probs: torch.Tensor  # (N, V) log p(y_t | y_<t, a)
    alpha: torch.Tensor  # (N, L) attention over the grid
    location: torch.Tensor | None  # (N,) the one attended cell s_t (None: expected context)
    state: DecoderState


class Decoder(nn.Module):
    def __init__(self, vocab_size: int, feature_dim: int, config: DecoderConfig):
        super().__init__()
        self.config = config
        E, H, A = config.embed_dim, config.hidden_dim, config.attention_dim
        self.vocab_size, self.feature_dim = vocab_size, feature_dim
        self.embedding = nn.Embedding(vocab_size, E)
        self.init_h = nn.Linear(feature_dim, H)
        self.init_c = nn.Linear(feature_dim, H)
        self.attention = AdditiveAttention(feature_dim, A)
        if config.attend == "before":
            # One matmul of h_{t-1} gives the LSTM's recurrent term, U_a h_{t-1} and
            # f_beta(h_{t-1}).
            self.hidden_proj = nn.Linear(H, 4 * H + A + 1, bias=False)
            self.attend_proj = None
        else:  # the recurrent term from h_{t-1}; U_a h_t and f_beta(h_t) after the step
            self.hidden_proj = nn.Linear(H, 4 * H, bias=False)
            self.attend_proj = nn.Linear(H, A + 1, bias=False)
        self.gate_embed = nn.Linear(E, 4 * H)  # embedding part of W, with the LSTM bias b
        # the context part of W (attend "before": of z_t; "after": of mean_i a_i)
        self.gate_context = nn.Linear(feature_dim, 4 * H, bias=False)
        self.beta_bias = nn.Parameter(torch.zeros(1))  # f_beta's bias
        self.out_hidden = nn.Linear(H, E)  # L_h
        self.out_context = nn.Linear(feature_dim, E, bias=False)  # L_z
        self.out_vocab = nn.Linear(E, vocab_size)  # L_o
        self.dropout = nn.Dropout(config.dropout)
        self._word_gates: tuple[tuple, torch.Tensor] | None = None  # see word_gates()

    # -- the equations, one step ------------------------------------------------------------

    def init_state(self, annotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = annotations.mean(1)
        return self.init_h(mean), self.init_c(mean)

    def recurrent_step(
        self,
        gate_x: torch.Tensor,
        h: torch.Tensor,
        c: torch.Tensor,
        projected: torch.Tensor | SharedKeys,
        annotations: torch.Tensor,
        mode: str,
        locations: torch.Tensor | None = None,
        beams: int = 1,
        matmuls: Matmuls | None = None,
    ):
        """Attend and update the LSTM for one word.

        gate_x is the input part of the gates, (B, 4H): the embedding's (and with attend
        "after" the mean annotation's). mode (search.options.CONTEXT_MODES): "expectation" (the
        expected context, soft attention), "sample" (hard, s_t ~ alpha_t), "argmax" (hard, most
        likely location) or "forced" (hard, s_t given in ``locations``). ``beams`` > 1: rows come in
        groups of that many per image of ``projected`` / ``annotations`` (see DecoderState).
        ``matmuls``: those of a teacher-forced pass (``matmuls(deferred=True)``); None: the
        layers themselves. Returns h, c, z, alpha, s_t (None for the expected context).
        """
        H, A = self.config.hidden_dim, self.config.attention_dim
        mm = matmuls or self.matmuls()
        hp = mm.hidden(h)
        # split, not sliced: the backward pass joins the parts' gradients in one operation,
        # where each slice would zero-fill a gradient of the whole and add it
        if mm.attend is not None:  # attend "after": the LSTM step first, then attend
            h, c = lstm_cell(gate_x + hp, c)
            att_h, beta = mm.attend(h).split([A, 1], dim=1)
            z, alpha, s = self._attend(
                att_h, beta, mm.beta_bias, projected, annotations, mode, locations, beams
            )
            return h, c, z, alpha, s
        recurrent, att_h, beta = hp.split([4 * H, A, 1], dim=1)
        z, alpha, s = self._attend(
            att_h, beta, mm.beta_bias, projected, annotations, mode, locations, beams
        )
        h, c = lstm_cell(mm.context(z, gate_x + recurrent), c)
        return h, c, z, alpha, s

    def matmuls(self, deferred: bool = False) -> Matmuls:
        """The per-word matmuls of h and z. ``deferred``: as DeferredLinear, for the words of
        one teacher-forced pass (each weight's gradient one product after every word, f_beta's
        bias added by the matmul); otherwise the layers themselves (search, one word a call)."""
        if not deferred:
            return Matmuls(
                self.hidden_proj,
                self.attend_proj,
                lambda z, gates: gates + self.gate_context(z),
                self.beta_bias,
            )
        # f_beta's bias as the last entry of the bias of the matmul that gives f_beta(h)
        beta_of = self.hidden_proj if self.attend_proj is None else self.attend_proj
        bias = F.pad(self.beta_bias, (beta_of.out_features - 1, 0))  # (out,), zeros but one
        if self.attend_proj is None:
            hidden, attend = DeferredLinear(self.hidden_proj.weight, bias), None
        else:
            hidden = DeferredLinear(self.hidden_proj.weight)
            attend = DeferredLinear(self.attend_proj.weight, bias)
        context = DeferredLinear(self.gate_context.weight)
        return Matmuls(hidden, attend, lambda z, gates: context(z, add=gates), None)

    def _attend(
        self,
        att_h: torch.Tensor,
        beta: torch.Tensor,
        beta_bias: torch.Tensor | None,
        projected: torch.Tensor | SharedKeys,
        annotations: torch.Tensor,
        mode: str,
        locations: torch.Tensor | None,
        beams: int,
    ):
        """z_t, alpha_t and s_t (None for soft) from U_a h and f_beta(h) (``beta_bias``: the
        bias still to add to f_beta(h); None: it is in already)."""
        alpha = self.attention.weights(projected, att_h, beams)
        if mode == "expectation":
            if beams == 1:
                s, context = None, expected_context(alpha, annotations)
            else:
                G, L, D = annotations.shape
                s, context = None, torch.bmm(alpha.view(G, beams, L), annotations).view(-1, D)
        else:
            if mode == "sample":
                s = sample_locations(alpha.detach())
            elif mode == "argmax":
                s = alpha.argmax(1)
            elif mode == "forced":
                s = locations
            else:
                raise ValueError(f"unknown attention mode {mode!r}")
            if beams == 1:
                context = gather_locations(annotations, s)
            else:
                image = torch.div(
                    torch.arange(len(s), device=s.device), beams, rounding_mode="floor"
                )
                context = annotations[image, s]
        if beta_bias is not None:
            beta = beta + beta_bias
        z = torch.sigmoid(beta) * context
        return z, alpha, s

    def image_gates(self, annotations: torch.Tensor) -> torch.Tensor | None:
        """W mean_i a_i, (B, 4H): what the LSTM reads of the image at every step with attend
        "after" (None with "before", where it reads z_t)."""
        return None if self.attend_proj is None else self.gate_context(annotations.mean(1))

    def deep_output(self, emb: torch.Tensor, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Logits L_o(E y_{t-1} + L_h h_t + L_z z_t), with dropout on the sum."""
        return self.out_vocab(self.dropout(emb + self.out_hidden(h) + self.out_context(z)))

    # -- inference: the two calls search uses (decoding.py) -----------------------------------

    WORD_GATES_MAX_BYTES = 64 * 2**20  # a 10k-word LSTM-1024 model's table would be 164 MB

    def word_gates(self) -> torch.Tensor | None:
        """The embedding part of the LSTM gates for every word, (V, 4H), or None where the
        table would be too large or under autocast.

        Inference looks the rows up instead of a (N, E) x (E, 4H) matmul per word: 14 % of a
        word's multiply-adds and of the weights read per step for the bundled model. Built once
        (V rows, as many as a few batches' words) and kept until the weights change.
        """
        w, lin = self.embedding.weight, self.gate_embed
        if (
            self.vocab_size * lin.out_features * w.element_size() > self.WORD_GATES_MAX_BYTES
            or torch.is_autocast_enabled(w.device.type)
        ):
            return None
        key = tuple(
            (t.data_ptr(), t._version, t.dtype, t.device) for t in (w, lin.weight, lin.bias)
        )
        if self._word_gates is None or self._word_gates[0] != key:
            with torch.no_grad():
                self._word_gates = (key, lin(w))
        return self._word_gates[1]

    def start(self, annotations: torch.Tensor, word_gates: bool = False) -> DecoderState:
        """The state before the first word, for annotation grids (B, L, D). ``word_gates``:
        look the embedding part of the gates up in a table (search at inference)."""
        h, c = self.init_state(annotations)  # (B, H) each
        return DecoderState(
            h,
            c,
            self.attention.project_annotations(annotations),
            annotations,
            word_gates=self.word_gates() if word_gates else None,
            image_gates=self.image_gates(annotations),
        )

    def step(
        self, prev_words: torch.Tensor, state: DecoderState, hard_mode: str = "argmax"
    ) -> Step:
        """Attend and predict the next word for every row, given the previous words (N,).

        Soft attention always uses the expected context. Hard attention attends to one cell:
        the most likely one (hard_mode "argmax") or a sampled one ("sample"); "expectation" gives
        it the expected context instead (how the authors' released sampler decodes).
        """
        mode = "expectation" if self.config.attention == "soft" else hard_mode
        emb = self.embedding(prev_words)  # (N, E)
        gate_x = self.gate_embed(emb) if state.word_gates is None else state.word_gates[prev_words]
        if state.image_gates is not None:  # (N / beams, 4H): each image's row for its beams
            gate_x = (
                gate_x.view(-1, state.beams, gate_x.size(1)) + state.image_gates.unsqueeze(1)
            ).view_as(gate_x)
        h, c, z, alpha, s = self.recurrent_step(
            gate_x,
            state.h,
            state.c,
            state.projected,
            state.annotations,
            mode,
            beams=state.beams,
        )
        log_probs = F.log_softmax(self.deep_output(emb, h, z), dim=-1)  # (N, V)
        return Step(log_probs, alpha, s, replace(state, h=h, c=c))

    # -- training: teacher forcing over whole captions ---------------------------------------

    def forward(
        self,
        annotations: torch.Tensor,
        captions: torch.Tensor,
        lengths: torch.Tensor,
        mode: str = "expectation",
        locations: torch.Tensor | None = None,
        fixed_shape: bool | None = None,
    ) -> TeacherForcedOutput:
        """Teacher-forced pass. captions (B, T+1) = <start> w1 .. wn <end> <pad>..;
        lengths (B,) = n + 1 predicted tokens per caption. mode: "expectation", "sample" (hard
        training) or "forced" (hard, with s_t from ``locations`` (B, T)).

        Two recurrences, the same values: ``fixed_shape`` runs every caption for all T steps
        and masks what follows its end (the same tensor shapes every step, no host
        synchronisation inside the loop: what a GPU, CUDA graphs and torch.compile need);
        otherwise captions sorted by length leave the batch as they end (fewer multiply-adds:
        faster on a CPU). None: fixed on a GPU, shrinking on a CPU.
        """
        if fixed_shape is None:
            fixed_shape = annotations.device.type != "cpu"
        lengths = lengths.to(annotations.device)
        if fixed_shape:
            return self._forward_fixed(annotations, captions, lengths, mode, locations)
        return self._forward_packed(annotations, captions, lengths, mode, locations)

    def _inputs(self, a: torch.Tensor, caps: torch.Tensor, T: int):
        """What does not depend on h, for all steps at once: the embeddings (B, T, E), their
        share of the gates (with attend "after" the image's too) (B, T, 4H), W_a a (B, L, A;
        AdditiveAttention.shared_keys), h_0, c_0, the pass's matmuls (``matmuls``) and the grid
        as the words read it (B, L, D).

        Under autocast that grid is cast to autocast's dtype here, once: autocast would cast
        it for every word's context (at batch 64 a 100 MB read and a 50 MB write a word in
        bf16, more than the context itself). Not where the grid takes a gradient (a trained
        encoder): there every word's gradient is cast back and summed in float32."""
        emb = self.embedding(caps[:, :T])  # (B, T, E): inputs y_0..y_{T-1}
        gate_x = self.gate_embed(emb)  # (B, T, 4H), all steps in one matmul
        image_gates = self.image_gates(a)  # (B, 4H) or None
        if image_gates is not None:
            gate_x = gate_x + image_gates.unsqueeze(1)
        # (B, L, A), once per caption; on a CPU one gradient buffer for all words
        projected = self.attention.shared_keys(self.attention.project_annotations(a))
        h, c = self.init_state(a)  # (B, H) each
        # torch.compile takes the plain matmuls: it fuses and schedules the pass itself
        matmuls = self.matmuls(deferred=not torch.compiler.is_compiling())
        grid, device = a, a.device.type
        if torch.is_autocast_enabled(device) and not a.requires_grad:
            grid = a.to(torch.get_autocast_dtype(device))
        return emb, gate_x, projected, h, c, matmuls, grid

    def _forward_fixed(
        self,
        a: torch.Tensor,
        caps: torch.Tensor,
        lengths: torch.Tensor,
        mode: str,
        locations: torch.Tensor | None,
    ) -> TeacherForcedOutput:
        """All B captions for all T steps, a loss mask after each caption's end: the same
        shapes for every batch of one (B, T), no host synchronisation anywhere (so the whole
        step can be one CUDA graph: graphed.py)."""
        B, T = caps.size(0), caps.size(1) - 1
        live = torch.arange(T, device=a.device) < lengths.unsqueeze(1)  # (B, T)
        emb, gate_x, projected, h, c, mm, grid = self._inputs(a, caps, T)
        gates = gate_x.unbind(1)  # T x (B, 4H): see _forward_packed
        forced = None if locations is None else locations[:, :T].clamp_min(0)
        hs, zs, alphas, ss = [], [], [], []
        for t in range(T):
            s_t = None if forced is None else forced[:, t]
            h, c, z, alpha, s = self.recurrent_step(
                gates[t], h, c, projected, grid, mode, s_t, 1, mm
            )
            hs.append(h)
            zs.append(z)
            alphas.append(alpha)
            ss.append(s)
        alphas_bt = torch.stack(alphas, 1) * live.unsqueeze(2).to(alphas[0].dtype)  # (B, T, L)

        def tokens(x: torch.Tensor) -> torch.Tensor:  # (B, T, ...) -> (T * B, ...), time-major
            return x.transpose(0, 1).reshape(B * T, *x.shape[2:])

        logits = self.deep_output(
            tokens(emb), tokens(torch.stack(hs, 1)), tokens(torch.stack(zs, 1))
        )  # (T * B, V): every position, the padding masked in the losses
        hard = ss[0] is not None
        if hard:
            s_bt = torch.stack(ss, 1)  # (B, T)
            logp_s = torch.log(alphas_bt.gather(2, s_bt.unsqueeze(2)).squeeze(2).clamp_min(1e-12))
            logp_s = logp_s * live
            ents = attention_entropy(alphas_bt.flatten(0, 1)).view(B, T)  # 0 after the end
        # <end> as the padding's target: a word no loss bans, so every term stays finite
        targets = caps[:, 1 : T + 1].masked_fill(~live, END)
        return TeacherForcedOutput(
            logits=logits,
            targets=tokens(targets),
            caption_index=torch.arange(B, device=a.device).repeat(T),
            alphas=alphas_bt,
            location_log_prob=logp_s.sum(1) if hard else None,
            entropy=ents.sum(1) if hard else None,
            locations=s_bt.masked_fill(~live, -1) if hard else None,
            token_mask=tokens(live),
        )

    def _forward_packed(
        self,
        annotations: torch.Tensor,
        captions: torch.Tensor,
        lengths: torch.Tensor,
        mode: str,
        locations: torch.Tensor | None,
    ) -> TeacherForcedOutput:
        """Captions sorted by length, each leaving the batch after its end."""
        B, L, _ = annotations.shape
        # Longest captions first: at step t the captions still running are rows [:n_t].
        order = torch.argsort(lengths, descending=True, stable=True)  # (B,)
        a, caps, lens = annotations[order], captions[order], lengths[order]  # (B, L, D) (B, T+1)
        T = int(lens[0])  # steps of the longest caption
        batch_sizes = [
            int(n)
            for n in (lens.unsqueeze(0) > torch.arange(T, device=lens.device).unsqueeze(1))
            .sum(1)
            .tolist()
        ]  # n_t for t < T
        emb, gate_x, projected, h, c, mm, a = self._inputs(a, caps, T)  # a: the words' grid
        # T x (B, 4H), unbound once: taking step t as gate_x[:, t] would zero-fill a gradient
        # of all (B, T, 4H) for every step in the backward pass; unbound, one stack joins them
        gates = gate_x.unbind(1)
        forced = locations[order] if locations is not None else None  # (B, T)
        # per step t: h (n_t, H), z (n_t, D); alphas and the hard terms padded back to B rows
        hs, zs, alphas, logps, ents, locs = [], [], [], [], [], []
        for t, n in enumerate(batch_sizes):
            if n < h.size(0):  # captions that ended drop out (slicing a full batch would
                # cost a zero-filled gradient buffer of W_a a per step in the backward pass)
                h, c, projected, a = h[:n], c[:n], projected[:n], a[:n]
            h, c, z, alpha, s = self.recurrent_step(  # (n, H) (n, H) (n, D) (n, L) (n,)
                gates[t][:n],
                h,
                c,
                projected,
                a,
                mode,
                None if forced is None else forced[:n, t],
                matmuls=mm,
            )
            hs.append(h)
            zs.append(z)
            alphas.append(F.pad(alpha, (0, 0, 0, B - n)))  # (B, L), zero rows after the end
            if s is not None:
                logp_s = torch.log(alpha.gather(1, s.unsqueeze(1)).squeeze(1).clamp_min(1e-12))
                logps.append(F.pad(logp_s, (0, B - n)))  # (B,) log alpha_{t, s_t}
                ents.append(F.pad(attention_entropy(alpha), (0, B - n)))  # (B,) H[alpha_t]
                locs.append(F.pad(s, (0, B - n), value=-1))  # (B,) s_t, -1 after the end

        # Packed, time-major token order: step t holds the first batch_sizes[t] captions;
        # N = sum_t n_t real tokens.
        packed_emb = torch.cat([emb[:n, t] for t, n in enumerate(batch_sizes)])  # (N, E)
        logits = self.deep_output(packed_emb, torch.cat(hs), torch.cat(zs))  # (N, V)
        targets = torch.cat([caps[:n, t + 1] for t, n in enumerate(batch_sizes)])  # (N,)
        caption_index = torch.cat([order[:n] for n in batch_sizes])  # (N,) original row

        inverse = torch.argsort(order)  # back to the callers' caption order
        alphas_bt = torch.stack(alphas, 1)[inverse]  # (B, T, L)
        hard = bool(logps)
        return TeacherForcedOutput(
            logits=logits,
            targets=targets,
            caption_index=caption_index,
            alphas=alphas_bt,
            location_log_prob=torch.stack(logps, 1).sum(1)[inverse] if hard else None,
            entropy=torch.stack(ents, 1).sum(1)[inverse] if hard else None,
            locations=torch.stack(locs, 1)[inverse] if hard else None,
        )
