"""The LightningDataModule for captioning: (image or cached features, caption) pairs."""

from __future__ import annotations

import logging
import random

import lightning as L
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from showattendtell.data.datasets import CaptionedImage, Split, load_split
from showattendtell.data.feature_cache import FeatureCache
from showattendtell.data.person_masks import PersonMasks, read_person_masks
from showattendtell.evaluation.attention_correctness import category_words
from showattendtell.images.files import load_image
from showattendtell.network.encoder import Encoder, EncoderConfig
from showattendtell.network.tokenizers import DEFAULT_TOKENIZER, TokenizerError
from showattendtell.network.vocab import Vocabulary

log = logging.getLogger(__name__)


class _Source:
    """Gives the encoder input of an image: cached features (L, D) or a normalised image."""

    def __init__(self, cache: FeatureCache | None, input_size: int):
        self.cache, self.input_size = cache, input_size

    def __call__(self, im: CaptionedImage) -> torch.Tensor | None:
        if self.cache is not None:
            return self.cache.get(im.image_id)
        loaded = load_image(str(im.path), self.input_size)
        if loaded.error is not None:  # reported and skipped, never a crash mid-epoch
            log.warning("skipping undecodable image %s: %s", im.path, loaded.error)
        return loaded.tensor


class CaptionPairs(Dataset):
    """Every (image, caption) pair of a split: one training example per caption.

    With ``person_masks``, each pair also carries its photo's person-mask coverage (L,) (zeros
    for a photo the file does not hold) and, for each predicted token, whether it is a word that
    names a person (``attention_correctness.category_words`` over the caption's vocabulary
    words, so "hot dog" is no dog and training agrees with the measure): the targets of
    ``objectives.GroundingConfig``.
    """

    def __init__(
        self,
        images: list[CaptionedImage],
        vocab: Vocabulary,
        source: _Source,
        max_length: int,
        person_masks: PersonMasks | None = None,
    ):
        self.images, self.source = images, source
        self.person_masks = person_masks
        # All word ids in one flat array (pair k is tokens[starts[k]:starts[k + 1]]), not a
        # tensor per caption: COCO's 616k captions as tensors cost memory and slow every
        # garbage-collector pass over them (benchmarks/coco_scale.py).
        tokens: list[int] = []
        starts, image_of = [0], []
        for i, im in enumerate(images):
            for cap in im.captions:
                ids = vocab.encode(cap)
                if len(ids) > max_length + 2:  # keep <end>, truncate the words
                    ids = [*ids[: max_length + 1], vocab.end]
                tokens += ids
                starts.append(len(tokens))
                image_of.append(i)
        self.tokens = np.asarray(tokens, dtype=np.int64)  # (total tokens,)
        self.starts = np.asarray(starts, dtype=np.int64)  # (pairs + 1,)
        self.image_of = np.asarray(image_of, dtype=np.int64)  # (pairs,)
        self.person_words = self.person_coverage = None
        if person_masks is not None:
            self.person_words = _person_tokens(self.tokens, self.starts, vocab)  # (tokens,)
            L = person_masks.grid**2
            self.person_coverage = np.zeros((len(images), L), dtype=np.float32)
            for i, im in enumerate(images):
                found = person_masks.coverage_of(im.image_id)
                if found is not None:
                    self.person_coverage[i] = found.reshape(-1)

    def __len__(self) -> int:
        return len(self.image_of)

    def __getitem__(self, k: int):
        i = int(self.image_of[k])
        span = slice(self.starts[k], self.starts[k + 1])
        ids = torch.from_numpy(self.tokens[span])
        x = self.source(self.images[i])
        if x is None:
            return None
        if self.person_coverage is None:
            return x, ids, i
        # the flags of the predicted tokens (all but <start>), aligned with the decoder's steps
        words = torch.from_numpy(self.person_words[span][1:])
        return x, ids, i, torch.from_numpy(self.person_coverage[i]), words


def _person_tokens(tokens: np.ndarray, starts: np.ndarray, vocab: Vocabulary) -> np.ndarray:
    """(tokens,) bool: the tokens that name a person, by attention correctness's word map."""
    flags = np.zeros(len(tokens), dtype=bool)
    itos = vocab.itos
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        words = [itos[t] for t in tokens[a:b].tolist()]
        for j, category in category_words(words):
            if category == "person":
                flags[a + j] = True
    return flags


class ImagesWithReferences(Dataset):
    """One item per image (for decoding and scoring), with its first caption for the val loss."""

    def __init__(
        self, images: list[CaptionedImage], vocab: Vocabulary, source: _Source, max_length: int
    ):
        self.pairs = CaptionPairs([_first_caption(im) for im in images], vocab, source, max_length)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, k: int):
        return self.pairs[k]


def _first_caption(im: CaptionedImage) -> CaptionedImage:
    return CaptionedImage(im.image_id, im.path, im.captions[:1], im.coco_id)


def collate_captions(items):
    """Stack inputs, pad captions with <pad> (0); lengths count the predicted tokens."""
    items = [it for it in items if it is not None]
    if not items:
        return None
    xs, caps, idx, *person = zip(*items, strict=True)
    batch = {
        "inputs": torch.stack(xs),
        "captions": pad_sequence(caps, batch_first=True, padding_value=0),
        "lengths": torch.tensor([len(c) - 1 for c in caps]),
        "index": torch.tensor(idx),
    }
    if person:  # (B, L) mask coverage, (B, T) person-word flags of the predicted tokens
        batch["person_target"] = torch.stack(person[0])
        batch["person_words"] = pad_sequence(person[1], batch_first=True, padding_value=False)
    return batch


class CaptionDataModule(L.LightningDataModule):
    """COCO / Flickr8k / Karpathy-format captions, or your own, for training and validation.

    Args:
        dataset: flickr8k (original release files), karpathy (dataset_*.json), coco, or
            captions (a folder of photos and a captions.csv or captions.jsonl: own_captions.py).
        root: the dataset folder (see data/README.md).
        train_split / val_split: split names of that dataset (flickr8k: train/dev/test;
            karpathy and coco with dataset_coco.json: train, train+restval, val, test).
        feature_cache: folder of the encoder-feature cache; missing features are extracted at
            setup. None: run the encoder on images every step (needed when fine-tuning it).
        encoder: linked from the model's encoder config (decides the cache and input size).
        min_word_count: words rarer than this in the training captions become <unk>.
        max_caption_length: training captions are cut to this many words.
        val_images: score on the first N validation images only (None: all).
        vocab_file: use this vocabulary (JSON list) instead of building one.
        num_workers: loader processes of the training and validation batches.
        extract_batch_size / extract_workers: images per batch and image-decoding processes
            when the feature cache is filled (None: the image pipeline's default for the
            device, ``pipeline.default_workers``).
        person_masks: the training photos' person-mask file (``scripts/label_person_masks.py``):
            training batches then carry the targets of ``model.objective.grounding``.
        tokenizer: how captions are split into the vocabulary's words (network/tokenizers.py):
            ptb (English, as the COCO toolkit does) or unicode (other languages: words of any
            script, each character of Chinese, Japanese, Thai and other scripts written
            without spaces). The model stores it, so its captions are joined the same way.
        split_ratio: the training share of the photos for the captions dataset when its file
            has no split column (null: 0.8); the rest is halved into val and test.
    """

    def __init__(
        self,
        dataset: str = "flickr8k",
        root: str = "data/flickr8k",
        train_split: str = "train",
        val_split: str = "dev",
        feature_cache: str | None = "cache",
        encoder: EncoderConfig | None = None,
        min_word_count: int = 5,
        max_caption_length: int = 30,
        batch_size: int = 64,
        val_batch_size: int = 100,
        num_workers: int = 2,
        val_images: int | None = None,
        vocab_file: str | None = None,
        extract_batch_size: int = 32,
        extract_workers: int | None = None,
        person_masks: str | None = None,
        tokenizer: str = DEFAULT_TOKENIZER,
        split_ratio: float | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["encoder"])
        self.encoder_config = encoder or EncoderConfig()
        self._splits: dict[str, Split] = {}
        self._vocab: Vocabulary | None = None
        self._person_masks: PersonMasks | None = None

    @property
    def person_masks(self) -> PersonMasks | None:
        """The person-mask file of ``data.person_masks``, read once (None: not set)."""
        if self._person_masks is None and self.hparams.person_masks:
            self._person_masks = read_person_masks(
                self.hparams.person_masks, self.encoder_config.grid
            )
        return self._person_masks

    def split(self, name: str) -> Split:
        if name not in self._splits:
            h = self.hparams
            self._splits[name] = load_split(h.dataset, h.root, name, h.split_ratio)
        return self._splits[name]

    @property
    def vocab(self) -> Vocabulary:
        if self._vocab is None:
            h = self.hparams
            if h.vocab_file:
                words = Vocabulary.load(h.vocab_file)
                if words.tokenizer not in (DEFAULT_TOKENIZER, h.tokenizer):
                    raise TokenizerError(
                        f"--data.vocab_file {h.vocab_file} was made with the {words.tokenizer} "
                        f"tokenizer: train with --data.tokenizer {words.tokenizer}"
                    )
                self._vocab = Vocabulary(words.itos, h.tokenizer)
            else:
                train = self.split(h.train_split).images
                caps = (c for im in train for c in im.captions)
                self._vocab = Vocabulary.build(caps, h.min_word_count, h.tokenizer)
        return self._vocab

    @property
    def vocab_words(self) -> list[str]:
        """The vocabulary as a word list: what the model is built with (linked by the CLI)."""
        return self.vocab.itos

    def val_images(self) -> list[CaptionedImage]:
        images = self.split(self.hparams.val_split).images
        n = self.hparams.val_images
        return images[:n] if n else images

    def references(self) -> dict[str, list[str]]:
        """Validation image id -> all its reference captions."""
        return {im.image_id: im.captions for im in self.val_images()}

    def _source(self) -> _Source:
        cache = None
        if self.hparams.feature_cache:
            cache = FeatureCache.for_config(self.hparams.feature_cache, self.encoder_config)
        return _Source(cache, self.encoder_config.input_size)

    def features_to_extract(self) -> tuple[FeatureCache, list[CaptionedImage]] | None:
        """The feature cache and its missing train + validation images (None: no cache)."""
        if not self.hparams.feature_cache:
            return None
        cache = FeatureCache.for_config(self.hparams.feature_cache, self.encoder_config)
        train = self.split(self.hparams.train_split)
        train.require_images()
        return cache, cache.missing(train.images + self.val_images())

    def extract_features(
        self,
        cache: FeatureCache,
        images: list[CaptionedImage],
        device: str | None = None,
        writer: str = "",
    ) -> int:
        """Encode ``images`` into ``cache`` (``writer``: see FeatureCache.extract)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        log.info("extracting encoder features of %d images into %s", len(images), cache.dir)
        return cache.extract(
            images,
            Encoder(self.encoder_config),
            self.hparams.extract_batch_size,
            self.hparams.extract_workers,
            device=device,
            writer=writer,
        )

    def log_cache(self, cache: FeatureCache | None = None) -> None:
        """Say what the cache holds: ``cache`` as this process sees it, or read afresh (after
        other processes wrote to it)."""
        if self.hparams.feature_cache:
            if cache is None:
                cache = FeatureCache.for_config(self.hparams.feature_cache, self.encoder_config)
            log.info(
                "feature cache %s: %d images, %.2f GB%s",
                cache.dir,
                len(cache),
                cache.size_bytes() / 1e9,
                f", {len(cache.failed)} undecodable (failed*.json)" if cache.failed else "",
            )

    def prepare_data(self) -> None:
        """Fill the feature cache (once, on one process) for the train and validation images;
        `sat features --trainer.devices N` shares the work out instead (commands/train.py)."""
        found = self.features_to_extract()
        if found is not None and found[1]:
            self.extract_features(*found)
        self.log_cache(found[0] if found is not None else None)

    def setup(self, stage: str | None = None) -> None:
        source, h = self._source(), self.hparams
        if stage in ("fit", None):
            train = self.split(h.train_split)
            train.require_images()
            _warn_uncached(source, train.images, h.train_split)
            if self.person_masks is not None:
                absent = sum(im.image_id not in self.person_masks for im in train.images)
                if absent:
                    log.warning(
                        "%s: %d of %d images are not in the person-mask file %s: their "
                        "person words are not supervised",
                        h.train_split,
                        absent,
                        len(train.images),
                        h.person_masks,
                    )
            self.train_set = CaptionPairs(
                train.images, self.vocab, source, h.max_caption_length, self.person_masks
            )
        val = self.val_images()
        _warn_uncached(source, val, h.val_split)
        self.val_set = ImagesWithReferences(val, self.vocab, source, h.max_caption_length)

    def _loader(self, ds: Dataset, batch_size: int, shuffle: bool) -> DataLoader:
        h = self.hparams
        return DataLoader(
            ds,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=h.num_workers,
            collate_fn=collate_captions,
            persistent_workers=h.num_workers > 0,
            worker_init_fn=_seed_worker,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self.hparams.val_batch_size, shuffle=False)


def _warn_uncached(source: _Source, images: list[CaptionedImage], split: str) -> None:
    """Images without cached features (undecodable, or not extracted yet) are skipped: say so."""
    if source.cache is None:
        return
    absent = sum(1 for im in images if im.image_id not in source.cache)
    if absent:
        log.warning(
            "%s: %d of %d images have no cached features (undecodable ones are listed in "
            "%s/failed.json; run `sat features` for the rest) and are skipped",
            split,
            absent,
            len(images),
            source.cache.dir,
        )


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
