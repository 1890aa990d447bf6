"""Small shared builders for the tests: random batches, tiny decoders, encoded captions."""

from __future__ import annotations

import collections

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils._python_dispatch import TorchDispatchMode

from showattendtell.network.decoder import Decoder, DecoderConfig
from showattendtell.search.decoding import END, UNK


def make_batch(B=4, T=7, L=9, D=12, V=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, L, D, generator=g)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[0] = T
    caps = torch.zeros(B, T + 1, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        caps[b, 0] = 1
        caps[b, 1:n] = torch.randint(4, V, (n - 1,), generator=g)
        caps[b, n] = 2
    return a, caps, lengths


def small_decoder(V=30, D=12, attention="soft", seed=0, attend="before"):
    torch.manual_seed(seed)
    cfg = DecoderConfig(
        attention=attention, embed_dim=8, hidden_dim=10, attention_dim=6, dropout=0.0, attend=attend
    )
    return Decoder(V, D, cfg)


def trained_like_decoder(attention="soft", attend="before"):
    dec = small_decoder(attention=attention, seed=2, attend=attend).eval()
    with torch.no_grad():  # make <end> plausible so that captions end at different lengths
        dec.out_vocab.bias[END] += 2.0
        dec.out_vocab.bias[UNK] += 5.0  # <unk> would win if it were allowed
    return dec


def feats(B=5, L=9, D=12, seed=0):
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed))


def encode_captions(vocab, captions):
    ids = [torch.tensor(vocab.encode(c)) for c in captions]
    return pad_sequence(ids, batch_first=True), torch.tensor([len(i) - 1 for i in ids])


HOST_SYNCS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


def count_host_syncs(monkeypatch) -> list[str]:
    """Record every call that copies a tensor's value to the host (and so waits for a GPU):
    the returned list fills as they happen. What a CUDA graph cannot hold."""
    calls: list[str] = []
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: calls.append("torch.nonzero"))
    return calls


# what moves no data: views and allocations, which launch no kernel on a GPU
METADATA_OPS = {
    "view", "t", "transpose", "unsqueeze", "squeeze", "as_strided", "expand", "split",
    "split_with_sizes", "chunk", "unbind", "select", "slice", "_reshape_alias", "detach",
    "empty", "empty_like", "empty_strided", "alias", "permute", "_unsafe_view", "lift_fresh",
}  # fmt: skip


class CountOperations(TorchDispatchMode):
    """Counts the operations that reach a device's kernels (after autograd and the composite
    operations are taken apart), forward and backward alike: on a GPU each is a kernel launch,
    what a step of small tensors is bound by. ``counts``: operation name -> calls."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in METADATA_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))
