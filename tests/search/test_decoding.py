import json

import pytest
import torch
from helpers import count_host_syncs, feats, trained_like_decoder
from helpers.photos import write_photos
from oracles.search import _block_repeats as reference_block_repeats
from oracles.search import reference_beam_search, reference_greedy_decode

from showattendtell.search.decoding import (
    END,
    UNK,
    _ban_repeats,
    _block_repeats,
    beam_search,
    greedy_decode,
)


def test_beam_of_one_equals_greedy():
    dec, a = trained_like_decoder(), feats()
    greedy = greedy_decode(dec, a, max_length=12)
    beam = beam_search(dec, a, beam_size=1, max_length=12)
    for g, b in zip(greedy, beam, strict=True):
        assert g[0].tokens == b[0].tokens
        assert abs(g[0].log_prob - b[0].log_prob) < 1e-4
        assert torch.allclose(g[0].alphas, b[0].alphas, atol=1e-6)


def assert_same_hypotheses(fast, slow):
    assert len(fast) == len(slow)
    for hyps_f, hyps_s in zip(fast, slow, strict=True):
        assert [h.tokens for h in hyps_f] == [h.tokens for h in hyps_s]
        assert [h.locations for h in hyps_f] == [h.locations for h in hyps_s]
        for f, s in zip(hyps_f, hyps_s, strict=True):
            assert abs(f.log_prob - s.log_prob) < 1e-5 and abs(f.score - s.score) < 1e-5
            assert f.alphas.shape == s.alphas.shape
            assert torch.allclose(f.alphas, s.alphas, atol=1e-6)


STRATEGIES = ["shrink", "fixed", "graph"]  # decoding._strategy (graph: padded, on a CPU ungraphed)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize(
    "attention,hard_mode", [("soft", "argmax"), ("hard", "argmax"), ("hard", "expectation")]
)
@pytest.mark.parametrize(
    "options", [{}, {"no_repeat_ngram": 2}, {"allow_unk": True}, {"min_length": 4}]
)
@pytest.mark.parametrize("end_shift", [0.0, -1.0, -1.5])
def test_greedy_gives_what_the_plain_implementation_gives(
    attention, hard_mode, options, end_shift, attend, strategy
):
    dec, a = later_end_decoder(attention, end_shift, attend), feats(B=7)
    for max_length in (1, 5, 12):
        opts = within(options, max_length)
        assert_same_hypotheses(
            greedy_decode(
                dec, a, max_length=max_length, hard_mode=hard_mode, strategy=strategy, **opts
            ),
            reference_greedy_decode(dec, a, max_length, hard_mode, **opts),
        )


def within(options: dict, max_length: int) -> dict:
    """``options`` with a minimum length of at most ``max_length`` (DecodingConfig refuses
    more)."""
    if "min_length" not in options:
        return options
    return {**options, "min_length": min(options["min_length"], max_length)}


@pytest.mark.parametrize(
    "attention,hard_mode", [("soft", "argmax"), ("hard", "argmax"), ("hard", "expectation")]
)
@pytest.mark.parametrize(
    "options",
    [{}, {"no_repeat_ngram": 2}, {"length_penalty": 1.0}, {"allow_unk": True}, {"min_length": 6}],
)
@pytest.mark.parametrize("end_shift", [0.0, -1.0, -1.5])
@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_beam_search_gives_what_the_plain_implementation_gives(
    attention, hard_mode, options, end_shift, attend, strategy
):
    """Images that finish early leave the batch, the first word is predicted once per image and
    beams share their image's grid: none of it may change a hypothesis."""
    dec, a = later_end_decoder(attention, end_shift, attend), feats(B=7)
    for beam_size, max_length in ((1, 8), (2, 1), (3, 12), (5, 10)):
        opts = within(options, max_length)
        assert_same_hypotheses(
            beam_search(
                dec,
                a,
                beam_size=beam_size,
                max_length=max_length,
                hard_mode=hard_mode,
                strategy=strategy,
                **opts,
            ),
            reference_beam_search(dec, a, beam_size, max_length, hard_mode=hard_mode, **opts),
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_beam_wider_than_half_the_vocabulary(strategy):
    """30 words and beam 20 (the service's largest): fewer candidates than the 2K the search
    ranks at the first step; the extra ones are dead, and the hypotheses are the plain search's."""
    dec, a = later_end_decoder(), feats(B=2)
    for options in ({}, {"no_repeat_ngram": 2}):
        assert_same_hypotheses(
            beam_search(dec, a, beam_size=20, max_length=2, strategy=strategy, **options),
            reference_beam_search(dec, a, beam_size=20, max_length=2, **options),
        )


def later_end_decoder(attention="soft", end_shift=-1.0, attend="before"):
    """Captions of several lengths: images are done at different steps."""
    dec = trained_like_decoder(attention, attend)
    with torch.no_grad():
        dec.out_vocab.bias[END] += end_shift
    return dec


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_search_under_bf16_autocast_gives_the_plain_implementation_captions(strategy):
    dec, a = later_end_decoder(), feats(B=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for fast, slow in (
            (
                greedy_decode(dec, a, max_length=8, strategy=strategy),
                reference_greedy_decode(dec, a, 8),
            ),
            (
                beam_search(dec, a, beam_size=3, max_length=8, strategy=strategy),
                reference_beam_search(dec, a, 3, 8),
            ),
        ):
            assert [[h.tokens for h in x] for x in fast] == [[h.tokens for h in x] for x in slow]
            assert all(h.alphas.shape == (len(h.tokens), 9) for x in fast for h in x)


def test_ngram_blocking_bans_what_the_per_row_loop_bans():
    gen = torch.Generator().manual_seed(0)
    for t in range(0, 9):
        hist = torch.randint(4, 8, (6, t), generator=gen)  # few words: many repeats
        logp = torch.randn(6, 10, generator=gen)
        for n in range(0, 5):
            expected = reference_block_repeats(logp, hist.tolist(), n)
            assert torch.equal(_block_repeats(logp, hist, n), expected)
            assert torch.equal(_ban_repeats(logp, hist, n), expected)


def test_beam_search_steps_only_the_rows_that_can_change_a_result():
    dec, a = later_end_decoder(), feats(B=7)
    rows, step = [], dec.step
    dec.step = lambda words, state, mode: rows.append(len(words)) or step(words, state, mode)
    hyps = beam_search(dec, a, beam_size=3, max_length=12, strategy="shrink")
    assert len({max(len(h.tokens) for h in hs) for hs in hyps}) > 1
    assert rows[0] == 7 and max(rows) == 7 * 3  # the first word once per image
    assert rows[1:] == sorted(rows[1:], reverse=True) and rows[-1] < 7 * 3  # done: gone


def test_beam_returns_one_attention_map_per_emitted_word():
    dec, a = trained_like_decoder(), feats()
    for hyps in beam_search(dec, a, beam_size=3, max_length=12):
        assert len(hyps) == 3
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert h.alphas.shape == (len(h.tokens), 9)
            assert torch.allclose(h.alphas.sum(1), torch.ones(len(h.tokens)), atol=1e-5)
            assert len(h.tokens) <= 12


def test_unk_is_never_emitted_by_default():
    dec, a = trained_like_decoder(), feats()
    for hyps in beam_search(dec, a, beam_size=3, max_length=8) + greedy_decode(
        dec, a, max_length=8
    ):
        for h in hyps:
            assert UNK not in h.tokens
    allowed = greedy_decode(dec, a, max_length=8, allow_unk=True)
    assert any(UNK in h[0].tokens for h in allowed)  # the bias above makes it likely


def test_beam_search_finds_higher_likelihood_than_greedy():
    dec, a = trained_like_decoder(), feats(B=8)
    greedy = greedy_decode(dec, a, max_length=10)
    beam = beam_search(dec, a, beam_size=5, max_length=10)
    assert all(b[0].log_prob >= g[0].log_prob - 1e-5 for g, b in zip(greedy, beam, strict=True))


def test_beam_log_prob_is_the_caption_log_probability():
    dec, a = trained_like_decoder(), feats(B=3)
    for hyps, x in zip(beam_search(dec, a, beam_size=3, max_length=12), a, strict=True):
        h = hyps[0]
        caption = torch.tensor([[1, *h.tokens, END]])
        with torch.no_grad():
            out = dec(x[None], caption, torch.tensor([len(h.tokens) + 1]))
            ll = -torch.nn.functional.cross_entropy(out.logits, out.targets, reduction="sum")
        # banned words are masked after the softmax: scores are the model's own log p
        assert abs(float(ll) - h.log_prob) < 1e-4


def test_hard_attention_decoding_reports_chosen_locations():
    dec, a = trained_like_decoder("hard"), feats()
    for mode in ("argmax", "sample"):
        for hyps in beam_search(dec, a, beam_size=2, max_length=6, hard_mode=mode):
            h = hyps[0]
            assert h.locations is not None and len(h.locations) == len(h.tokens)
            if mode == "argmax":
                assert h.locations == h.alphas.argmax(1).tolist()
    expect = greedy_decode(dec, a, max_length=6, hard_mode="expectation")
    assert all(h[0].locations is None for h in expect)


def repeated_ngrams(tokens: list[int], n: int) -> int:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams))


def test_no_repeat_ngram_blocks_every_repeated_ngram():
    dec, a = trained_like_decoder(), feats(B=6)
    with torch.no_grad():  # a favourite word and a late <end>: captions repeat themselves
        dec.out_vocab.bias[END] -= 6.0
        dec.out_vocab.bias[7] += 3.0
    free = beam_search(dec, a, beam_size=3, max_length=12) + greedy_decode(dec, a, max_length=12)
    assert any(repeated_ngrams(h.tokens, 2) for hyps in free for h in hyps)
    for n in (1, 2, 3):
        blocked = beam_search(
            dec, a, beam_size=3, max_length=12, no_repeat_ngram=n
        ) + greedy_decode(dec, a, max_length=12, no_repeat_ngram=n)
        for hyps in blocked:
            for h in hyps:
                assert repeated_ngrams(h.tokens, n) == 0, (n, h.tokens)
                assert len(h.tokens) <= 12


# -- the decoding options: one place checks them, for the CLI, the Python API and the service --

BAD_OPTIONS = [
    {"beam_size": 0},
    {"beam_size": 21},
    {"beam_size": 500},
    {"beam_size": 2.5},
    {"beam_size": True},
    {"max_length": 0},
    {"max_length": 101},
    {"length_penalty": float("nan")},
    {"length_penalty": float("inf")},
    {"length_penalty": -1},
    {"hard_mode": "maximum"},
    {"no_repeat_ngram": -1},
    {"min_length": -1},
    {"min_length": 101},
    {"min_length": 2.5},
    {"beam": 3},
]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=lambda o: f"{o}")
def test_bad_decoding_options_are_refused_everywhere(options, tiny_model_file, tmp_path, capsys):
    from showattendtell import caption_images, load_model
    from showattendtell.cli.main import main
    from showattendtell.search.decoding import DecodingConfig, DecodingError

    with pytest.raises(DecodingError) as e:
        DecodingConfig().with_overrides(**options)
    assert "\n" not in str(e.value)
    (img,) = write_photos(tmp_path, 1, seed=0, name="x.png")
    captioner = load_model(tiny_model_file, device="cpu")
    with pytest.raises(DecodingError):
        caption_images(captioner, [img], **options)
    ((name, value),) = options.items()
    if name == "beam" or isinstance(value, bool) or value == 2.5:  # argparse's own type errors
        return
    flag = "--" + name.replace("_", "-")
    # checked before the model is loaded: a missing model file is not even looked at
    assert main(["caption", str(img), flag, str(value), "--model", "missing.safetensors"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and flag in err and "\n" not in err


def test_integral_floats_are_whole_numbers_and_none_keeps_the_default():
    from showattendtell.search.decoding import DecodingConfig

    cfg = DecodingConfig(beam_size=5).with_overrides(beam_size=None, max_length=12.0)
    assert cfg.beam_size == 5 and cfg.max_length == 12 and isinstance(cfg.max_length, int)


def test_a_model_file_with_bad_stored_decoding_is_refused(tiny_model_file, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from showattendtell.model_file import ModelFileError, read_model

    with safe_open(str(tiny_model_file), framework="pt") as f:
        meta = f.metadata()
    meta["decoding"] = json.dumps({**json.loads(meta["decoding"]), "beam_size": 0})
    path = tmp_path / "bad.safetensors"
    save_file(load_file(str(tiny_model_file)), str(path), metadata=meta)
    with pytest.raises(ModelFileError, match="beam size"):
        read_model(path)


def fixed_loops(dec, a, ngram=2):
    """The fixed-shape search's step loops (greedy and beam 3) from a started state, with every
    mask: banned words, n-grams, a minimum and a maximum length."""
    from showattendtell.search.decoding import DecodingConfig, _beam_fixed_steps, _greedy_fixed_loop

    for loop, beam_size in ((_greedy_fixed_loop, 1), (_beam_fixed_steps, 3)):
        config = DecodingConfig(
            beam_size=beam_size, max_length=8, no_repeat_ngram=ngram, min_length=3
        )
        yield loop, (dec, dec.start(a, word_gates=True), a, config, False)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_fixed_search_steps_never_wait_for_the_device(monkeypatch, attention):
    """No call that copies a value to the host (and so waits for a GPU) inside the step loops
    of the fixed-shape search, ensembles and n-gram blocking included."""
    from showattendtell.ensemble import EnsembleDecoder

    calls = count_host_syncs(monkeypatch)
    a = feats(B=4)
    for dec in (
        later_end_decoder(attention),
        EnsembleDecoder([later_end_decoder(attention), trained_like_decoder()]),
    ):
        with torch.inference_mode():
            for loop, args in fixed_loops(dec, a):
                loop(*args)
    assert calls == []
    greedy_decode(later_end_decoder(attention), a, max_length=8, strategy="shrink")  # counted there
    assert calls


@pytest.mark.slow
def test_fixed_search_loops_compile_without_graph_breaks():
    """torch.compile(fullgraph=True) traces each loop whole, decoder steps included (what
    CUDA graphs and mode="reduce-overhead" need); the eager backend keeps the test fast."""
    import torch._dynamo

    a = feats(B=3)
    for attention in ("soft", "hard"):
        dec = later_end_decoder(attention)
        for loop, args in fixed_loops(dec, a):
            torch._dynamo.reset()
            compiled = torch.compile(loop, fullgraph=True, backend="eager")
            with torch.inference_mode():
                got, expected = compiled(*args), loop(*args)
            for x, y in zip(
                torch.utils._pytree.tree_leaves(got),
                torch.utils._pytree.tree_leaves(expected),
                strict=True,
            ):
                assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_both_strategies_give_an_ensembles_captions(beam_size):
    from showattendtell.ensemble import EnsembleDecoder
    from showattendtell.search.decoding import DecodingConfig, generate

    dec = EnsembleDecoder([later_end_decoder("hard"), later_end_decoder("soft", attend="after")])
    a = feats(B=6)
    for options in ({}, {"no_repeat_ngram": 2, "length_penalty": 1.0}):
        config = DecodingConfig(beam_size=beam_size, max_length=10, **options)
        assert_same_hypotheses(
            generate(dec, a, config, strategy="fixed"), generate(dec, a, config, strategy="shrink")
        )


# -- min_length: a mask-type option, from the table down to both search loops --


def early_end_decoder(attention="soft"):
    """A decoder whose captions end after a word or two: a minimum length has work to do."""
    dec = trained_like_decoder(attention)
    with torch.no_grad():
        dec.out_vocab.bias[END] += 4.0
    return dec


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_min_length_holds_in_greedy_and_beam_search(strategy, attention):
    dec, a = early_end_decoder(attention), feats(B=6)
    free = greedy_decode(dec, a, max_length=12, strategy=strategy) + beam_search(
        dec, a, beam_size=3, max_length=12, strategy=strategy
    )
    assert min(len(h.tokens) for hyps in free for h in hyps) < 5  # short without it
    for search, options in ((greedy_decode, {}), (beam_search, {"beam_size": 3})):
        for hyps in search(dec, a, max_length=12, min_length=5, strategy=strategy, **options):
            assert hyps and all(5 <= len(h.tokens) <= 12 for h in hyps), hyps
    # a minimum equal to the maximum: exactly that many words, <end> then forced
    for hyps in beam_search(dec, a, beam_size=2, max_length=4, min_length=4, strategy=strategy):
        assert all(len(h.tokens) == 4 for h in hyps)


def test_min_length_above_max_length_is_one_line_naming_both():
    from showattendtell.search.decoding import DecodingConfig, DecodingError

    with pytest.raises(DecodingError) as e:
        DecodingConfig(max_length=8).with_overrides(min_length=9)
    message = str(e.value)
    assert "--min-length" in message and "--max-length" in message and "\n" not in message
    assert DecodingConfig(max_length=8).with_overrides(min_length=8).min_length == 8


def test_a_recorded_search_is_keyed_by_the_options_the_loops_read():
    """Ranking options (length penalty, reranking) do not make another CUDA graph; every option
    the step loops read (the minimum length among them) does."""
    from showattendtell.search.decoding import DecodingConfig

    base = DecodingConfig()
    assert base.search_key() == base.with_overrides(length_penalty=1.0).search_key()
    assert base.search_key() == base.with_overrides(rerank="consensus").search_key()
    assert base.search_key() != base.with_overrides(min_length=2).search_key()
    assert base.search_key() != base.with_overrides(no_repeat_ngram=2).search_key()


def test_min_length_is_a_flag_of_sat_caption(tiny_model_file, tmp_path, capsys):
    """`sat caption --help` lists --min-length, made from the option table, and the flag
    reaches the search: every caption has at least that many words."""
    from showattendtell.cli.main import main

    with pytest.raises(SystemExit):
        main(["caption", "--help"])
    assert "--min-length N" in capsys.readouterr().out
    photos = write_photos(tmp_path, 3, seed=1)
    args = ["caption", *map(str, photos), "--model", str(tiny_model_file), "--device", "cpu"]
    for beam in ("1", "3"):
        assert main([*args, "--beam-size", beam, "--min-length", "8"]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(records) == 3 and all(len(r["words"]) == 8 for r in records)
        assert all(r["decoding"]["min_length"] == 8 for r in records)
    assert main([*args, "--min-length", "9"]) == 2  # the model stores max_length 8
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--min-length" in err and "\n" not in err
