"""What stands between the network and the service, piece by piece (service/login.py,
service/guard.py, service/uploads.refuse_urls, the cache bound's own folder): fast, no server.
The live server's answers are in test_service_hostile.py."""

from __future__ import annotations

import asyncio
import builtins
import errno
import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("gradio")
from showattendtell.service.cache import CacheBound  # noqa: E402
from showattendtell.service.guard import (  # noqa: E402
    DISK_FULL,
    SERVICE_FAILED,
    Guard,
    GuardMiddleware,
    answer,
    disk_full,
    refused_status,
)
from showattendtell.service.login import LoginThrottle, needs_login  # noqa: E402
from showattendtell.service.uploads import NOT_AN_UPLOAD, refuse_urls  # noqa: E402
from showattendtell.service.worker import ServiceError  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failed_logins_lock_the_address_out_for_longer_each_time():
    clock = Clock()
    throttle = LoginThrottle(free=3, base_s=2.0, max_s=10.0, clock=clock)
    for _ in range(2):
        throttle.failed("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 0  # the first few are free
    throttle.failed("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 2.0
    assert throttle.wait_s("10.0.0.2") == 0  # per address
    clock.now += 2.0
    throttle.failed("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 4.0  # doubles
    for _ in range(5):
        clock.now += 100
        throttle.failed("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 10.0  # at most max_s
    throttle.succeeded("10.0.0.1")
    assert throttle.wait_s("10.0.0.1") == 0


def test_login_throttle_remembers_a_bounded_number_of_addresses():
    throttle = LoginThrottle(free=1, capacity=3, clock=Clock())
    for i in range(10):
        throttle.failed(f"10.0.0.{i}")
    assert len(throttle._clients) == 3
    assert throttle.wait_s("10.0.0.9") > 0 and throttle.wait_s("10.0.0.0") == 0


@pytest.mark.parametrize(
    "path, needed",
    [
        ("/openapi.json", True),
        ("/gradio_api/openapi.json", True),
        ("/gradio_api/info", True),
        ("/gradio_api/queue/status", True),
        ("/gradio_api/upload", True),
        ("/monitoring/abc", True),
        ("/docs", True),
        ("/", False),
        ("/login", False),
        ("/assets/index.js", False),
        ("/gradio_api/login_check", False),
    ],
)
def test_every_route_but_the_login_pages_needs_a_login(path: str, needed: bool):
    assert needs_login(path) is needed


def test_a_url_in_any_input_is_refused_before_anything_is_fetched():
    url_file = {"path": "https://example.com/a.jpg", "meta": {"_type": "gradio.FileData"}}
    deep: object = url_file
    for _ in range(50):
        deep = {"a": [deep]}
    for inputs in ([url_file, None], [None, {"nested": [url_file]}], [deep], ["http://10.0.0.1/x"]):
        if isinstance(inputs[0], str):  # a bare string is not a file Gradio fetches
            refuse_urls(inputs)
            continue
        with pytest.raises(ServiceError, match=re.escape(NOT_AN_UPLOAD)):
            refuse_urls(inputs)
    # an upload (its "url" is the page's own link to it) and inline data pass
    refuse_urls(
        [
            {"path": "/cache/abc/photo.jpg", "url": "http://127.0.0.1:7860/gradio_api/file=x"},
            "data:image/png;base64,AAAA",
            None,
            3,
        ]
    )


def test_disk_full_is_found_through_causes_and_groups():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert disk_full(full)
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert disk_full(wrapped)
    group = getattr(builtins, "ExceptionGroup", None)  # Python 3.11+: anyio's task groups
    if group is not None:
        assert disk_full(group("tasks", [ValueError("x"), full]))
    assert not disk_full(OSError(errno.EACCES, "denied")) and not disk_full(ValueError("x"))


def test_direct_routes_answer_refusals_with_400_not_500():
    def body(error):
        return json.dumps({"error": error}).encode()

    assert refused_status(body("no image: upload one")) == 400
    assert refused_status(body(DISK_FULL)) == 507
    assert refused_status(body(SERVICE_FAILED)) == 500
    assert refused_status(body(None)) == 500
    assert refused_status(b"Internal Server Error") == 500


async def _ok(scope, receive, send) -> None:
    await answer(send, 200, "ok")


def test_http_basic_auth_on_every_route_with_the_throttle():
    """The HTTP API's login is the guard's: the page's credentials as HTTP Basic auth on every
    route (the API description too), wrong ones counted by the same throttle; a 401 asks a
    program for Basic auth, not the page's own routes (a browser would pop up a dialog)."""
    guard = Guard(throttle=LoginThrottle(free=2, base_s=60))
    guard.require([("alice", "pw:x")])
    client = TestClient(GuardMiddleware(_ok, guard))
    for path in ("/v1/models", "/openapi.json", "/metrics", "/gradio_api/info"):
        refused = client.get(path)
        assert refused.status_code == 401 and "curl -u" in refused.json()["error"]
        assert ("www-authenticate" in refused.headers) == (path != "/gradio_api/info")
        assert client.get(path, auth=("alice", "pw:x")).status_code == 200
    assert client.get("/healthz").status_code == 200  # load balancers' probes
    assert client.get("/v1/models", headers={"authorization": "Basic %%%"}).status_code == 401
    assert client.get("/v1/models", auth=("alice", "wrong")).status_code == 401
    locked = client.get("/v1/models", auth=("alice", "pw:x"))  # right, but locked out
    assert locked.status_code == 429 and locked.headers["retry-after"]
    assert "too many failed logins" in locked.json()["error"]


def test_a_500_sent_before_a_full_disk_is_raised_becomes_507():
    """A mounted app's error middleware answers 500 and then raises the error: a full disk is
    still answered 507; any other 500 passes unchanged."""

    def failing(error: Exception):
        async def app(scope, receive, send) -> None:
            await answer(send, 500, "Internal Server Error")
            raise error

        return TestClient(GuardMiddleware(app, Guard()), raise_server_exceptions=False)

    full = failing(OSError(errno.ENOSPC, "No space left on device")).post("/gradio_api/upload")
    assert full.status_code == 507 and full.json()["error"] == DISK_FULL
    other = failing(ValueError("bug")).post("/gradio_api/upload")
    assert other.status_code == 500


def test_drain_waits_for_requests_in_flight_then_says_how_many_are_left():
    class Queue:
        pending_event_ids_session = {"s1": {"e1", "e2"}}

    class Blocks:
        _queue = Queue()

    guard = Guard()
    guard.blocks = Blocks()
    assert guard.in_flight() == 2
    assert guard.drain(timeout_s=0.05, poll_s=0.01) == 2 and guard.draining
    Queue.pending_event_ids_session = {}
    assert guard.drain(timeout_s=5) == 0


def test_a_request_is_in_flight_until_its_answer_is_sent():
    """Not until the app returns: a client that has its whole answer is not waited for."""
    guard = Guard()
    counts: list[int] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        counts.append(guard.in_flight())  # answering
        await send({"type": "http.response.body", "body": b"{}"})
        counts.append(guard.in_flight())  # answered, the app still finishing

    async def nothing() -> dict:
        return {"type": "http.disconnect"}

    async def ignore(message) -> None:
        pass

    scope = {"type": "http", "path": "/v1/captions", "method": "POST", "headers": []}
    asyncio.run(GuardMiddleware(app, guard)(scope, nothing, ignore))
    assert counts == [1, 0] and guard.in_flight() == 0


class FakeBlocks:
    """What CacheBound reads of a gr.Blocks: its components and its sets of cached files."""

    def __init__(self, files: set[str]):
        self.blocks: dict = {}
        self.temp_file_sets = [files]


def test_cache_bound_covers_files_earlier_runs_left_in_its_folder(tmp_path: Path):
    for i in range(20):  # an earlier run's uploads, and a cut-short upload's temporary file
        sub = tmp_path / f"hash{i}"
        sub.mkdir()
        (sub / "photo.jpg").write_bytes(b"x" * 1000)
    (tmp_path / "tmpab12cd").write_bytes(b"x" * 500)
    mine = tmp_path / "mine" / "upload.jpg"
    mine.parent.mkdir()
    mine.write_bytes(b"y" * 1000)
    unbounded_by_folder = CacheBound(max_bytes=3000, grace_s=0)
    unbounded_by_folder.blocks = FakeBlocks({str(mine)})
    assert unbounded_by_folder.sweep(now=time.time() + 120).files == 1  # its own files only

    bound = CacheBound(max_bytes=3000, grace_s=60, folder=tmp_path)
    bound.blocks = FakeBlocks({str(mine)})
    usage = bound.sweep(now=time.time() + 120)
    assert usage.bytes <= 3000 and usage.removed == 19
    left = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(left) == 3 and mine in left  # the newest stay, this run's upload among them
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and not any(p.iterdir())]
    aged = CacheBound(max_bytes=None, max_age_s=60, grace_s=0, folder=tmp_path)
    aged.blocks = FakeBlocks(set())
    assert aged.sweep(now=time.time() + 3600).files == 0  # too old: all go
