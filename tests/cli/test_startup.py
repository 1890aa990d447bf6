"""`sat caption`'s start-up imports only what captioning needs: no timm, torchvision, nltk or
Lightning, with the same pixels and the same encoder outputs as when they were used; `sat
--help` and `--version` import no torch; the first caption's CIDEr-D tables, built by numpy,
are those of the plain loop over every caption's n-grams."""

import ast
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from showattendtell.images.files import normalise, resize
from showattendtell.network.encoder import EFFICIENTNETS, IMAGENET_MEAN, IMAGENET_STD, lite_stages
from showattendtell.search.consensus import ORDERS, ConsensusIndex, ngram_counts

HEAVY = (
    "timm",
    "torchvision",
    "nltk",
    "lightning",
    "jsonargparse",
    "matplotlib",
    "pycocotools",
    "pycocoevalcap",
    "tensorboard",
    "torch._dynamo",
    "sympy",
    "gradio",
)


def imported_after(code: str, *prefixes: str) -> list[str]:
    """The modules under ``prefixes`` that running ``code`` in a fresh interpreter imports."""
    probe = (
        f"{code}\n"
        "import sys\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {set(prefixes)!r} "
        f"or m in {set(prefixes)!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_captioning_a_photo_imports_none_of_the_heavy_packages(tmp_path):
    """`sat caption photo.jpg` from the CLI's entry point, the bundled model, in a fresh
    interpreter: only what captioning needs."""
    photo = tmp_path / "photo.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(photo)
    code = (
        "import contextlib, io\n"
        "from showattendtell.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    assert main(['caption', {str(photo)!r}]) == 0\n"
        "assert '\"caption\"' in out.getvalue()\n"
    )
    assert imported_after(code, *HEAVY) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["caption", "--help"],
        ["evaluate", "--help"],
        ["export", "--help"],
        ["models", "--help"],
        ["serve", "--help"],
        ["data", "--help"],
    ],
)
def test_help_and_version_import_no_torch(argv):
    """`sat --help`, `--version` and each subcommand's --help are read from modules that import
    no torch (nor Lightning, numpy or Pillow): they print in a fraction of a second."""
    code = (
        "import contextlib, io\n"
        "from showattendtell.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "assert out.getvalue().startswith(('usage: sat', 'sat ')), out.getvalue()\n"
    )
    assert imported_after(code, "torch", "lightning", "numpy", "PIL", *HEAVY) == []


def test_the_decoding_flags_are_the_option_tables():
    """The torch-free table the CLI reads is the one decoding.py and DecodingConfig use."""
    from showattendtell.cli.main import build_parser
    from showattendtell.search import decoding
    from showattendtell.search import options as settings

    assert decoding.DECODING_OPTIONS is settings.DECODING_OPTIONS
    assert decoding.DecodingConfig is settings.DecodingConfig
    flags = build_parser()._subparsers._group_actions[0].choices["caption"]._option_string_actions
    for opt in settings.DECODING_OPTIONS.values():
        assert flags[opt.flag].dest == opt.name and flags[opt.flag].help == opt.help


def test_resize_and_normalise_give_torchvisions_values():
    TF = pytest.importorskip("torchvision.transforms.v2.functional")
    rng = np.random.default_rng(1)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((17, 300), (260, 260), (999, 640), (5, 5))
    ]
    for img in images:
        for size in (64, 224, 260):
            ours = resize(img, size)
            theirs = TF.resize(TF.pil_to_tensor(img), [size, size], antialias=True)
            assert ours.dtype == torch.uint8 and torch.equal(ours, theirs)
            batch = torch.stack([theirs, theirs.flip(1)])
            expected = TF.normalize(
                TF.to_dtype(batch, torch.float32, scale=True),
                list(IMAGENET_MEAN),
                list(IMAGENET_STD),
            )
            assert torch.equal(normalise(batch), expected)


@pytest.mark.parametrize("backbone", EFFICIENTNETS)
def test_lite_stages_compute_timms_network_with_its_weights(backbone):
    """Same tensor names in the same order, and the same features, BatchNorm statistics and
    'same' padding included, at the native size and an odd one."""
    timm = pytest.importorskip("timm")
    net = timm.create_model(f"tf_{backbone}", pretrained=False).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1, generator=gen)
                m.running_var.uniform_(0.5, 1.5, generator=gen)
    theirs = [
        torch.nn.Sequential(net.conv_stem, net.bn1),
        *net.blocks,
        torch.nn.Sequential(net.conv_head, net.bn2),
    ]
    ours = lite_stages(backbone)
    for o, t in zip(ours, theirs, strict=True):
        assert list(o.state_dict()) == list(t.state_dict())
        o.load_state_dict(t.state_dict())
    for size in (97, 260):
        x = torch.randn(1, 3, size, size, generator=gen)
        with torch.inference_mode():
            y = x
            for stage in ours:
                y = stage.eval()(y)
            torch.testing.assert_close(y, net.forward_features(x), atol=1e-5, rtol=1e-5)


def loop_tables(references: list[list[str]]) -> dict:
    """The CIDEr-D tables by a plain loop over every caption's ``ngram_counts``: n-gram ids in
    the order first seen, each caption's entries in its Counter's order."""
    ids: dict[tuple, int] = {}
    df: Counter = Counter()
    flat_ids, counts, ptr, lengths, starts = [], [], [0], [], [0]
    for captions in references:
        held = set()
        for caption in captions:
            words = caption.split()
            lengths.append(max(len(words) - 1, 0))
            for g, tf in ngram_counts(words).items():
                flat_ids.append(ids.setdefault(g, len(ids)))
                counts.append(tf)
                held.add(g)
            ptr.append(len(flat_ids))
        df.update(held)
        starts.append(len(lengths))
    log_n = math.log(len(references))
    grams = list(ids)
    idf = np.array([log_n - math.log(max(1.0, df[g])) for g in grams])
    order = np.array([len(g) - 1 for g in grams], np.int64)
    values = np.array(counts, np.float64) * idf[np.array(flat_ids, np.int64)]
    norms = np.zeros((len(lengths), ORDERS))
    for r in range(len(lengths)):
        for e in range(ptr[r], ptr[r + 1]):
            norms[r, order[flat_ids[e]]] += values[e] ** 2
    return {
        "ids": ids,
        "idf": idf,
        "order": order,
        "ptr": np.array(ptr),
        "flat_ids": np.array(flat_ids, np.int64),
        "values": values,
        "norms": np.sqrt(norms),
        "lengths": np.array(lengths, np.float64),
        "starts": np.array(starts),
    }


@pytest.mark.parametrize("seed", range(4))
def test_cider_d_tables_are_the_plain_loops(seed):
    """The same ids, entries, tf-idf values and norms, bit for bit, with empty captions, a
    photo without captions, one-word captions and repeated n-grams among them."""
    rng = np.random.default_rng(seed)
    words = ["a", "dog", "dogs", "runs", "on", "the", "grass", "a", "red", "ball", "x"][: 4 + seed]
    references = [
        [
            " ".join(rng.choice(words, size=int(rng.integers(0, 9))))
            for _ in range(rng.integers(0, 6))
        ]
        for _ in range(30)
    ]
    references[3] = []
    references[5] = ["", "dog", "dog dog dog dog dog dog"]
    index = ConsensusIndex(torch.randn(30, 4), references, neighbours=5)
    ours, theirs = index.prepare(), loop_tables(references)
    for name in ("idf", "order", "ptr", "flat_ids", "values", "norms", "lengths", "starts"):
        assert ours[name].dtype == theirs[name].dtype, name
        assert np.array_equal(ours[name], theirs[name]), name
    grams = [*theirs["ids"], ("zebra",), ("a", "zebra"), ("dog",) * 4, ("runs", "a", "zebra")]
    expected = [theirs["ids"].get(g, -1) for g in grams]
    assert ConsensusIndex._ids(ours, grams).tolist() == expected


@pytest.mark.slow
def test_sat_caption_pauses_the_garbage_collector_only_while_it_starts(tmp_path):
    """`sat caption` itself: the collector is paused while torch and the model load, on again
    for the captioning, and what is alive at the end is frozen (the exit then skips a last walk
    over torch's objects); main([...]) called from Python changes nothing."""
    photo = tmp_path / "photo.jpg"
    Image.fromarray(np.full((64, 64, 3), 128, np.uint8)).save(photo)
    probe = (
        "import atexit, gc, sys\n"
        "from showattendtell.captioning import captioner as inference\n"
        "from showattendtell.cli.main import main\n"
        "seen = []\n"
        "prepare = inference.Captioner.prepare\n"
        "def spy(self, *args, **kwargs):\n"
        "    seen.append(gc.isenabled())\n"
        "    prepare(self, *args, **kwargs)\n"
        "inference.Captioner.prepare = spy\n"
        "atexit.register(lambda: print('paused', seen, 'enabled', gc.isenabled(),"
        " 'frozen', gc.get_freeze_count() > 0, file=sys.stderr))\n"
    )
    program = probe + f"sys.argv = ['sat', 'caption', {str(photo)!r}]\nsys.exit(main())\n"
    called = probe + f"sys.exit(main(['caption', {str(photo)!r}]))\n"
    for code, expected in (
        (program, "paused [False] enabled True frozen True"),
        (called, "paused [True] enabled True frozen False"),
    ):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        assert '"caption"' in run.stdout
        assert run.stderr.strip().splitlines()[-1] == expected


def test_prepare_builds_the_calibration_and_the_consensus_tables(tmp_path):
    """Captioner.prepare builds what the first caption would (the tables in a thread, which
    the first reranking waits for); the captions are the same with and without it."""
    from showattendtell.captioning.captioner import load_model
    from showattendtell.search import familiarity

    photo = tmp_path / "photo.jpg"
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (80, 100, 3), dtype=np.uint8)).save(photo)
    cold = load_model(None, "cpu")
    warm = load_model(None, "cpu")
    index = warm.model.consensus
    assert index is not None and warm.decoding.rerank == "consensus"
    warm.prepare()
    assert familiarity.for_index(index)._reference is not None
    assert index.prepare() is index._tables  # built by the thread, or waited for here
    a, b = cold.caption([str(photo)])[0], warm.caption([str(photo)])[0]
    assert (a.caption, a.score, a.familiarity) == (b.caption, b.score, b.familiarity)
    greedy = load_model(None, "cpu")
    greedy.prepare(greedy.check_decoding(beam_size=1))  # no reranking: no tables
    assert greedy.model.consensus._tables is None
