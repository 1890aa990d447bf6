"""The encoder-feature cache: extraction, read-back, resume, invalidation, undecodable images."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.data import ROOT, write_flickr8k_folder

from showattendtell.cli.main import main
from showattendtell.data.datamodule import CaptionDataModule
from showattendtell.data.datasets import load_split
from showattendtell.data.feature_cache import FeatureCache, FeatureCacheError, cache_dir_for
from showattendtell.images.files import open_image, preprocess
from showattendtell.network.encoder import Encoder, EncoderConfig

CONFIG = EncoderConfig(backbone="resnet50", weights=None, input_size=64)  # 2x2x2048 grid


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder(CONFIG).eval()


N = 8


@pytest.fixture()
def images(synthetic_flickr):
    return load_split("flickr8k", synthetic_flickr, "train").images[:N]


@pytest.fixture(scope="module")
def expected(encoder, synthetic_flickr) -> dict[str, np.ndarray]:
    """Features computed in one batch, without the cache."""
    ims = load_split("flickr8k", synthetic_flickr, "train").images[:N]
    with torch.inference_mode():
        x = torch.stack([preprocess(open_image(im.path), 64) for im in ims])
        feats = encoder(x).to(torch.float16).float().numpy()
    return {im.image_id: f for im, f in zip(ims, feats, strict=True)}


def _assert_close(got: torch.Tensor, want: np.ndarray) -> None:
    # float16 storage; batch composition changes the last bit of the float32 sums
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-3, atol=1e-3)


def _extract(cache, images, encoder, **kw):
    kw = {"batch_size": 3, "num_workers": 0, "shard_size": 4, "progress": False, **kw}
    return cache.extract(images, encoder, **kw)


def _flickr8k_from_cache(root, cache, encoder, **sizes) -> CaptionDataModule:
    """A Flickr8k data module on ``root`` that trains from the feature cache in ``cache``, every
    word kept and no loader workers; ``sizes``: its batch sizes and validation images."""
    return CaptionDataModule(
        dataset="flickr8k",
        root=str(root),
        feature_cache=str(cache),
        encoder=encoder,
        min_word_count=1,
        num_workers=0,
        **sizes,
    )


def _quiet_trainer(**kw):
    """A Lightning trainer on the CPU that logs, checkpoints and prints nothing."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def test_extract_and_read_back(tmp_path, encoder, images, expected):
    cache = FeatureCache.for_config(tmp_path, CONFIG)
    assert cache.dir == cache_dir_for(tmp_path, CONFIG) and "2x2" in cache.dir.name
    assert _extract(cache, images, encoder, shard_size=3) == N
    shards = sorted(cache.dir.glob("shard-*.npy"))
    assert [np.load(s, mmap_mode="r").shape for s in shards] == [(3, 4, 2048)] * 2 + [(2, 4, 2048)]
    assert np.load(shards[0], mmap_mode="r").dtype == np.float16
    assert not list(cache.dir.glob("*.tmp"))

    reopened = FeatureCache.for_config(tmp_path, CONFIG)  # a new process: index from disk
    assert len(reopened) == N and reopened.missing(images) == []
    for key, f in expected.items():
        got = reopened[key]
        assert got.dtype == torch.float32 and got.shape == (4, 2048)
        _assert_close(got, f)
    assert _extract(reopened, images, encoder) == 0  # nothing left to do


def test_resume_after_interruption(tmp_path, encoder, images, expected):
    cache = FeatureCache.for_config(tmp_path, CONFIG)
    calls = 0
    real_forward = encoder.forward

    def dying_forward(x):
        nonlocal calls
        calls += 1
        if calls == 3:  # killed during the third batch: images 7-8 never reach a shard
            raise KeyboardInterrupt
        return real_forward(x)

    encoder.forward = dying_forward
    try:
        with pytest.raises(KeyboardInterrupt):
            _extract(cache, images, encoder)
    finally:
        del encoder.forward
    # one whole shard (4 images) was written; the 2 images after it were in RAM only
    (cache.dir / ".shard-00001.npy.tmp").write_bytes(b"half a shard")  # a crash mid-write
    resumed = FeatureCache.for_config(tmp_path, CONFIG)
    assert len(resumed) == 4
    todo = resumed.missing(images)
    assert [im.image_id for im in todo] == [im.image_id for im in images[4:]]
    assert _extract(resumed, images, encoder) == N - 4
    final = FeatureCache.for_config(tmp_path, CONFIG)
    assert len(final) == N
    for key, f in expected.items():
        _assert_close(final[key], f)


def _cut_short(shard):  # the header still promises every row
    os.truncate(shard, shard.stat().st_size // 2)


def _not_json(shard):
    shard.with_suffix(".keys.json").write_text('["1000_synthetic.jpg", oops')


def _random_bytes(shard):  # no .npy header: np.load would take it for a pickle
    shard.write_bytes(np.random.default_rng(0).bytes(5000))


def _one_key_short(shard):
    keys = json.loads(shard.with_suffix(".keys.json").read_text())
    shard.with_suffix(".keys.json").write_text(json.dumps(keys[:-1]))


@pytest.mark.parametrize("damage", [_cut_short, _not_json, _random_bytes, _one_key_short])
def test_a_damaged_shard_is_refused_or_extracted_again(
    tmp_path, encoder, images, expected, damage, caplog
):
    cache = FeatureCache.for_config(tmp_path, CONFIG)
    assert _extract(cache, images, encoder) == N  # shards 0 and 1, 4 images each
    shard = cache.dir / "shard-00001.npy"
    damage(shard)
    # a reader that cannot re-extract (consensus) names the shard and what to do
    with pytest.raises(FeatureCacheError, match=r"shard-00001\.npy is damaged.*sat features"):
        FeatureCache(cache.dir)
    # `sat features` / `sat train` drop the shard and encode its images again
    with caplog.at_level(logging.WARNING):
        repaired = FeatureCache.for_config(tmp_path, CONFIG)
    assert any("shard-00001.npy is damaged" in r.getMessage() for r in caplog.records)
    assert not shard.exists() and not shard.with_suffix(".keys.json").exists()
    assert len(repaired) == 4
    assert [im.image_id for im in repaired.missing(images)] == [im.image_id for im in images[4:]]
    assert _extract(repaired, images, encoder) == 4
    final = FeatureCache(cache.dir)
    assert len(final) == N
    for key, f in expected.items():
        _assert_close(final[key], f)


def test_damaged_meta_or_failure_record(tmp_path, encoder, images):
    cache = FeatureCache.for_config(tmp_path, CONFIG)
    (cache.dir / "failed.json").write_text("{not json")
    with pytest.raises(FeatureCacheError, match=r"failed\.json is damaged"):
        FeatureCache(cache.dir)
    assert FeatureCache.for_config(tmp_path, CONFIG).failed == {}  # its images are tried again
    assert not (cache.dir / "failed.json").exists()
    (cache.dir / "meta.json").write_text("[]")
    with pytest.raises(FeatureCacheError, match=r"meta\.json is damaged.*delete the folder"):
        FeatureCache.for_config(tmp_path, CONFIG)


def test_another_encoder_config_never_reads_these_features(tmp_path, encoder, images):
    cache = FeatureCache.for_config(tmp_path, CONFIG)
    _extract(cache, images[:2], encoder)
    for other in (
        EncoderConfig(backbone="resnet50", weights=None, input_size=96),
        EncoderConfig(backbone="resnet101", weights=None, input_size=64),
        EncoderConfig(backbone="resnet50", weights=None, input_size=64, grid_size=1),
    ):
        assert len(FeatureCache.for_config(tmp_path, other)) == 0
    # a fine-tuned encoder caches what its frozen stages compute, in a folder of its own
    tuned = EncoderConfig(backbone="resnet50", weights=None, input_size=64, fine_tune_stages=1)
    assert len(FeatureCache.for_config(tmp_path, tuned)) == 0
    assert len(FeatureCache.for_config(tmp_path, CONFIG)) == 2


def test_another_weights_file_invalidates(tmp_path):
    w = tmp_path / "w.pth"
    w.write_bytes(b"weights one")
    a = EncoderConfig(backbone="resnet50", weights=str(w)).fingerprint()
    w.write_bytes(b"weights two")
    assert EncoderConfig(backbone="resnet50", weights=str(w)).fingerprint() != a


def test_a_cache_of_another_config_under_this_name_is_refused(tmp_path):
    cache = FeatureCache.for_config(tmp_path, CONFIG)
    meta = json.loads((cache.dir / "meta.json").read_text())
    meta["fingerprint"] = "0" * 16
    (cache.dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FeatureCacheError, match="another encoder configuration"):
        FeatureCache.for_config(tmp_path, CONFIG)


def test_undecodable_image_is_recorded_and_skipped(tmp_path, encoder, images, caplog):
    bad_dir = tmp_path / "imgs"
    bad_dir.mkdir()
    bad = images[1]
    broken = bad_dir / bad.path.name
    broken.write_bytes(bad.path.read_bytes()[:200])  # a truncated JPEG
    bad.path = broken
    cache = FeatureCache.for_config(tmp_path / "cache", CONFIG)
    with caplog.at_level(logging.WARNING):
        assert _extract(cache, images, encoder) == N - 1
    assert any(bad.image_id in r.getMessage() for r in caplog.records)
    failed = json.loads((cache.dir / "failed.json").read_text())
    assert list(failed) == [bad.image_id] and str(broken) in failed[bad.image_id]
    again = FeatureCache.for_config(tmp_path / "cache", CONFIG)
    assert bad.image_id not in again and again.missing(images) == []  # not retried each run
    assert again.get(bad.image_id) is None


def test_datamodule_trains_from_the_cache_and_skips_bad_images(tmp_path, caplog):
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=6, n_dev=3)
    bad = sorted((root / "images").glob("*.jpg"))[0]
    bad.write_bytes(b"not a jpeg")
    dm = _flickr8k_from_cache(
        root, tmp_path / "c", CONFIG, batch_size=16, val_images=2, extract_batch_size=8
    )
    with caplog.at_level(logging.INFO):
        dm.prepare_data()
        dm.setup("fit")
    cache = FeatureCache.for_config(tmp_path / "c", CONFIG)
    assert len(cache) == 5 + 2 and list(cache.failed) == [bad.name]
    assert any("1 of 6 images have no cached features" in r.getMessage() for r in caplog.records)
    batches = list(dm.train_dataloader())
    assert sum(b["inputs"].shape[0] for b in batches) == 5 * 5  # the bad image's 5 captions gone
    assert batches[0]["inputs"].shape[1:] == (4, 2048)
    val = next(iter(dm.val_dataloader()))
    assert val["inputs"].shape == (2, 4, 2048)


def test_writers_never_share_a_file(tmp_path, encoder, images, expected):
    """Two processes filling one cache (`sat features --trainer.devices 2`), interleaved: each
    names its own shards and failures, and a reader sees them all."""
    first = FeatureCache.for_config(tmp_path, CONFIG)
    second = FeatureCache.for_config(tmp_path, CONFIG)  # opened before the first wrote
    assert _extract(first, images[:4], encoder, writer="-r000") == 4
    assert _extract(second, images[4:], encoder, writer="-r001") == N - 4
    names = sorted(f.name for f in first.dir.glob("shard-*.npy"))
    assert names == ["shard-00000-r000.npy", "shard-00001-r001.npy"]
    both = FeatureCache.for_config(tmp_path, CONFIG)
    assert len(both) == N and both.missing(images) == []
    for key, want in expected.items():
        _assert_close(both[key], want)


@pytest.mark.slow
def test_sat_features_on_two_processes(tmp_path, monkeypatch):
    """`sat features --trainer.devices 2` (gloo, CPU): every image once, the same features as
    one process (run in this one)."""
    root = write_flickr8k_folder(tmp_path / "f8k", n_train=12, n_dev=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    monkeypatch.chdir(tmp_path)
    caches = {}
    for devices in ("1", "2"):
        args = [
            "features",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--data.root",
            str(root),
            "--data.feature_cache",
            f"cache{devices}",
            "--data.extract_batch_size",
            "2",
            "--trainer.devices",
            devices,
            "--trainer.accelerator",
            "cpu",
        ]
        if devices == "1":
            assert main(args) == 0
        else:
            proc = subprocess.run(
                [sys.executable, "-m", "showattendtell.cli", *args],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
        (folder,) = (tmp_path / f"cache{devices}").iterdir()
        caches[devices] = FeatureCache(folder)
    one, two = caches["1"], caches["2"]
    assert len(two) == len(one) == 16
    keys = [k for s in two.shards for k in json.loads(s.with_suffix(".keys.json").read_text())]
    assert sorted(keys) == sorted(one.index)  # every image in exactly one shard
    assert {s.name.split("-")[-1] for s in two.shards} == {"r000.npy", "r001.npy"}
    for key in one.index:
        np.testing.assert_allclose(two[key].numpy(), one[key].numpy(), rtol=2e-3, atol=1e-3)


def test_fine_tuning_the_top_trains_from_the_frozen_stages_cache(tmp_path):
    """fine_tune_stages with a feature cache: the cache holds the frozen stages' output (its own
    folder), training runs the top stages on it and changes only their weights (and the
    decoder's)."""
    from showattendtell.training.lit_module import CaptionModule

    root = write_flickr8k_folder(tmp_path / "f8k", n_train=6, n_dev=3)
    enc = EncoderConfig(backbone="resnet50", weights=None, input_size=64, fine_tune_stages=1)
    dm = _flickr8k_from_cache(
        root, tmp_path / "c", enc, batch_size=8, val_images=3, extract_batch_size=4
    )
    dm.prepare_data()
    cache = FeatureCache.for_config(tmp_path / "c", enc)
    assert cache.dir.name.startswith("resnet50-64px-below-top1-")
    assert len(cache) == 6 + 3 and cache[next(iter(cache.index))].shape == (1024, 4, 4)
    torch.manual_seed(0)
    module = CaptionModule(
        dm.vocab_words, encoder=enc, decoder={"embed_dim": 8, "hidden_dim": 16, "attention_dim": 8}
    )
    before = {k: v.clone() for k, v in module.model.encoder.state_dict().items()}
    _quiet_trainer(max_steps=2, num_sanity_val_steps=0, limit_val_batches=1).fit(
        module, datamodule=dm
    )
    after = module.model.encoder.state_dict()
    changed = {
        k.split(".")[1]
        for k, v in after.items()
        if v.is_floating_point() and not torch.equal(v, before[k])
    }
    assert changed == {"4"}  # stages.4 (layer4), the one fine-tuned stage

    # a later stage (e.g. self-critical) started from that model file with the same stage
    # fine-tuned goes on from the tuned top stage; the frozen stages stay its own (the cache's)
    from showattendtell.model_file import save_model

    tuned = save_model(module.model, tmp_path / "tuned.safetensors")
    torch.manual_seed(1)
    later = CaptionModule(
        dm.vocab_words,
        encoder=enc,
        init_from=str(tuned),
        decoder={"embed_dim": 8, "hidden_dim": 16, "attention_dim": 8},
    )
    own = {k: v.clone() for k, v in later.model.encoder.state_dict().items()}
    _quiet_trainer(max_epochs=0).fit(later, datamodule=dm)
    for k, v in later.model.encoder.state_dict().items():
        expected = after[k] if k.startswith("stages.4.") else own[k]
        torch.testing.assert_close(v, expected, msg=k)
    assert any(not torch.equal(own[k], after[k]) for k in own if k.startswith("stages.4."))
    for k, v in later.model.decoder.state_dict().items():
        torch.testing.assert_close(v, module.model.decoder.state_dict()[k])
