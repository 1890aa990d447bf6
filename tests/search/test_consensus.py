"""Consensus reranking: the vectorised CIDEr-D, the nearest photos, the reranked beam, the index
in a model file and `sat export --consensus-root` / `--rerank consensus` from the CLI."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from helpers.photos import write_photos

from showattendtell.captioning.captioner import load_model
from showattendtell.cli.main import main
from showattendtell.evaluation.metrics import CiderDReward
from showattendtell.model_file import describe_model, read_model, save_model
from showattendtell.search.consensus import ConsensusIndex
from showattendtell.search.decoding import DecodingConfig, DecodingError

WORDS = [
    "a",
    "the",
    "dog",
    "dogs",
    "man",
    "woman",
    "runs",
    "jumps",
    "on",
    "in",
    "grass",
    "snow",
    "red",
    "blue",
    "ball",
    "field",
]


def random_captions(rng: np.random.Generator, n: int) -> list[str]:
    """Short captions from a small vocabulary: many shared n-grams, some repeated words."""
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(n)]


def test_cider_d_is_the_toolkits_with_the_training_idf():
    rng = np.random.default_rng(0)
    references = [random_captions(rng, 5) for _ in range(40)]
    index = ConsensusIndex(torch.randn(40, 8), references, neighbours=10)
    reward = CiderDReward(references)  # pycocoevalcap's arithmetic, the same idf
    for trial in range(20):
        photos = rng.choice(40, size=10, replace=False).tolist()
        candidates = [
            *random_captions(rng, 4),
            "",
            "zebra zebra on the moon",
            " ".join(references[photos[0]][0].split()),
        ]  # an exact reference
        ours = index.cider_d(candidates, photos)
        theirs = reward(candidates, [[c for p in photos for c in references[p]]] * 7)
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12, err_msg=str(trial))
    assert ours[-1] > ours[:-1].max()  # the reference itself agrees best


def test_cider_d_gives_the_same_scores_from_concurrent_threads():
    rng = np.random.default_rng(1)
    references = [random_captions(rng, 5) for _ in range(30)]
    index = ConsensusIndex(torch.randn(30, 4), references, neighbours=5)
    jobs = [
        (random_captions(rng, 3), rng.choice(30, size=5, replace=False).tolist())
        for _ in range(200)
    ]
    alone = [index.cider_d(c, p) for c, p in jobs]
    with ThreadPoolExecutor(4) as pool:  # the pipeline's lanes rerank at the same time
        together = list(pool.map(lambda job: index.cider_d(*job), jobs))
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a, b)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def _index_with_captionless_photos(rng: np.random.Generator) -> ConsensusIndex:
    """40 photos: 8 without captions (0-7), one with an empty caption among its own (8)."""
    references = [[] for _ in range(8)] + [random_captions(rng, 5) for _ in range(32)]
    references[8] = ["", *references[8][:2]]
    return ConsensusIndex(torch.randn(40, 8), references, neighbours=6)


def _beams(rng: np.random.Generator, photos: int, beam: int) -> list[list[str]]:
    """Each photo's candidates as a beam leaves them: ``beam`` captions, or fewer (one photo
    none), with an empty caption and captions of words no training caption has."""
    out = [random_captions(rng, int(rng.integers(1, beam + 1))) for _ in range(photos)]
    out[0] = []
    if photos > 1:
        out[1] = ["", "zebra", "zebra zebra on the moon"][:beam]
    if photos > 2:
        out[2][0] = f"a zebra {out[2][0]} {out[2][0]}"  # unknown and known n-grams, repeated
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam", [1, 3, 5])
def test_batched_cider_d_is_cider_d_photo_by_photo(device, beam):
    rng = np.random.default_rng(beam)
    index = _index_with_captionless_photos(rng)
    for photos in (1, 2, 7, 32):
        near = np.stack([rng.choice(40, size=6, replace=False) for _ in range(photos)])
        near[-1] = rng.permutation(8)[:6]  # the last photo's neighbours have no captions
        candidates = _beams(rng, photos, beam)
        batched = index.cider_d_batch(candidates, torch.as_tensor(near, device=device))
        assert len(batched) == photos
        for b, (ours, c) in enumerate(zip(batched, candidates, strict=True)):
            assert isinstance(ours, np.ndarray) and ours.shape == (len(c),)
            expected = index.cider_d(c, near[b]) if c else np.zeros(0)
            np.testing.assert_allclose(ours, expected, rtol=1e-9, atol=1e-12, err_msg=str(b))
        assert not batched[-1].any()  # no captions: no opinion


@pytest.mark.parametrize("device", DEVICES)
def test_batched_cider_d_without_anything_to_match(device):
    index = _index_with_captionless_photos(np.random.default_rng(3))
    near = torch.arange(12, device=device).view(2, 6)
    assert index.cider_d_batch([], near[:0]) == []
    for candidates in ([[], []], [["zebra", ""], ["moon zebra"]]):  # none, none known
        out = index.cider_d_batch(candidates, near)
        assert [s.tolist() for s in out] == [[0.0] * len(c) for c in candidates]


@pytest.mark.parametrize("device", DEVICES)
def test_rerank_scores_each_photo_against_its_nearest_photos(device):
    """``rerank`` (all photos at once) gives each photo the scores and so the order that
    ``cider_d`` gives against its ``nearest`` photos, one photo at a time."""
    rng = np.random.default_rng(4)
    index = _index_with_captionless_photos(rng)
    embeddings = torch.randn(24, 8, device=device)
    candidates = _beams(rng, 24, 5)
    near = index.nearest(embeddings).cpu().numpy()
    scores = index.rerank(embeddings, candidates)
    for b, (ours, c) in enumerate(zip(scores, candidates, strict=True)):
        expected = index.cider_d(c, near[b]) if c else np.zeros(0)
        np.testing.assert_allclose(ours, expected, rtol=1e-9, atol=1e-12)
        assert np.argsort(-ours, kind="stable").tolist() == (
            np.argsort(-expected, kind="stable").tolist()
        )
    assert index.rerank(embeddings[:0], []) == []


def test_batched_cider_d_from_concurrent_threads():
    """The pipeline's lanes rerank at the same time, the first of them while the index's
    device tables are being made."""
    rng = np.random.default_rng(5)
    index = _index_with_captionless_photos(rng)
    jobs = [
        (_beams(rng, 6, 3), np.stack([rng.choice(40, size=6, replace=False) for _ in range(6)]))
        for _ in range(40)
    ]
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(lambda job: index.cider_d_batch(job[0], torch.tensor(job[1])), jobs)
        )
    for (candidates, near), scores in zip(jobs, together, strict=True):
        for c, n, s in zip(candidates, near, scores, strict=True):
            np.testing.assert_allclose(s, index.cider_d(c, n) if c else [], rtol=1e-9)


def test_nearest_photos_by_cosine_of_the_pooled_grids():
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
    index = ConsensusIndex(embeddings, [["x"]] * 4, neighbours=2)
    grids = torch.tensor(
        [
            [[2.0, 0.1], [2.0, -0.1]],  # pooled (2, 0): photo 0, then 2
            [[0.0, 3.0], [0.2, 3.0]],
        ]
    )  # pooled (0.1, 3): photo 1, then 2
    assert ConsensusIndex.pool(grids).shape == (2, 2)
    assert index.nearest(ConsensusIndex.pool(grids)).tolist() == [[0, 2], [1, 2]]
    with pytest.raises(ValueError, match="neighbours"):
        ConsensusIndex(embeddings, [["x"]] * 4, neighbours=5)


def _index_agreeing_with(model, caption: str, dim: int) -> ConsensusIndex:
    """An index of 6 photos, all of them every photo's neighbours, 2 of them described by
    ``caption`` (the others by unrelated captions, so that its n-grams are rare: idf > 0)."""
    other = [["zebra on the moon"], ["a green triangle"], ["two men talk"], ["a cat sleeps"]]
    refs = [[caption, caption], *other[:2], [caption], *other[2:]]
    return ConsensusIndex(torch.randn(6, dim), refs, neighbours=6)


def test_rerank_puts_the_beams_caption_that_agrees_with_the_neighbours_first(
    tiny_model_file, tmp_path
):
    captioner = load_model(tiny_model_file, "cpu")
    photos = write_photos(tmp_path, 3, seed=5)
    plain = captioner.caption(photos, beam_size=5)
    model = captioner.model
    dim = model.encoder.config.feature_dim
    # for each photo, make the neighbours' captions the beam's LAST candidate
    for photo, result in zip(photos, plain, strict=True):
        last = result.beams[-1][0]
        assert last != result.caption
        model.consensus = _index_agreeing_with(model, last, dim)
        reranked = captioner.caption([photo], beam_size=5, rerank="consensus")[0]
        assert reranked.caption == last
        assert sorted(c for c, _ in reranked.beams) == sorted(c for c, _ in result.beams)
        # the words' attention maps are the chosen caption's own
        assert reranked.attention.shape[0] == len(reranked.words) == len(last.split())
    # without --rerank the stored decoding ("none") decodes without reranking
    assert [r.caption for r in captioner.caption(photos, beam_size=5)] == [r.caption for r in plain]


def test_rerank_without_an_index_is_a_clear_error(tiny_model_file, tmp_path):
    captioner = load_model(tiny_model_file, "cpu")
    with pytest.raises(DecodingError, match="consensus index"):
        captioner.caption(write_photos(tmp_path, 1), rerank="consensus")
    with pytest.raises(DecodingError, match="--rerank"):
        DecodingConfig(rerank="best")


def test_the_index_travels_in_the_model_file(tiny_model_file, tmp_path):
    model, decoding, info = read_model(tiny_model_file)
    assert model.consensus is None and describe_model(tiny_model_file)["consensus_photos"] == 0
    model.consensus = _index_agreeing_with(model, "a red circle", model.encoder.config.feature_dim)
    out = save_model(
        model,
        tmp_path / "with_index.safetensors",
        DecodingConfig(beam_size=4, rerank="consensus"),
        half=True,
    )
    again, stored, _ = read_model(out)
    assert stored.rerank == "consensus" and stored.beam_size == 4
    assert again.consensus.references == model.consensus.references
    assert again.consensus.neighbours == 6
    torch.testing.assert_close(
        again.consensus.embeddings, model.consensus.embeddings, atol=2e-3, rtol=0
    )
    assert describe_model(out)["consensus_photos"] == 6
    assert set(again.state_dict()) == set(model.state_dict())  # the index is no weight
    from safetensors.torch import load_file

    stored_rows = load_file(out)["consensus.embeddings"]
    assert stored_rows.dtype == torch.int8  # a quarter of float32, scales per row beside
    # an index stored as float16 (files written before the int8 format) loads the same way
    tensors, description = model.consensus.to_file()
    as_half = ConsensusIndex.from_file(
        {"embeddings": model.consensus.embeddings.half()}, description
    )
    torch.testing.assert_close(as_half.embeddings, model.consensus.embeddings, atol=2e-3, rtol=0)
    assert set(tensors) == {"embeddings", "scales"}


def test_export_builds_an_index_and_caption_uses_it(
    tiny_model_file, synthetic_flickr, tmp_path, capsys
):
    out = tmp_path / "indexed.safetensors"
    assert (
        main(
            [
                "export",
                str(tiny_model_file),
                str(out),
                "--consensus-root",
                str(synthetic_flickr),
                "--consensus-neighbours",
                "5",
                "--rerank",
                "consensus",
                "--beam-size",
                "3",
            ]
        )
        == 0
    )
    model, stored, info = read_model(out)
    assert stored.rerank == "consensus" and model.consensus.neighbours == 5
    assert len(model.consensus.references) == 24  # the synthetic training split
    assert all(
        c == c.lower() and "." not in c for refs in model.consensus.references for c in refs
    )  # tokenised as the training captions are
    assert "train (24 photos)" in info["consensus"]
    capsys.readouterr()
    photo = write_photos(tmp_path, 1, seed=3)[0]
    assert main(["caption", photo, "--model", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["caption"]
    # a model without an index: exit status 2 and one line that says what to do
    assert main(["caption", photo, "--model", str(tiny_model_file), "--rerank", "consensus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --rerank consensus needs") and "\n" not in err
    assert (
        main(
            [
                "export",
                str(tiny_model_file),
                str(tmp_path / "no.safetensors"),
                "--rerank",
                "consensus",
            ]
        )
        == 2
    )
    assert not (tmp_path / "no.safetensors").exists()


def test_a_feature_cache_of_another_encoder_is_refused(
    tiny_model_file, synthetic_flickr, tmp_path, capsys
):
    from showattendtell.data.datasets import load_flickr8k

    cache = tmp_path / "cache"
    cache.mkdir()
    images = load_flickr8k(synthetic_flickr, "train").images
    model, _, _ = read_model(tiny_model_file)
    grid = model.encoder.config.grid**2
    dim = model.encoder.config.feature_dim
    rows = np.random.default_rng(0).standard_normal((len(images), grid, dim)).astype(np.float16)
    np.save(cache / "shard-00000.npy", rows)
    (cache / "shard-00000.keys.json").write_text(json.dumps([im.image_id for im in images]))
    (cache / "meta.json").write_text(json.dumps({"grid": 2, "feature_dim": dim}))
    assert (
        main(
            [
                "export",
                str(tiny_model_file),
                str(tmp_path / "m.safetensors"),
                "--consensus-root",
                str(synthetic_flickr),
                "--feature-cache",
                str(cache),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "another encoder's features" in err and not (tmp_path / "m.safetensors").exists()


def test_build_index_from_a_dataset_in_python(tiny_model_file, synthetic_flickr):
    from showattendtell.captioning.consensus_index import build_index
    from showattendtell.data.datasets import load_flickr8k
    from showattendtell.errors import UsageError

    model, _, _ = read_model(tiny_model_file)
    index = build_index(model, "flickr8k", synthetic_flickr, "train", neighbours=4)
    images = load_flickr8k(synthetic_flickr, "train").images
    assert index.neighbours == 4 and len(index.references) == len(images) == 24
    captioner = load_model(tiny_model_file, "cpu")
    grids = captioner.encode(torch.stack([captioner.preprocess(im.path) for im in images[:3]]))
    torch.testing.assert_close(
        index.embeddings[:3],
        torch.nn.functional.normalize(ConsensusIndex.pool(grids), dim=1),
        atol=1e-4,
        rtol=0,
    )
    with pytest.raises(UsageError, match="from 1 to 24"):
        build_index(model, "flickr8k", synthetic_flickr, "train", neighbours=25)
