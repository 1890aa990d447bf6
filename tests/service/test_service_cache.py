"""A service that runs for weeks (service/cache.py, app.launch): Gradio's cache folder stays
under its bound, old uploads go, sessions are bounded. The soak benchmark
(benchmarks/service_soak.py) measures the same on thousands of requests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.photos import photo

gr = pytest.importorskip("gradio")
from helpers.service import free_port  # noqa: E402
from showattendtell.service.app import launch  # noqa: E402
from showattendtell.service.cache import CacheBound  # noqa: E402
from showattendtell.service.worker import CaptionService  # noqa: E402


class FakeBlocks:
    """What CacheBound reads of a gr.Blocks: its components and its sets of cached files."""

    def __init__(self, files: set[str], keep: set[str] = frozenset()):
        class Example:
            keep_in_cache = set(keep)

        self.blocks = {1: Example()}
        self.upload_file_set = files
        self.temp_file_sets = [files]


def cached_file(folder: Path, name: str, size: int) -> str:
    """A file in a folder of its own, as Gradio stores an upload (its age counts from its
    ctime, as Gradio's own delete_cache counts it)."""
    sub = folder / f"hash_{name}"
    sub.mkdir()
    path = sub / name
    path.write_bytes(b"x" * size)
    return str(path)


def test_uploads_to_every_page_of_a_service_stay_readable(tmp_path: Path):
    """Two pages built on one service (a second ``prepare``): a photo uploaded to the first is
    still one the service may read, a file neither recorded is not."""
    first = FakeBlocks({cached_file(tmp_path, "first.jpg", 10)})
    second = FakeBlocks({cached_file(tmp_path, "second.jpg", 10)})
    bound = CacheBound(None)
    bound.start(first)
    bound.start(second)
    for files in (first.upload_file_set, second.upload_file_set):
        assert all(bound.holds(f) for f in files)
    assert not bound.holds(cached_file(tmp_path, "other.jpg", 10))


def test_sweep_keeps_the_cache_under_its_bound(tmp_path: Path):
    now = time.time()
    files = set()
    for i in range(10):  # written in this order: u0 is the oldest
        files.add(cached_file(tmp_path, f"u{i}.jpg", 1000))
        time.sleep(0.01)
    example = cached_file(tmp_path, "example.jpg", 5000)
    blocks = FakeBlocks(files | {example}, keep={example})
    bound = CacheBound(max_bytes=9000, grace_s=0)
    bound.blocks = blocks
    usage = bound.sweep(now=now + 2000)
    assert usage.bytes <= 9000 and usage.removed == 6 and Path(example).exists()
    left = sorted(Path(f).name for f in blocks.upload_file_set if Path(f).exists())
    assert left == ["example.jpg", "u6.jpg", "u7.jpg", "u8.jpg", "u9.jpg"]
    assert all(Path(f).exists() for f in blocks.upload_file_set)  # the set forgets removed ones
    gone = [p for p in tmp_path.iterdir() if not any(p.iterdir())]
    assert not gone  # an upload's own folder goes with it


def test_sweep_spares_files_in_use_and_in_their_grace_period(tmp_path: Path):
    now = time.time()
    files = {cached_file(tmp_path, f"u{i}.jpg", 1000) for i in range(4)}
    bound = CacheBound(max_bytes=500, grace_s=60)
    bound.blocks = FakeBlocks(set(files))
    assert bound.sweep(now=now).removed == 0  # all younger than the grace period
    busy = sorted(files)[0]
    with bound.using(busy):
        usage = bound.sweep(now=now + 120)
        assert Path(busy).exists() and usage.removed == 3
    assert bound.sweep(now=now + 120).removed == 1


def test_sweep_removes_old_files(tmp_path: Path):
    now = time.time()
    files = {cached_file(tmp_path, f"u{i}.jpg", 10) for i in range(3)}
    bound = CacheBound(max_bytes=None, max_age_s=3600, grace_s=0)
    bound.blocks = FakeBlocks(set(files))
    assert bound.sweep(now=now + 60).removed == 0
    assert bound.sweep(now=now + 3601).removed == 3


@pytest.mark.slow
def test_live_cache_stays_bounded_and_sessions_are_capped(
    service: CaptionService,
    tmp_path: Path,
):
    """Uploads through the API on a live server with a 0.1 MB cache: the cache folder never
    holds much more than the bound, and at most --max-sessions API clients are remembered."""
    from gradio_client import Client, handle_file
    from PIL import Image

    port = free_port()
    bound = CacheBound(max_bytes=100_000, grace_s=0, interval_s=0.2)
    app = launch(service, "127.0.0.1", port, block=False, cache=bound, max_sessions=3)
    try:
        url = f"http://127.0.0.1:{port}/"
        img = Image.open(photo(0)).convert("RGB")
        for i in range(6):  # 6 different photos of ~40 KB (twice the bound), each from a new client
            path = tmp_path / f"p{i}.png"
            img.rotate(i * 7).resize((200, 150)).save(path)
            d = Client(url, verbose=False).predict(handle_file(str(path)), api_name="/caption")
            assert d["caption"]
        usage = bound.sweep()  # the app's own files only: other apps' cache is not touched
        assert 0 < usage.bytes <= 100_000
        listed = {str(f) for files in app.temp_file_sets for f in files}  # some in two sets
        assert len(listed) == usage.files < 6
        assert len(app.state_holder.session_data) <= 3
    finally:
        app.close()
