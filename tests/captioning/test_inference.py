"""load_model / Captioner / caption_images: what every entry point calls."""

from __future__ import annotations

import hashlib
import json
import math
import warnings

import numpy as np
import pytest
import torch
from synthetic import make_example

from showattendtell import caption_images, load_model
from showattendtell.captioning.captioner import (
    Captioner,
    CaptionResult,
    finite_or_none,
    resolve_device,
)
from showattendtell.images.files import preprocess


def test_finite_or_none():
    assert finite_or_none(-1.234567, 4) == -1.2346
    assert finite_or_none(float("nan"), 4) is None and finite_or_none(-math.inf, 4) is None


def test_results_are_strict_json_even_with_a_non_finite_score():
    r = CaptionResult(
        "a dog",
        ["a", "dog"],
        float("-inf"),
        float("nan"),
        np.zeros((2, 2, 2)),
        None,
        [],
        warning="tiny",
    )
    d = r.to_dict(with_attention=True)
    assert d["score"] is None and d["log_prob"] is None and d["warning"] == "tiny"
    json.dumps(d, allow_nan=False)


def test_caption_batch_equals_caption_and_caption_images(tiny_model_file):
    captioner = load_model(tiny_model_file, "cpu")
    rng = np.random.default_rng(5)
    images = [make_example(rng)[0] for _ in range(3)]
    batch = torch.stack([preprocess(im, captioner.input_size) for im in images])
    a = [r.caption for r in captioner.caption_batch(batch, captioner.check_decoding(beam_size=2))]
    b = [r.caption for r in captioner.caption(images, beam_size=2)]
    c = [r.caption for r in caption_images(captioner, images, beam_size=2)]
    assert a == b == c
    r = captioner.caption(images[:1])[0]
    g = captioner.model.grid
    assert r.attention.shape == (len(r.words), g, g)
    assert np.allclose(r.attention.sum((1, 2)), 1.0, atol=1e-4)  # each word's map sums to 1


def test_the_stored_decoding_is_the_default(tiny_model_file):
    captioner = load_model(tiny_model_file, "cpu")
    assert captioner.decoding.beam_size == 3 and captioner.decoding.max_length == 8
    image = make_example(np.random.default_rng(0))[0]
    assert len(captioner.caption([image])[0].beams) == 3  # beam 3 keeps its 3 best
    assert len(captioner.caption([image], beam_size=1)[0].beams) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_asking_for_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def test_mixed_precision_captioning(tiny_model_file, tmp_path, capsys):
    """--precision bf16 runs under autocast (a GPU's fast path; the CPU has bf16 autocast
    too); 16 needs a GPU and says so; 32 is the default."""
    from showattendtell.cli.main import main

    image = make_example(np.random.default_rng(2))[0]
    exact = load_model(tiny_model_file, "cpu").caption([image], beam_size=2)[0]
    mixed = load_model(tiny_model_file, "cpu", precision="bf16")
    assert mixed.autocast is torch.bfloat16
    r = mixed.caption([image], beam_size=2)[0]
    assert r.words and r.attention.dtype == np.float32
    assert np.allclose(r.attention.sum((1, 2)), 1.0, atol=2e-2)
    assert abs(r.log_prob - exact.log_prob) < 0.5 * max(1.0, abs(exact.log_prob))
    path = tmp_path / "x.png"
    image.save(path)
    assert (
        main(
            [
                "caption",
                str(path),
                "--model",
                str(tiny_model_file),
                "--precision",
                "bf16",
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["caption"]
    if not torch.cuda.is_available():
        assert (
            main(["caption", str(path), "--model", str(tiny_model_file), "--precision", "16"]) == 2
        )
        err = capsys.readouterr().err.strip()
        assert err == (
            "error: --precision 16 needs a CUDA GPU; on a CPU use 32 (the default) or bf16"
        )


def test_odd_inputs_to_caption_images_are_the_projects_one_line_errors(tiny_model_file):
    """What a Python user may hand over: nothing (no captions), one path instead of a list
    (one caption, not one per letter), and things that are not images (an ImageError each,
    not torch's or the os module's TypeError)."""
    from PIL import Image

    from showattendtell.captioning.captioner import DeviceError
    from showattendtell.images.files import ImageError

    captioner = load_model(tiny_model_file, "cpu")
    assert caption_images(captioner, []) == []
    photo, _, _ = make_example(np.random.default_rng(0))
    assert len(caption_images(captioner, photo)) == 1
    for item, said in [
        (None, "not a NoneType"),
        (np.zeros((8, 8, 3), np.uint8), "not a ndarray"),
        (torch.zeros(3, 8, 8), "not a Tensor"),
        (Image.new("RGB", (0, 0)), r"the image is empty \(0x0 pixels\)"),
    ]:
        with pytest.raises(ImageError, match=said):
            caption_images(captioner, [item])
    with pytest.raises(DeviceError, match="'gpu' is not a device: give auto, cpu, cuda or cuda:N"):
        load_model(tiny_model_file, "gpu")


def test_caption_images_warns_of_a_decoding_option_the_model_ignores(
    tiny_model_file, tiny_hard_model_file
):
    """As the CLI warns for --hard-mode with a soft model (Captioner.applies): once per call."""
    images = [make_example(np.random.default_rng(i))[0] for i in range(2)]
    soft = load_model(tiny_model_file, "cpu")
    with pytest.warns(UserWarning) as caught:
        caption_images(soft, images, beam_size=1, hard_mode="sample")
    assert [str(w.message) for w in caught if "hard" in str(w.message)] == [
        "hard_mode is for hard-attention models; tiny has soft attention and ignores it"
    ]
    hard = load_model(tiny_hard_model_file, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        caption_images(hard, images, beam_size=1, hard_mode="sample")
        caption_images(soft, images, beam_size=1)


def test_made_by_names_the_model_and_the_decoding_options_that_apply(
    tiny_model_file, tiny_hard_model_file
):
    """What `sat caption` writes into each record: the stored settings with the overrides,
    only those that change this model's captions, and the precision."""
    stored = {"beam_size": 3, "max_length": 8, "length_penalty": 0.0, "no_repeat_ngram": 0}
    stored["min_length"] = 0
    stored["precision"] = "32"
    soft = load_model(tiny_model_file, "cpu")
    digest = hashlib.sha256(tiny_model_file.read_bytes()).hexdigest()
    assert soft.made_by() == {"model": "tiny", "model_sha256": digest, "decoding": stored}
    given = soft.check_decoding(beam_size=1, hard_mode="sample")
    assert soft.made_by(given)["decoding"] == {**stored, "beam_size": 1}
    hard = load_model(tiny_hard_model_file, "cpu", "bf16")
    assert hard.made_by(hard.check_decoding(hard_mode="sample")) == {
        "model": "tiny_hard",
        "model_sha256": hashlib.sha256(tiny_hard_model_file.read_bytes()).hexdigest(),
        "decoding": {**stored, "hard_mode": "sample", "precision": "bf16"},
    }
    both = load_model(f"{tiny_model_file}+{tiny_hard_model_file}", "cpu").made_by()
    assert both["model"] == "tiny+tiny_hard" and both["model_sha256"].split("+") == [
        digest,
        hard.made_by()["model_sha256"],
    ]
    in_memory = Captioner(soft.model, soft.decoding, "cpu", name="tiny")  # no file to name
    assert in_memory.made_by() == {"model": "tiny", "decoding": stored}
