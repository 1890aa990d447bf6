"""On-disk cache of encoder annotation grids, so a frozen encoder runs once per image.

Layout of one cache (one folder per encoder fingerprint, so another backbone, weights file or
input size never reads stale features; an encoder whose last stages are fine-tuned stores the
output of the frozen stages below them, (N, C, H, W), in a folder of its own):

    <cache_root>/<backbone>-<input>px-<grid>x<grid>-<fingerprint>/
        meta.json                  encoder config, L, D, dtype
        shard-00000.npy            (N, L, D) float16, memory-mapped when read
        shard-00000.keys.json      the N image ids of that shard, in row order
        failed.json                images that could not be decoded (id -> reason)

`sat features` over several processes gives each writer its own names (shard-00007-r001.npy,
failed-r001.json): no file is ever written by two processes.

Shards are written whole to a temporary name and renamed, so an interrupted extraction leaves
only complete shards and resumes with the images that are not in any shard yet. Nothing is held in
RAM but the index (and one shard being filled), and no file is ever rewritten: a 7x7x2048 (or
14x14x512) float16 grid is 200,704 bytes, so a 1024-image shard is 205.5 MB, Flickr8k's 7000
images 1.4 GB and COCO's 123,287 images 24.7 GB in 121 shards.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from showattendtell.data.datasets import CaptionedImage
from showattendtell.errors import UserError
from showattendtell.images.pipeline import encode_files
from showattendtell.network.encoder import Encoder, EncoderConfig
from showattendtell.progress import Progress

log = logging.getLogger(__name__)


class FeatureCacheError(UserError, ValueError):
    """The cache folder does not hold what its name says; the message says what to do."""


def cache_dir_for(cache_root: str | Path, config: EncoderConfig) -> Path:
    """The folder of one encoder's features; an encoder whose last N stages are fine-tuned
    caches the output of the stages below them instead (``...-below-top2-...``)."""
    g = config.grid
    what = f"below-top{config.fine_tune_stages}" if config.fine_tune_stages else f"{g}x{g}"
    name = f"{config.backbone}-{config.input_size}px-{what}-{config.fingerprint()}"
    return Path(cache_root) / name


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # processes may write the same file
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path, kind: type, cache_dir: Path):
    """``path`` parsed, checked to be a ``kind``; FeatureCacheError (what to do) otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        value, why = None, f"{type(e).__name__}: {e}"
    else:
        why = f"a JSON {type(value).__name__}, not a {kind.__name__}"
    if not isinstance(value, kind):
        raise FeatureCacheError(
            f"{path} is damaged ({why}): delete the folder {cache_dir} and run `sat features`"
        )
    return value


def _shard_keys(shard: Path) -> tuple[list[str], str | None]:
    """A shard's image ids, and what is wrong with it (None: nothing): its .npy must
    memory-map as a float16 array of one row per id in its .keys.json (a file cut short has a
    header promising more bytes)."""
    try:
        keys = json.loads(shard.with_suffix(".keys.json").read_text(encoding="utf-8"))
        arr = np.load(shard, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueError
        return [], f"{type(e).__name__}: {e}"
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return [], f"{shard.with_suffix('.keys.json').name} is not a list of image ids"
    if arr.dtype != np.float16 or arr.ndim < 2 or arr.shape[0] != len(keys):
        return [], f"a {arr.dtype} array of shape {arr.shape} for {len(keys)} image ids"
    return keys, None


class FeatureCache:
    """Read access to one cache folder: ``cache[image_id]`` -> float32 tensor (L, D)."""

    def __init__(self, directory: str | Path, repair: bool = False):
        """Index the cache in ``directory``. A damaged shard or failure record (cut short, not
        JSON, not an array) is removed when ``repair`` (its images count as missing, so the next
        extraction encodes them again) and raises FeatureCacheError otherwise."""
        self.dir = Path(directory)
        meta_file = self.dir / "meta.json"
        if not meta_file.is_file():
            raise FeatureCacheError(f"no feature cache in {self.dir} (meta.json missing)")
        self.meta = _read_json(meta_file, dict, self.dir)
        self.index: dict[str, tuple[int, int]] = {}
        self.shards: list[Path] = []
        for shard in sorted(self.dir.glob("shard-*.npy")):
            keys = self._checked_keys(shard, repair)
            if keys is None:
                continue
            for row, key in enumerate(keys):
                self.index[key] = (len(self.shards), row)
            self.shards.append(shard)
        self.failed: dict[str, str] = {}
        for failed in sorted(self.dir.glob("failed*.json")):
            try:
                self.failed.update(_read_json(failed, dict, self.dir))
            except FeatureCacheError:
                if not repair:
                    raise
                log.warning("feature cache: removed %s (not readable); retrying its images", failed)
                failed.unlink(missing_ok=True)
        self.writer = ""  # "-r001": the name suffix of this process's files (see ``extract``)
        self._arrays: dict[int, np.ndarray] = {}  # opened lazily, per process (DataLoader workers)

    def _checked_keys(self, shard: Path, repair: bool) -> list[str] | None:
        """The image ids of a readable shard; None for a damaged one that ``repair`` removed.
        An unreadable shard would otherwise crash training at its first batch from it."""
        keys, problem = _shard_keys(shard)
        if problem is None:
            return keys
        if not repair:
            raise FeatureCacheError(
                f"feature cache shard {shard} is damaged ({problem}): delete it and its "
                f"{shard.with_suffix('.keys.json').name}, then run `sat features` again"
            )
        log.warning(
            "feature cache shard %s is damaged (%s): removed it; its images are extracted again",
            shard,
            problem,
        )
        shard.unlink(missing_ok=True)  # the .npy first: a shard counts only while it exists
        shard.with_suffix(".keys.json").unlink(missing_ok=True)
        return None

    @classmethod
    def for_config(cls, cache_root: str | Path, config: EncoderConfig) -> FeatureCache:
        d = cache_dir_for(cache_root, config)
        d.mkdir(parents=True, exist_ok=True)
        meta = {
            "encoder": asdict(config),
            "fingerprint": config.fingerprint(),
            "grid": config.grid,
            "feature_dim": config.feature_dim,
            "dtype": "float16",
        }
        meta_file = d / "meta.json"
        if meta_file.is_file():
            old = _read_json(meta_file, dict, d)
            if old.get("fingerprint") != meta["fingerprint"]:
                raise FeatureCacheError(
                    f"{d} holds features of another encoder configuration: delete that folder"
                )
        else:
            _atomic_write_text(meta_file, json.dumps(meta, indent=1))
        return cls(d, repair=True)  # `sat features` and `sat train` refill what it drops

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, key: str) -> torch.Tensor:
        s, row = self.index[key]
        arr = self._arrays.get(s)
        if arr is None:
            arr = self._arrays[s] = np.load(self.shards[s], mmap_mode="r")
        return torch.from_numpy(np.asarray(arr[row], dtype=np.float32))

    def get(self, key: str) -> torch.Tensor | None:
        """The features of an image, or None when it is not cached (or failed to decode)."""
        return self[key] if key in self.index else None

    def __getstate__(self):  # DataLoader workers reopen the memory maps themselves
        state = self.__dict__.copy()
        state["_arrays"] = {}
        return state

    def missing(self, images: Sequence[CaptionedImage]) -> list[CaptionedImage]:
        """The images (each once) with neither cached features nor a recorded failure."""
        todo = {
            im.image_id: im
            for im in images
            if im.image_id not in self.index and im.image_id not in self.failed
        }
        return list(todo.values())

    def size_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.shards)

    # -- writing ------------------------------------------------------------------------------

    def extract(
        self,
        images: Sequence[CaptionedImage],
        encoder: Encoder,
        batch_size: int = 32,
        num_workers: int | None = None,
        shard_size: int = 1024,
        device: str | torch.device = "cpu",
        progress: bool = True,
        writer: str = "",
    ) -> int:
        """Compute and store the features of every image not cached yet; returns how many.
        ``writer`` (e.g. "-r001") names this process's files when several fill the cache."""
        self.writer = writer
        todo = self.missing(images)
        if not todo:
            return 0
        encoder = encoder.to(device).eval()
        keys: list[str] = []
        rows: list[np.ndarray] = []
        done = 0
        t0 = time.monotonic()
        with (
            torch.inference_mode(),
            Progress(len(todo), "features", None if progress else False) as bar,
        ):
            for batch, grids in encode_files(
                [im.path for im in todo],
                encoder.cached_features,
                encoder.config.input_size,
                batch_size,
                num_workers,
                device,
                bar,
            ):
                for i, reason in batch.failures():
                    log.warning("skipping %s: %s", todo[i].image_id, reason)
                    self.failed[todo[i].image_id] = reason
                if grids is not None:
                    keys += [todo[i].image_id for i in batch.decoded()]
                    rows.append(grids.to(torch.float16).cpu().numpy())
                while len(keys) >= shard_size:
                    done += self._write_shard(keys[:shard_size], rows, shard_size)
                    keys = keys[shard_size:]
        if keys:
            done += self._write_shard(keys, rows, len(keys))
        self._write_failed()
        elapsed = time.monotonic() - t0
        log.info(
            "features: stored %d images in %.0f s (%.1f img/s); cache now %.2f GB",
            done,
            elapsed,
            len(todo) / max(elapsed, 1e-9),
            self.size_bytes() / 1e9,
        )
        return done

    def _write_failed(self) -> None:
        if self.failed:
            _atomic_write_text(
                self.dir / f"failed{self.writer}.json", json.dumps(self.failed, indent=1)
            )

    def _next_shard_name(self) -> str:
        """shard-NNNNN (+ this writer's suffix), NNNNN past every shard there is: a shard
        another process renamed in since this cache was opened is seen too."""
        numbers = [
            int(f.name[6:11]) for f in self.dir.glob("shard-*.npy") if f.name[6:11].isdigit()
        ]
        return f"shard-{max(numbers, default=-1) + 1:05d}{self.writer}"

    def _write_shard(self, keys: list[str], rows: list[np.ndarray], n: int) -> int:
        stacked = np.concatenate(rows)
        data, rest = stacked[:n], stacked[n:]
        rows.clear()
        if len(rest):
            rows.append(rest)
        s, name = len(self.shards), self._next_shard_name()
        path = self.dir / f"{name}.npy"
        tmp = self.dir / f".{name}.npy.tmp"
        with open(tmp, "wb") as f:
            np.save(f, data)
        # keys first, then the array: a shard counts only once its .npy exists
        _atomic_write_text(path.with_suffix(".keys.json"), json.dumps(keys))
        os.replace(tmp, path)
        self.shards.append(path)
        for row, key in enumerate(keys):
            self.index[key] = (s, row)
        self._write_failed()  # an interrupted run keeps the failures found so far
        return n
