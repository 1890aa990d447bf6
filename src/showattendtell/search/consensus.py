"""Consensus reranking (Devlin et al. 2015, "Exploring nearest neighbor approaches for image
captioning"): the beam's finished captions are re-ranked by how well they agree with what
people wrote about the training photos that look most like this one.

    neighbours(x) = the k training photos whose mean-pooled grids are nearest (cosine) to x's
    consensus(c)  = CIDEr-D(c, the captions of neighbours(x)), idf of all training captions

The model's beam proposes, the consensus chooses: captions that say what is usually said of
such photos win over fluent but idiosyncratic ones. An index (the training photos' pooled
grids and their tokenised captions) travels in the model file; ``build_index`` builds it
(``sat export --consensus-*``). The CIDEr-D arithmetic is pycocoevalcap's (tf-idf n-gram
vectors up to 4-grams, clipped matches, a Gaussian length penalty with sigma 6, x10), written
here over dense arrays because pycocoevalcap recomputes every reference's vectors on each call
and takes its idf from the references it is given (``metrics.CiderDReward`` is the reference it
is tested against). ``rerank`` scores a whole batch at once with tensor ops on the photos'
device (``cider_d_batch``); ``cider_d``, one photo in numpy, is what it is tested against. The
same index tells how familiar a photo is (familiarity.py).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Sequence
from itertools import chain, repeat

import numpy as np
import torch
import torch.nn.functional as F

ORDERS = 4  # n-grams of 1 to 4 words
SIGMA = 6.0  # CIDEr-D's length penalty
DEFAULT_NEIGHBOURS = 60  # dev, beam 5: k = 10 / 30 / 60 / 100 (model card)


def ngram_counts(words: Sequence[str]) -> Counter:
    """n-gram (a tuple of 1-4 words) -> count, as pycocoevalcap's ``precook``."""
    return Counter(
        tuple(words[i : i + n]) for n in range(1, ORDERS + 1) for i in range(len(words) - n + 1)
    )


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of range(lo[i], hi[i]) for all i, without a Python loop."""
    n = hi - lo
    starts = np.repeat(lo - np.cumsum(n) + n, n)  # each range's lo, minus its output offset
    return starts + np.arange(int(n.sum()))


def _ranges_t(lo: torch.Tensor, n: torch.Tensor, total: int) -> torch.Tensor:
    """``_ranges`` on lo's device, lengths ``n``; ``total`` = n.sum(), known to the caller."""
    starts = lo - (torch.cumsum(n, 0) - n)  # each range's lo, minus its output offset
    return torch.repeat_interleave(starts, n, output_size=total) + torch.arange(
        total, device=lo.device
    )


def _unique(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` by a sort: numpy 2's hash-based unique is several times slower."""
    s = np.sort(x)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] != s[:-1]
    return s[new]


def _gram_key(head: np.ndarray, tail: np.ndarray | int, pairs: int) -> np.ndarray:
    """An n-gram as one integer: its first two words' pair number (the second word 0 for a
    1-gram) and 1 + its last two words' (0 for a 1- or 2-gram); pair numbers are below
    ``pairs``, so distinct n-grams get distinct keys."""
    return head * (pairs + 1) + tail


def _keyed_grams(
    captions: list[list[str]], sizes: np.ndarray
) -> tuple[dict[str, int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every n-gram of every caption as one integer key (``_gram_key``), with its caption and
    its n - 1, laid out caption by caption, n by n, left to right: the order a loop over
    ``ngram_counts`` sees them in, which the tables' numbering depends on. Also the word
    numbers (``vocab``) and the sorted word pairs (``pairs``) that ``_ids`` looks n-grams up
    with later. ``sizes``: each caption's number of words."""
    flat = list(chain.from_iterable(captions))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(flat), 1)}  # word -> 1, 2, ...
    words = np.fromiter(map(vocab.__getitem__, flat), np.int64, len(flat))
    base = len(vocab) + 1
    ends = np.cumsum(sizes)
    caption_of = np.repeat(np.arange(len(captions)), sizes)  # (W,) each word's caption
    following = np.append(words[1:], 0)  # the next word of the same caption, else 0
    following[ends[sizes > 0] - 1] = 0
    pairs = _unique(np.concatenate([words * base + following, words * base]))
    pair = np.searchsorted(pairs, words * base + following)  # (w_i, w_i+1 or 0)
    single = np.searchsorted(pairs, words * base)  # (w_i, 0)
    left = ends[caption_of] - np.arange(len(words))  # words from each one to its end
    heads, tails = (single, pair, pair, pair), (None, None, single, pair)
    # the n-grams caption by caption, n by n, left to right (the order ngram_counts sees
    # them in): caption c's n-grams start after those of the captions before it and, in
    # it, after its shorter ones
    per_order = np.maximum(sizes[:, None] - np.arange(ORDERS)[None], 0)  # (R, 4)
    within = np.cumsum(per_order, 1) - per_order  # (R, 4) where each order starts
    offset = np.cumsum(per_order.sum(1)) - per_order.sum(1)  # (R,) where each caption does
    begins = ends - sizes
    cap = np.empty(int(per_order.sum()), np.int64)
    key = np.empty_like(cap)
    gram_order = np.empty_like(cap)
    for n in range(1, ORDERS + 1):
        at = np.flatnonzero(left >= n)  # where the caption's n-grams start
        owner = caption_of[at]
        dest = offset[owner] + within[owner, n - 1] + at - begins[owner]
        tail = 0 if tails[n - 1] is None else tails[n - 1][at + 2] + 1
        cap[dest], gram_order[dest] = owner, n - 1
        key[dest] = _gram_key(heads[n - 1][at], tail, len(pairs))
    return vocab, pairs, cap, key, gram_order


class ConsensusIndex:
    """Pooled grids and captions of training photos, and the CIDEr-D tables built from them.

    ``embeddings`` (N, D): each training photo's annotation grid averaged over its locations
    (what ``pool`` computes from a grid at inference); ``references``: each photo's captions,
    tokenised (words joined by single spaces, as ``vocab.tokenize`` makes them).
    """

    def __init__(
        self,
        embeddings: torch.Tensor,
        references: list[list[str]],
        neighbours: int = DEFAULT_NEIGHBOURS,
    ):
        if embeddings.ndim != 2 or len(embeddings) != len(references) or not len(references):
            raise ValueError(
                f"{len(references)} photos' captions for embeddings of shape "
                f"{tuple(embeddings.shape)}"
            )
        if not 1 <= neighbours <= len(references):
            raise ValueError(f"neighbours must be from 1 to {len(references)}, not {neighbours}")
        self.embeddings = F.normalize(embeddings.float(), dim=1)  # (N, D), unit rows
        self.references, self.neighbours = references, neighbours
        self._tables: dict | None = None  # built on first use, not at every model load
        self._lock = threading.Lock()
        self._local = threading.local()
        self._on_device: dict[str, dict[str, torch.Tensor]] = {}  # device -> tables there

    def to(self, device: torch.device | str) -> ConsensusIndex:
        """The photos' embeddings on ``device`` (in place; returns self): on a GPU the nearest
        photos of a batch (reranking, familiarity) are one matmul there, not a multi-threaded
        one on the host that competes with the photo-decoding processes for the cores."""
        self.embeddings = self.embeddings.to(device)
        return self

    @staticmethod
    def pool(annotations: torch.Tensor) -> torch.Tensor:
        """A photo's embedding from its grid: (B, L, D) -> (B, D), the mean over locations."""
        return annotations.float().mean(1)

    # -- CIDEr-D tables -----------------------------------------------------------------------

    def _build(self) -> dict:
        """The CIDEr-D tables, with numpy over all captions at once (a Python loop over the
        n-grams took a second for Flickr8k's 30,000 captions, at the first caption of a run).
        N-gram ids, each caption's entries and their order are those of a loop over
        ``ngram_counts`` (first seen, first numbered), so the sums come out the same."""
        captions = list(map(str.split, chain.from_iterable(self.references)))
        sizes = np.fromiter(map(len, captions), np.int64, len(captions))  # (R,) words
        vocab, pairs, cap, key, gram_order = _keyed_grams(captions, sizes)
        # one stable sort brings equal n-grams together, each run in caption order: the ids,
        # each caption's distinct n-grams and the document frequencies follow without another
        by_key = np.argsort(key, kind="stable")
        k, c = key[by_key], cap[by_key]
        new_gram = np.ones(len(k), bool)
        new_gram[1:] = k[1:] != k[:-1]
        first_seen = np.zeros(len(k), bool)
        first_seen[by_key[new_gram]] = True
        numbering = (np.cumsum(first_seen) - 1)[by_key[new_gram]]  # id of each sorted key
        sorted_gram = numbering[np.cumsum(new_gram) - 1]  # (M,) ids in key order
        gram = np.empty_like(sorted_gram)
        gram[by_key] = sorted_gram  # (M,) ids in caption order
        order = np.zeros(len(numbering), np.int64)  # (G,) n - 1 of each n-gram
        order[gram] = gram_order
        # each caption's distinct n-grams (its entries) and their counts, first seen first
        run = new_gram.copy()
        run[1:] |= c[1:] != c[:-1]
        run_starts = np.flatnonzero(run)
        tf = np.zeros(len(k), np.int64)
        tf[by_key[run_starts]] = np.diff(np.append(run_starts, len(k)))
        entries = np.flatnonzero(tf)
        entry_cap, flat_ids = cap[entries], gram[entries]
        counts = tf[entries].astype(np.float64)
        # document frequency: photos whose captions hold the n-gram
        per_photo = np.fromiter(map(len, self.references), np.int64, len(self.references))
        photo = np.repeat(np.arange(len(self.references)), per_photo)[c]  # in key order
        held = new_gram.copy()
        held[1:] |= photo[1:] != photo[:-1]
        df = np.bincount(sorted_gram[held], minlength=len(numbering))
        log_n = math.log(len(self.references))
        idf = log_n - np.log(np.maximum(1.0, df.astype(np.float64)))  # (G,)
        ptr = np.concatenate([[0], np.cumsum(np.bincount(entry_cap, minlength=len(captions)))])
        values = counts * idf[flat_ids]  # tf x idf
        norms = np.zeros((len(captions), ORDERS))  # (R, 4) per caption and order
        np.add.at(norms, (entry_cap, order[flat_ids]), values**2)
        return {
            "vocab": vocab,
            "pairs": pairs,
            "keys": k[new_gram],
            "numbering": numbering,
            "idf": idf,
            "log_n": log_n,
            "order": order,
            "ptr": ptr,
            "flat_ids": flat_ids,
            "values": values,
            "norms": np.sqrt(norms),
            # per caption: its bigrams, as pycocoevalcap counts its length
            "lengths": np.maximum(sizes - 1, 0).astype(np.float64),
            "starts": np.concatenate([[0], np.cumsum(per_photo)]),  # photo i: rows starts[i]:[i+1]
        }

    @staticmethod
    def _ids(t: dict, grams: Sequence[tuple[str, ...]]) -> np.ndarray:
        """The tables' ids of n-grams (tuples of 1-4 words); -1 for one no caption holds."""
        vocab, pairs, keys = t["vocab"], t["pairs"], t["keys"]
        if not len(grams) or not len(keys):
            return np.full(len(grams), -1, np.int64)
        sizes = np.fromiter(map(len, grams), np.int64, len(grams))
        w = np.zeros((len(grams), ORDERS), np.int64)  # word numbers, 0 after the n-gram
        w[np.arange(ORDERS)[None] < sizes[:, None]] = np.fromiter(
            map(vocab.get, chain.from_iterable(grams), repeat(-1)), np.int64, int(sizes.sum())
        )  # row by row, as the mask's True cells are
        base = len(vocab) + 1
        known = (w >= 0).all(1)
        head, tail = w[:, 0] * base + w[:, 1], w[:, 2] * base + w[:, 3]
        h = np.minimum(np.searchsorted(pairs, head), len(pairs) - 1)
        s = np.minimum(np.searchsorted(pairs, tail), len(pairs) - 1)
        long = w[:, 2] > 0  # 3- and 4-grams have a tail pair
        known &= (pairs[h] == head) & (~long | (pairs[s] == tail))
        key = _gram_key(h, np.where(long, s + 1, 0), len(pairs))
        k = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
        known &= keys[k] == key
        return np.where(known, t["numbering"][k], -1)

    def prepare(self) -> dict:
        """Build the CIDEr-D tables now if they are not built (once; thread-safe)."""
        with self._lock:
            if self._tables is None:
                self._tables = self._build()
        return self._tables

    def cider_d(self, candidates: Sequence[str], photos: Sequence[int]) -> np.ndarray:
        """CIDEr-D (x10) of each candidate against all captions of the training ``photos``."""
        t = self.prepare()
        photos = np.asarray(photos, np.int64)
        rows = _ranges(t["starts"][photos], t["starts"][photos + 1])  # their captions, (R,)
        if not len(rows):  # photos without captions: no opinion, the beam's order stands
            return np.zeros(len(candidates))
        # the candidates' n-grams: tf-idf over the ones some training caption has (U), and the
        # norms over all of them (an n-gram no training caption has gets the largest idf)
        counts = [ngram_counts(c.split()) for c in candidates]
        grams = list({g: None for cnt in counts for g in cnt})
        ids = dict(zip(grams, self._ids(t, grams).tolist(), strict=True))  # -1: no caption's
        known = sorted({i for i in ids.values() if i >= 0})
        u = np.asarray(known, np.int64)  # (U,) sorted
        col = {g: j for j, g in enumerate(known)}
        vc = np.zeros((len(candidates), len(u)))  # (C, U)
        norm_c = np.zeros((len(candidates), ORDERS))  # (C, 4)
        len_c = np.zeros(len(candidates))
        for k, cnt in enumerate(counts):
            len_c[k] = max(len(candidates[k].split()) - 1, 0)
            for g, tf in cnt.items():
                i = ids[g]
                v = tf * (t["idf"][i] if i >= 0 else t["log_n"])
                norm_c[k, len(g) - 1] += v * v
                if i >= 0:
                    vc[k, col[i]] = v
        norm_c = np.sqrt(norm_c)
        # the references' tf-idf over U, (R, U), from their CSR rows
        lo, hi = t["ptr"][rows], t["ptr"][rows + 1]
        entry = _ranges(lo, hi)  # the references' (n-gram, tf-idf) entries
        local = np.repeat(np.arange(len(rows)), hi - lo)
        column = getattr(self._local, "column", None)  # n-gram id -> column in U, else -1:
        if column is None:  # one per thread (the pipeline's lanes call this at once)
            column = self._local.column = np.full(len(t["keys"]), -1, np.int64)
        column[u] = np.arange(len(u))
        pos = column[t["flat_ids"][entry]]
        column[u] = -1
        hit = pos >= 0
        vr = np.zeros((len(rows), len(u)))
        vr[local[hit], pos[hit]] = t["values"][entry[hit]]
        # clipped matches by order: sum_g min(c_g, r_g) r_g -> (C, R, 4)
        onehot = np.eye(ORDERS)[t["order"][u]]  # (U, 4)
        num = (np.minimum(vc[:, None, :], vr[None]) * vr[None]) @ onehot
        den = norm_c[:, None, :] * t["norms"][rows][None]
        val = np.where(den > 0, num / np.where(den > 0, den, 1.0), num)
        penalty = np.exp(-((len_c[:, None] - t["lengths"][rows][None]) ** 2) / (2 * SIGMA**2))
        return (val * penalty[..., None]).mean(2).sum(1) / len(rows) * 10.0

    # -- CIDEr-D of a batch, with tensor ops on the photos' device ---------------------------

    def tables_on(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The CIDEr-D tables that ``cider_d_batch`` reads, as tensors on ``device``: copied
        there once, not per batch (thread-safe, as ``prepare``); on the CPU most share the
        numpy tables' memory. ``unit``: each entry's tf-idf over its caption's norm of its
        order (0 where that is 0), the reference half of CIDEr-D's cosine."""
        t = self.prepare()
        key = str(torch.device(device))
        with self._lock:
            if key not in self._on_device:
                names = ("ptr", "flat_ids", "values", "lengths", "starts")
                d = {name: torch.as_tensor(t[name]).to(device) for name in names}
                caption = np.repeat(np.arange(len(t["ptr"]) - 1), np.diff(t["ptr"]))  # (M,)
                norm = t["norms"][caption, t["order"][t["flat_ids"]]]
                unit = np.where(norm > 0, t["values"] / np.where(norm > 0, norm, 1.0), 0.0)
                d["unit"] = torch.as_tensor(unit).to(device)
                # the entries of each photo's captions, which lie next to each other: (N,)
                d["photo_entries"] = d["ptr"][d["starts"][1:]] - d["ptr"][d["starts"][:-1]]
                self._on_device[key] = d
        return self._on_device[key]

    def _candidate_vectors(
        self, t: dict, candidates: Sequence[Sequence[str]]
    ) -> dict[str, np.ndarray]:
        """The batch's candidates as ``cider_d`` sees them, worked out on the host once per
        batch: their n-grams counted, and looked up with one ``_ids`` for the whole batch.
        Candidates sit at (photo, slot), ``slots`` the most a photo has. ``grams`` (U,): the
        sorted ids of the batch's n-grams that some training caption has; ``columns`` (P,):
        photo x U + place in ``grams`` of each photo's own (cider_d's U, photo by photo),
        sorted; ``vc`` (P, slots) the candidates' tf-idf of them and ``inverse_norm`` 1 / the
        candidate's norm of their order (0 for a zero norm; an n-gram no caption has counts in
        the norm with idf log_n, as in ``cider_d``); ``length`` (B, slots) per candidate."""
        b, slots = len(candidates), max(map(len, candidates), default=0)
        words = [c.split() for c in chain.from_iterable(candidates)]  # (C,)
        counts = list(map(ngram_counts, words))
        per_photo = np.fromiter(map(len, candidates), np.int64, b)
        photo = np.repeat(np.arange(b), per_photo)  # (C,)
        slot = np.arange(len(words)) - np.repeat(np.cumsum(per_photo) - per_photo, per_photo)
        grams = list(dict.fromkeys(chain.from_iterable(counts)))  # the batch's n-grams
        number = {g: i for i, g in enumerate(grams)}
        per_cand = np.fromiter(map(len, counts), np.int64, len(counts))  # distinct n-grams
        gram = np.fromiter(
            map(number.__getitem__, chain.from_iterable(counts)), np.int64, int(per_cand.sum())
        )  # (E,) each candidate's n-grams, Counter order, as numbers in ``grams``
        tf = np.fromiter(chain.from_iterable(c.values() for c in counts), np.float64, len(gram))
        ids = self._ids(t, grams)[gram]  # (E,) -1: no training caption has it
        order = (np.fromiter(map(len, grams), np.int64, len(grams)) - 1)[gram]
        known = ids >= 0
        v = tf * np.where(known, t["idf"][np.maximum(ids, 0)], t["log_n"])  # (E,) tf-idf
        e_photo, e_slot = np.repeat(photo, per_cand), np.repeat(slot, per_cand)  # (E,)
        cell = (e_photo * ORDERS + order) * slots + e_slot  # summed in cider_d's order
        norm = np.sqrt(np.bincount(cell, v * v, b * ORDERS * slots))  # (B x 4 x slots,)
        length = np.zeros((b, slots))
        length[photo, slot] = np.maximum(np.fromiter(map(len, words), np.int64, len(words)) - 1, 0)
        known_ids = np.unique(ids[known])  # (U,)
        keys = e_photo[known] * len(known_ids) + np.searchsorted(known_ids, ids[known])
        columns, column = np.unique(keys, return_inverse=True)  # (P,), (E_known,)
        vc, inverse_norm = np.zeros((2, len(columns), slots))
        vc[column, e_slot[known]] = v[known]
        norm = norm[cell[known]]
        inverse_norm[column, e_slot[known]] = np.where(norm > 0, 1 / np.where(norm > 0, norm, 1), 0)
        return {
            "grams": known_ids,
            "columns": columns,
            "vc": vc,
            "inverse_norm": inverse_norm,
            "length": length,
        }

    def _reference_hits(
        self,
        d: dict[str, torch.Tensor],
        c: dict[str, torch.Tensor],
        rows: torch.Tensor,
        photo_of_row: torch.Tensor,
        n_entries: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference ``rows``' CSR entries whose n-gram one of their photo's candidates
        has: (row in ``rows``, entry, column of ``c``), each (H,). All entries are gathered,
        then kept in two steps, each a gather from a table made for the batch: the n-gram is
        the batch's (a table over all n-grams), then the row's photo's (one over photo x U).
        (``index_select`` rather than ``[]``: several times faster on the CPU.)"""
        dev, u = rows.device, len(c["grams"])
        lo = d["ptr"].index_select(0, rows)
        n = d["ptr"].index_select(0, rows + 1) - lo  # (R,) entries per row
        row = torch.repeat_interleave(
            torch.arange(len(rows), device=dev), n, output_size=n_entries
        )  # (E,)
        entry = _ranges_t(lo, n, n_entries)  # (E,) the rows' entries, row by row
        place = torch.full((len(self.prepare()["keys"]),), -1, dtype=torch.int64, device=dev)
        place.index_copy_(0, c["grams"], torch.arange(u, device=dev))  # id -> place, else -1
        place = place.index_select(0, d["flat_ids"].index_select(0, entry))
        hit = torch.nonzero(place >= 0).flatten()  # (H1,) the batch's n-grams
        row, entry = row.index_select(0, hit), entry.index_select(0, hit)
        col_of = torch.full((len(c["length"]) * u,), -1, dtype=torch.int64, device=dev)
        col_of.index_copy_(0, c["columns"], torch.arange(len(c["columns"]), device=dev))
        photo = photo_of_row.index_select(0, row)
        column = col_of.index_select(0, photo * u + place.index_select(0, hit))
        keep = torch.nonzero(column >= 0).flatten()  # (H,) the row's photo's own n-grams
        return row.index_select(0, keep), entry.index_select(0, keep), column.index_select(0, keep)

    def cider_d_batch(
        self, candidates: Sequence[Sequence[str]], photos: torch.Tensor
    ) -> list[np.ndarray]:
        """``cider_d`` of every photo of a batch at once, with tensor ops on ``photos``' device:
        photo b's ``candidates[b]`` against all captions of its training ``photos[b]`` (B, k).
        Each matched entry's min(c, r) / |c| x r / |r| x penalty goes straight into its
        photo's sum (cider_d's sums, in another order: equal to float64 rounding)."""
        t, d = self.prepare(), self.tables_on(photos.device)
        dev, b = photos.device, len(candidates)
        c = {
            name: torch.as_tensor(x).to(dev)
            for name, x in self._candidate_vectors(t, candidates).items()
        }
        if not len(c["columns"]):  # no candidate n-gram any training caption has: no match
            return [np.zeros(len(x)) for x in candidates]
        first = d["starts"][photos]  # (B, k) each neighbour's first caption row
        captions = d["starts"][photos + 1] - first  # (B, k)
        sizes = torch.stack([captions.sum(), d["photo_entries"][photos].sum()])
        n_rows, n_entries = sizes.tolist()  # the output sizes (a wait, as nonzero's are)
        per_photo = captions.sum(1)  # (B,) R_b, its neighbours' captions
        rows = _ranges_t(first.flatten(), captions.flatten(), n_rows)  # (R,) photo by photo
        photo_of_row = torch.repeat_interleave(
            torch.arange(b, device=dev), per_photo, output_size=n_rows
        )
        row, entry, column = self._reference_hits(d, c, rows, photo_of_row, n_entries)  # (H,)
        photo, row = photo_of_row.index_select(0, row), rows.index_select(0, row)
        r = d["values"].index_select(0, entry)[:, None]  # (H, 1) the reference's tf-idf
        val = torch.minimum(c["vc"].index_select(0, column), r)  # (H, slots) min(c, r)
        val *= c["inverse_norm"].index_select(0, column)  # / |c|
        val *= d["unit"].index_select(0, entry)[:, None]  # r / |r|
        gap = c["length"].index_select(0, photo) - d["lengths"].index_select(0, row)[:, None]
        val *= gap.square_().div_(-2 * SIGMA**2).exp_()  # CIDEr-D's length penalty
        total = torch.zeros(b, val.shape[1], dtype=torch.float64, device=dev)
        total.index_add_(0, photo, val)
        scores = total / per_photo.clamp(min=1)[:, None] * (10.0 / ORDERS)  # mean over orders
        scores = scores.cpu().numpy()  # (B, slots)
        return [scores[i, : len(x)].copy() for i, x in enumerate(candidates)]

    # -- reranking ----------------------------------------------------------------------------

    def nearest(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The ``neighbours`` training photos nearest to each embedding: (B, D) -> (B, k)."""
        queries = F.normalize(embeddings.float().to(self.embeddings.device), dim=1)
        return (queries @ self.embeddings.T).topk(self.neighbours, dim=1).indices

    def rerank(
        self, embeddings: torch.Tensor, candidates: Sequence[Sequence[str]]
    ) -> list[np.ndarray]:
        """Each photo's candidates' consensus scores (higher: more in agreement); photos as
        ``pool``'s embeddings (B, D), candidates as lists of captions (words and spaces),
        scored all at once on the embeddings' device (``cider_d_batch``)."""
        # The batched path on a CPU too, not a loop of cider_d: on a 2-core CPU with the bundled
        # model's index, 16 or 32 photos' beams of 3 or 5 (COCO val photos), best of 7, it took
        # 0.45-0.64 of the loop's time (0.36-0.46 ms per photo against 0.57-0.83 on an idle
        # CPU) with 1 torch thread (as in `sat caption`'s lanes) or 2, the other core idle or
        # busy; 0.95-1.5 of it only with 2 torch threads on cores that other processes keep
        # busy, and 1.3-1.6 for one photo alone (0.75 ms against 0.47 at beam 3). One path
        # also lets the CPU tests check the code that runs on a GPU.
        near = self.nearest(embeddings).to(embeddings.device)  # (B, k)
        return self.cider_d_batch(candidates, near)

    # -- in a model file ----------------------------------------------------------------------

    def to_file(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON-able description) for model_file.save_model. The unit rows are stored
        as int8 with a scale per row: half of float16's 15 MB for Flickr8k's 6000 x 1280, and
        99.5 % of the dev photos' 60 neighbours unchanged (model card)."""
        embeddings = self.embeddings.cpu()
        scales = embeddings.abs().amax(1).clamp_min(1e-12) / 127  # (N,)
        codes = torch.round(embeddings / scales[:, None]).to(torch.int8)  # (N, D)
        return (
            {"embeddings": codes.contiguous(), "scales": scales.float().contiguous()},
            {"neighbours": self.neighbours, "references": self.references},
        )

    @classmethod
    def from_file(cls, tensors: dict[str, torch.Tensor], description: dict) -> ConsensusIndex:
        embeddings = tensors["embeddings"]
        if embeddings.dtype == torch.int8:
            embeddings = embeddings.float() * tensors["scales"].float()[:, None]
        return cls(embeddings, description["references"], int(description["neighbours"]))


# -- building an index from a dataset (`sat export --consensus-root`) ---------------------------
