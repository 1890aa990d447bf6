"""The live service against hostile and careless clients: a URL as the image (never fetched), a
login guessed over and over (throttled; every route behind it), a full disk (a message, then
service again) and a battery of malformed requests (a message each, no traceback, one log line
each). Servers on 127.0.0.1, in this process, so that a write can fail on purpose."""

from __future__ import annotations

import errno
import http.server
import json
import logging
import re
import threading
import uuid

import pytest
from helpers.photos import photo

gr = pytest.importorskip("gradio")
import httpx  # noqa: E402
from showattendtell.service.blocks import EXAMPLE_PHOTO  # noqa: E402
from showattendtell.service.guard import DISK_FULL, Guard  # noqa: E402
from showattendtell.service.http_api import ApiSettings  # noqa: E402
from showattendtell.service.login import LoginThrottle  # noqa: E402
from showattendtell.service.server import Background, PageSettings, build  # noqa: E402
from showattendtell.service.uploads import NOT_AN_UPLOAD  # noqa: E402
from showattendtell.service.worker import CaptionService  # noqa: E402

pytestmark = pytest.mark.slow


class PhotoServer(http.server.ThreadingHTTPServer):
    """A web server on 127.0.0.1 serving one photo, recording every request it gets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        data = photo(0).read_bytes()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N805 (the server's handler)
                self.requests.append(handler.path)
                handler.send_response(200)
                handler.send_header("Content-Type", "image/jpeg")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

            do_HEAD = do_GET

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/photo.jpg"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def test_a_url_as_the_image_is_refused_and_never_fetched(server: str, monkeypatch):
    from gradio import processing_utils
    from gradio_client import Client, handle_file

    fetched: list[str] = []

    async def no_download(url: str, cache_dir: str) -> str:  # Gradio's download, spied on
        fetched.append(url)
        raise AssertionError(f"the server fetched {url}")

    monkeypatch.setattr(processing_utils, "async_ssrf_protected_download", no_download)
    web = PhotoServer()
    try:
        client = Client(server, verbose=False)
        for url in (web.url, "https://example.com/photo.jpg"):
            with pytest.raises(Exception, match=re.escape(NOT_AN_UPLOAD)):
                client.predict(handle_file(url), api_name="/caption")
            with pytest.raises(Exception, match=re.escape(NOT_AN_UPLOAD)):
                client.predict({"path": url}, api_name="/caption")  # no meta: read by us
        assert web.requests == [] and fetched == []
        # the API page's example names a local file, which the client uploads: it works
        info = httpx.get(server + "gradio_api/info").json()
        example = info["named_endpoints"]["/caption"]["parameters"][0]["example_input"]
        assert example["url"] == EXAMPLE_PHOTO and "http" not in json.dumps(example)
        assert client.predict(handle_file(str(photo(0))), api_name="/caption")["caption"]
    finally:
        web.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_failed_logins_are_throttled_and_every_route_needs_the_login(
    service: CaptionService,
):
    clock = Clock()
    guard = Guard(throttle=LoginThrottle(free=5, base_s=2.0, clock=clock))
    settings = ApiSettings(auth=[("alice", "s3cret")])
    running = Background(build(service, settings, PageSettings(), guard))  # as `sat serve`
    url = running.url
    try:
        with httpx.Client(base_url=url) as web:
            for path in (
                "/openapi.json",
                "/docs",
                "/v1/models",
                "/metrics",
                "/gradio_api/openapi.json",
                "/gradio_api/info",
                "/gradio_api/queue/status",
                "/monitoring/x",
                "/config",
            ):
                r = web.get(path)
                assert r.status_code == 401, path
                assert "log in" in r.json().get("error", r.text), path
            page = web.get("/")  # the login page, and what it loads, need no login
            assert page.status_code == 200 and '"auth_required":true' in page.text.replace(" ", "")
            linked = set(re.findall(r'(?:src|href)="\./?([^"?#]+)', page.text))
            assert any(p.startswith("assets/") for p in linked)
            for path in linked | {"theme.css", "gradio_api/theme.css", "favicon.ico"}:
                assert web.get("/" + path).status_code != 401, path
            statuses = []
            for _ in range(30):
                r = web.post("/login", data={"username": "alice", "password": "guess"})
                statuses.append(r.status_code)
            assert statuses[:5] == [400] * 5 and set(statuses[5:]) == {429}
            assert "try again in" in r.json()["error"] and int(r.headers["retry-after"]) >= 1
            # locked out: even the right password is not checked until the wait is over
            right = {"username": "alice", "password": "s3cret"}
            assert web.post("/login", data=right).status_code == 429
            clock.now += 3600
            assert web.post("/login", data=right).status_code == 200
            assert web.get("/openapi.json").status_code == 200  # the login's cookie
            assert web.get("/v1/models").status_code == 200
            r = web.post("/login", data={"username": "alice", "password": "guess"})
            assert r.status_code == 400  # a success forgot the failures
    finally:
        running.close()


def test_a_full_disk_gets_a_message_and_the_service_recovers(
    server: str,
    monkeypatch,
    capfd,
):
    from gradio import route_utils
    from gradio_client import Client, handle_file
    from showattendtell.service import captioning

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    client = Client(server, verbose=False)
    with monkeypatch.context() as m:
        m.setattr(route_utils.GradioUploadFile, "write", full)  # an upload being written
        files = {"files": ("photo.jpg", photo(0).read_bytes(), "image/jpeg")}
        r = httpx.post(server + "gradio_api/upload", files=files)
        assert r.status_code == 507 and r.json()["error"] == DISK_FULL
        # gradio_client reports the upload's status, not its message
        with pytest.raises(Exception, match="507 Insufficient Storage"):
            client.predict(handle_file(str(photo(1))), api_name="/caption")
    with monkeypatch.context() as m:
        m.setattr(captioning, "read_upload", full)  # a write while captioning
        with pytest.raises(Exception, match="disk is full"):
            client.predict(handle_file(str(photo(0))), api_name="/caption")
    # space again: served as before
    assert client.predict(handle_file(str(photo(0))), api_name="/caption")["caption"]
    assert "Traceback" not in capfd.readouterr().err


def sse_result(text: str) -> str:
    """The message of a finished event from Gradio's event stream (``data: ...`` lines)."""
    for line in text.splitlines():
        if line.startswith("data:"):
            data = json.loads(line[5:])
            if isinstance(data, dict) and data.get("msg") == "process_completed":
                return data["output"].get("error") or ""
            if isinstance(data, dict) and "error" in data:
                return data["error"] or ""
    return ""


def test_malformed_requests_get_a_message_each_and_no_traceback(
    server: str,
    service: CaptionService,
    capfd,
    caplog,
):
    api = server + "gradio_api"
    info = httpx.get(api + "/info").json()
    n = len(info["named_endpoints"]["/caption"]["parameters"])
    url_file = {"path": "http://127.0.0.1:9/x.jpg", "meta": {"_type": "gradio.FileData"}}
    rest = [None] * (n - 1)
    inputs = {
        "a URL as the image": [url_file, *rest],
        "a number as the image": [5, *rest],
        "a list as the image": [[1, 2], *rest],
        "a huge string as the image": ["x" * 1_000_000, *rest],
        "a server path as the image": ["/etc/passwd", *rest],
        "no image": [None, *rest],
        "too few inputs": [None, None],
        "no inputs": [],
        "a dict as the model": [None, {"a": 1}, *rest[1:]],
        "an unknown model": [None, "nope", *rest[1:]],
        "a word as the beam size": [None, None, "x", *rest[2:]],
        "a list as the beam size": [None, None, [1], *rest[2:]],
        "a fraction as the beam size": [None, None, 2.5, *rest[2:]],
    }
    bodies = {
        "garbage JSON": b"{not json",
        "data not a list": json.dumps({"data": {"a": 1}}).encode(),
        "no data": json.dumps({"session_hash": "x"}).encode(),
        "a huge body that is not JSON": b'{"data": [' + b"9," * 1_000_000,
    }
    messages: dict[str, str] = {}
    caplog.set_level(logging.INFO, logger="showattendtell")
    with httpx.Client(timeout=60) as web:
        for name, data in inputs.items():
            for route in ("call", "run"):
                before = len(caplog.records)
                r = web.post(f"{api}/{route}/caption", json={"data": data})
                if route == "call" and r.status_code == 200:
                    event = r.json()["event_id"]
                    message = sse_result(web.get(f"{api}/call/caption/{event}").text)
                else:
                    assert 400 <= r.status_code < 500, (name, route, r.status_code)
                    message = r.json().get("error") or ""
                messages[f"{name} ({route})"] = message
                refusals = [rec for rec in caplog.records[before:] if "refused" in rec.message]
                assert len(refusals) == 1, (name, route, [r.message for r in refusals])
        for name, body in bodies.items():
            for path in ("/call/caption", "/run/caption", "/queue/join"):
                r = web.post(api + path, content=body, headers={"content-type": "application/json"})
                assert 400 <= r.status_code < 500, (name, path, r.status_code)
                messages[f"{name} ({path})"] = r.json().get("error") or str(r.json()["detail"])
        join = {"data": [None] * n, "session_hash": uuid.uuid4().hex}
        for name, body in {
            "an unknown event number": {**join, "fn_index": 999},
            "an event number that is a word": {**join, "fn_index": "x"},
        }.items():
            r = web.post(api + "/queue/join", json=body)
            assert 400 <= r.status_code < 500, (name, r.status_code)
            messages[name] = r.json().get("error") or str(r.json()["detail"])
        for route in ("call", "run"):
            r = web.post(f"{api}/{route}/nope", json={"data": [None]})
            assert r.status_code == 404
            messages[f"an unknown API name ({route})"] = r.json()["error"]
    empty = [name for name, message in messages.items() if not message.strip()]
    assert not empty, empty
    assert "/caption" in messages["an unknown API name (run)"]
    assert "in this order: image, model" in messages["too few inputs (run)"]
    assert all(len(m) < 400 for m in messages.values())  # one line, not the request echoed
    err = capfd.readouterr().err
    assert "Traceback" not in err and "xxxxxxxxxx" not in err
    # and the service still answers
    from gradio_client import Client, handle_file

    d = Client(server, verbose=False).predict(handle_file(str(photo(0))), api_name="/caption")
    assert d["caption"]
