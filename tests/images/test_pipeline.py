"""The one image pipeline (pipeline.py) and its progress reporter (progress.py)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers.photos import write_photos

from showattendtell.captioning.captioner import load_model
from showattendtell.captioning.pipeline import caption_files
from showattendtell.images import pipeline
from showattendtell.images.batches import batch_indices
from showattendtell.images.pipeline import default_workers, encode_files, in_lanes
from showattendtell.progress import Progress


def greedy(captioner):
    """The model's stored decoding with beam 1, resolved as an entry point resolves it."""
    return captioner.check_decoding(beam_size=1)


def write_inputs(tmp_path, n: int = 5) -> list[str]:
    paths = write_photos(tmp_path, n)
    (tmp_path / "bad.jpg").write_text("not an image")
    paths.insert(2, str(tmp_path / "bad.jpg"))
    return paths


def test_caption_files_keeps_every_input_in_order(tiny_model_file, tmp_path):
    paths = write_inputs(tmp_path)
    captioner = load_model(tiny_model_file, "cpu")
    with Progress(len(paths), "captions", enabled=False) as progress:
        records = list(
            caption_files(
                captioner,
                paths,
                batch_size=2,
                workers=0,
                progress=progress,
                decoding=greedy(captioner),
            )
        )
    assert [r.path for r in records] == paths and progress.done == len(paths)
    assert records[2].result is None and "not an image" in records[2].error
    alone = [
        r.caption for r in captioner.caption([p for p in paths if "bad" not in p], beam_size=1)
    ]
    assert [r.result.caption for r in records if r.result] == alone  # batches change nothing


@pytest.mark.parametrize(
    ("cores", "cpu", "gpu"), [(1, 0, 1), (2, 0, 1), (8, 0, 7), (16, 2, 15), (64, 4, 16)]
)
def test_images_decode_in_this_process_on_a_cpu_and_in_workers_for_a_gpu(
    monkeypatch, cores, cpu, gpu
):
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: cores)
    assert default_workers("cpu") == cpu and default_workers(torch.device("cuda")) == gpu


def test_caption_files_decodes_in_this_process_by_default_on_a_cpu(
    tiny_model_file, tmp_path, monkeypatch
):
    seen = []
    real = pipeline.load_batches
    monkeypatch.setattr(
        pipeline, "load_batches", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw)
    )
    paths = write_photos(tmp_path, 3)
    captioner = load_model(tiny_model_file, "cpu")
    records = list(caption_files(captioner, paths, batch_size=2, decoding=greedy(captioner)))
    assert seen == [default_workers("cpu")] and [r.path for r in records] == paths


def test_encode_files_gives_the_grids_of_the_decoded_inputs(tiny_model_file, tmp_path):
    paths = write_inputs(tmp_path, 3)
    captioner = load_model(tiny_model_file, "cpu")
    seen = []
    for batch, grids in encode_files(paths, captioner.encode, captioner.input_size, 3, 0):
        assert grids.shape[:2] == (len(batch.decoded()), captioner.model.grid**2)
        seen += [item.path for item in batch.items]
    assert seen == paths


def test_the_model_warms_up_while_the_decoding_processes_start(
    tiny_model_file, tmp_path, monkeypatch
):
    """Where decoding processes feed a GPU, the model captions a blank batch of the first
    batch's shape after they were started and before the first batch is asked of them, so
    that its first-call costs overlap their start; the captions are the same."""
    paths = write_inputs(tmp_path)
    captioner = load_model(tiny_model_file, "cpu")
    plain = [r.result and r.result.caption for r in
             caption_files(captioner, paths, 2, 1, decoding=greedy(captioner))]  # fmt: skip
    events = []
    real_load, real_encode = pipeline.load_batches, captioner.encode

    def load_batches(*a, **kw):
        batches = real_load(*a, **kw)
        events.append("processes started")

        def asked():
            for batch in batches:
                events.append("batch")
                yield batch

        return asked()

    def encode(images):
        blank = bool((images.amax(dim=(0, 2, 3)) == images.amin(dim=(0, 2, 3))).all())
        events.append(("encode", tuple(images.shape), blank))
        return real_encode(images)

    monkeypatch.setattr(pipeline, "load_batches", load_batches)
    monkeypatch.setattr(captioner, "encode", encode)
    monkeypatch.setattr(pipeline, "WARM_UP_DEVICES", {"cpu"})
    warm = [r.result and r.result.caption for r in
            caption_files(captioner, paths, 2, 1, decoding=greedy(captioner))]  # fmt: skip
    assert warm == plain
    s = captioner.input_size
    assert events[:3] == ["processes started", ("encode", (2, 3, s, s), True), "batch"]
    assert not any(e[2] for e in events[3:] if isinstance(e, tuple))  # photos from then on
    events.clear()
    list(caption_files(captioner, paths, batch_size=2, workers=0, decoding=greedy(captioner)))
    assert not any(e[2] for e in events if isinstance(e, tuple))  # no processes to wait for


def test_lanes_run_batches_at_once_in_order_on_a_share_of_the_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        both = threading.Barrier(2, timeout=10)  # breaks (fails) unless 2 calls overlap

        def work(i: int) -> tuple[int, int]:
            if i < 2:
                both.wait()
            return i, torch.get_num_threads()

        out = list(in_lanes(work, range(7), lanes=2))
        assert [i for i, _ in out] == list(range(7))
        assert {n for _, n in out} == {1}  # each lane on one of the two threads
        assert torch.get_num_threads() == 2  # and the caller's threads are given back
        assert list(in_lanes(lambda i: i * i, range(4), lanes=1)) == [0, 1, 4, 9]
        w = torch.ones(2, requires_grad=True)
        with torch.inference_mode():  # torch keeps it per thread: the lanes must inherit it
            out = list(in_lanes(lambda i: w * i, range(3), lanes=2))
        assert all(t.is_inference() and not t.requires_grad for t in out)
        with torch.no_grad():
            assert not any(t.requires_grad for t in in_lanes(lambda i: w * i, range(3), 2))
        assert all(t.requires_grad for t in in_lanes(lambda i: w * i, range(3), lanes=2))
    finally:
        torch.set_num_threads(before)


def test_each_lane_thread_sets_its_own_share_of_the_threads(monkeypatch):
    """MKL's thread count is per thread (a new thread's is all cores, whatever the main thread
    set, though torch.get_num_threads() says otherwise), so every lane must set it itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls: list[tuple[str, int]] = []
        real = torch.set_num_threads

        def recording(n: int) -> None:
            calls.append((threading.current_thread().name, n))
            real(n)

        monkeypatch.setattr(torch, "set_num_threads", recording)
        both = threading.Barrier(2, timeout=10)  # the two items run in two lane threads

        def lane_name(_: int) -> str:
            both.wait()
            return threading.current_thread().name

        names = list(in_lanes(lane_name, range(2), lanes=2))
        assert len(set(names)) == 2
        assert all((name, 1) in calls for name in names)
    finally:
        torch.set_num_threads(before)


def test_lanes_pass_errors_on_and_stop_when_the_consumer_does():
    started = []

    def work(i: int) -> int:
        started.append(i)
        if i == 3:
            raise ValueError("batch 3 failed")
        return i

    with pytest.raises(ValueError, match="batch 3"):
        list(in_lanes(work, range(100), lanes=2))
    assert max(started) < 10  # at most a lane's worth of batches beyond the failure
    started.clear()
    gen = in_lanes(work, range(100), lanes=2)
    assert next(gen) == 0
    gen.close()
    assert max(started) < 5


def test_caption_files_gives_the_same_records_in_one_or_two_lanes(tiny_model_file, tmp_path):
    paths = write_inputs(tmp_path, 7)
    captioner = load_model(tiny_model_file, "cpu")
    runs = [
        [
            (r.path, r.error, r.result and r.result.caption)
            for r in caption_files(
                captioner,
                paths,
                batch_size=2,
                workers=0,
                lanes=lanes,
                decoding=captioner.check_decoding(beam_size=3),
            )
        ]
        for lanes in (1, 2)
    ]
    assert runs[0] == runs[1] and [p for p, _, _ in runs[0]] == paths


def test_progress_writes_lines_without_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="showattendtell.progress")
    with Progress(10, "captions", every_s=0.0) as progress:  # stderr is no terminal here
        progress(4)
        progress(6)
    assert "captions: 4/10 images" in caplog.text and "captions: 10/10 images" in caplog.text
    caplog.clear()
    with Progress(2_000_000, "file.zip", unit="B", every_s=0.0, done=500_000) as progress:
        progress(500_000)
    assert "file.zip: 1 of 2 MB" in caplog.text
    caplog.clear()
    with Progress(3, "quiet", enabled=False) as progress:
        progress(3)
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("n", "batch_size", "lanes", "sizes"),
    [
        (120, 16, 2, [16] * 6 + [12, 12]),  # 7.5 batches: the last two lanes share 24 photos
        (128, 16, 2, [16] * 8),
        (33, 16, 2, [16, 9, 8]),
        (20, 16, 2, [10, 10]),
        (100, 16, 3, [16] * 4 + [12, 12, 12]),
        (1, 16, 2, [1]),
        (0, 16, 2, []),
        (120, 16, 1, [16] * 7 + [8]),  # one lane: plain consecutive batches
    ],
)
def test_the_last_batches_share_the_remainder_between_lanes(n, batch_size, lanes, sizes):
    batches = batch_indices(n, batch_size, lanes)
    assert [len(b) for b in batches] == sizes
    assert [i for b in batches for i in b] == list(range(n))  # every input once, in order


def test_lanes_get_balanced_batches_from_the_pipeline(tiny_model_file, tmp_path):
    paths = write_inputs(tmp_path, 8)  # 9 inputs, one undecodable
    captioner = load_model(tiny_model_file, "cpu")
    sizes = [
        len(batch.items)
        for batch, _ in encode_files(
            paths, captioner.encode, captioner.input_size, batch_size=4, workers=0, lanes=2
        )
    ]
    assert sizes == [4, 3, 2]  # not 4, 4, 1


def test_on_a_gpu_the_main_process_keeps_few_cpu_threads():
    """Spinning torch threads in the main process starved the decoding processes on a GPU
    machine: while a GPU captions, torch keeps GPU_HOST_THREADS; on a CPU, all of them."""
    from showattendtell.images.pipeline import GPU_HOST_THREADS, host_threads

    before = torch.get_num_threads()
    torch.set_num_threads(GPU_HOST_THREADS + 2)
    try:
        with host_threads(torch.device("cuda")):
            assert torch.get_num_threads() == GPU_HOST_THREADS
        assert torch.get_num_threads() == GPU_HOST_THREADS + 2
        with host_threads(torch.device("cpu")):
            assert torch.get_num_threads() == GPU_HOST_THREADS + 2
    finally:
        torch.set_num_threads(before)


def test_one_batch_is_decoded_here_without_starting_worker_processes(
    tiny_model_file, tmp_path, monkeypatch
):
    """`sat caption photo.jpg` on a GPU machine forked 15 decoding processes for one photo:
    with one batch there is nothing to decode ahead, so none start; with two, they do."""
    seen = []
    real = pipeline.load_batches
    monkeypatch.setattr(
        pipeline, "load_batches", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw)
    )
    captioner = load_model(tiny_model_file, "cpu")
    paths = write_photos(tmp_path, 3)
    for batch_size in (3, 2):
        records = list(
            caption_files(captioner, paths, batch_size, workers=2, decoding=greedy(captioner))
        )
        assert [r.path for r in records] == paths
    assert seen == [0, 2]
