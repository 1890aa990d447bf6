"""The HTTP API of `sat serve` (/v1/captions, /v1/models, /healthz, /readyz, /metrics,
/openapi.json) through httpx against live servers on 127.0.0.1: the page mounted beside it, a
login, and `sat serve --api-only` as its own process (no Gradio imported, the docs' curl example,
a stop on SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.photos import encode, noise, photo, photos
from helpers.service import ROOT, png_bomb
from prometheus_client.parser import text_string_to_metric_families
from showattendtell.service.guard import Guard
from showattendtell.service.http_api import ApiSettings
from showattendtell.service.login import LoginThrottle
from showattendtell.service.serve import serve_until_stopped
from showattendtell.service.server import Background, PageSettings, build
from showattendtell.service.worker import CaptionService, load_service

from showattendtell.cli.main import main as sat_main
from showattendtell.search.decoding import DECODING_OPTIONS

LIMIT = 2**20  # the servers' upload limit: 1 MB a photo
LOGIN = ("alice", "s3cret:x")


def jpeg(i: int) -> tuple[str, bytes, str]:
    """The i-th example photo as a multipart file part."""
    return part(photo(i))


def part(path: Path) -> tuple[str, bytes, str]:
    """A JPEG file as a multipart file part."""
    return (path.name, path.read_bytes(), "image/jpeg")


@pytest.fixture(scope="module")
def api(service: CaptionService):
    """`sat serve` as it runs by default: the page mounted beside the API, no login."""
    app = build(service, ApiSettings(LIMIT, max_images=4, concurrency=4), PageSettings())
    server = Background(app)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.close()


class Clock:
    """The login throttle's clock, moved on by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Guarded:
    """A server with a login: its client, and its failed-login throttle's clock."""

    client: httpx.Client
    throttle: LoginThrottle
    clock: Clock


@pytest.fixture(scope="module")
def guarded(service: CaptionService):
    """The same with a login (the page's and the API's), its throttle as `sat serve`'s but on
    a clock the test moves instead of waiting."""
    clock = Clock()
    guard = Guard(throttle=LoginThrottle(clock=clock))
    server = Background(build(service, ApiSettings(LIMIT, auth=[LOGIN]), PageSettings(), guard))
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield Guarded(client, guard.throttle, clock)
    server.close()


def records(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    return response.json()["records"]


def refused(response: httpx.Response, status: int, match: str) -> str:
    """The one-line error of a refusal with ``status`` whose text matches ``match``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error", "detail"} and body["detail"] == body["error"]
    error = body["error"]
    assert "\n" not in error and "Traceback" not in error
    assert re.search(match, error), error
    return error


def test_records_equal_sat_caption(api: httpx.Client, service: CaptionService, tmp_path: Path):
    """Two photos in one request: the records `sat caption` writes for them, field for field
    (path aside: the CLI's is the path given, the API's the file name sent)."""
    model = service.get(None)
    files = [("images", jpeg(0)), ("images", jpeg(1))]
    got = records(
        api.post("/v1/captions", files=files, data={"beam_size": "2", "with_attention": "true"})
    )
    out = tmp_path / "out.jsonl"
    argv = ["caption", str(photo(0)), str(photo(1)), "--model", str(model.files[0])]
    argv += ["--beam-size", "2", "--with-attention", "--workers", "0", "--device", "cpu"]
    assert sat_main([*argv, "--output", str(out)]) == 0
    cli = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.pop("path") for r in got] == [photo(0).name, photo(1).name]
    assert [Path(r.pop("path")).name for r in cli] == [photo(0).name, photo(1).name]
    assert got == cli
    assert set(got[0]) >= {"caption", "words", "score", "familiarity", "confidence", "model"}
    assert all(0.0 <= r["confidence"] <= 1.0 for r in got) and "model_sha256" in got[0]
    assert got[0]["decoding"]["beam_size"] == 2 and len(got[0]["attention"]) == len(got[0]["words"])
    # the same records as JSON Lines on request, and without the grids when not asked for
    lines = api.post(
        "/v1/captions", files=files[:1], headers={"accept": "application/x-ndjson"}
    ).text.splitlines()
    assert len(lines) == 1 and "attention" not in json.loads(lines[0])


def test_options_select_model_and_decoding(api: httpx.Client, service: CaptionService):
    hard = service.names[1]
    (r,) = records(
        api.post(
            "/v1/captions",
            files=[("images", jpeg(2))],
            data={"model": hard, "hard_mode": "argmax", "max_length": "3", "beam_size": "1"},
        )
    )
    assert r["model"] == hard
    assert r["decoding"]["hard_mode"] == "argmax" and r["decoding"]["max_length"] == 3
    assert len(r["words"]) <= 3


@pytest.mark.parametrize(
    "files, data, status, match",
    [
        ([], {"beam_size": "2"}, 400, "no image.*images"),
        ([("images", ("notes.txt", b"this is not an image\n", "text/plain"))], {}, 400,
         r"^notes\.txt: not an image"),
        ([("images", ("empty.jpg", b"", "image/jpeg"))], {}, 400, r"^empty\.jpg: .*empty"),
        ([("images", ("bomb.png", png_bomb(), "image/png"))], {}, 400, r"^bomb\.png: .*too large"),
        # over the limit and not even an image: refused for its size, never decoded
        ([("images", ("big.jpg", b"x" * (LIMIT + 1), "image/jpeg"))], {}, 413,
         r"big\.jpg is larger than the 1 MB"),
        ([("images", jpeg(0))], {"beam": "5"}, 400, "unknown field 'beam'.*beam_size"),
        ([("images", jpeg(0))], {"beam_size": "50"}, 400,
         "^beam_size must be a whole number from 1 to 20, not 50$"),
        ([("images", jpeg(0))], {"length_penalty": "nan"}, 400, "^length_penalty must be a number"),
        ([("images", jpeg(0))], {"hard_mode": "maybe"}, 400, "^hard_mode must be one of argmax"),
        ([("images", jpeg(0))], {"model": "nope"}, 400, "unknown model 'nope'; available: tiny"),
        ([("images", jpeg(0))], {"rerank": "consensus"}, 400, "consensus"),
        ([("images", jpeg(0))], {"with_attention": "sometimes"}, 400, "with_attention must be"),
        ([("images", jpeg(0))] * 5, {}, 400, "at most 4 photos in one request"),
    ],
    ids=["no-image", "not-an-image", "empty", "bomb", "too-large", "unknown-option",
         "out-of-range", "not-a-number", "bad-choice", "unknown-model", "cannot-rerank",
         "bad-flag", "too-many"],
)  # fmt: skip
def test_bad_requests(api: httpx.Client, files, data, status, match):
    if not files:  # a form with fields only: still multipart, as a client sends it
        files = [("beam_size", (None, data.pop("beam_size")))]
    refused(api.post("/v1/captions", files=files, data=data), status, match)


def test_bad_requests_of_other_kinds(api: httpx.Client):
    refused(api.post("/v1/captions", json={"images": []}), 400, "multipart/form-data")
    refused(api.post("/v1/captions", files=[("images", (None, "photo.jpg"))]), 400, "files")
    refused(api.get("/v1/captions"), 405, "GET is not allowed")
    refused(api.get("/v1/nothing"), 404, "no such endpoint")


def test_a_body_over_the_limit_is_refused_unread(api: httpx.Client):
    """By its Content-Length before any byte of it is read; sent in chunks, once it passes the
    limit (the body limit: 4 photos at the limit plus 1 MB)."""
    host, port = api.base_url.host, api.base_url.port
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(
            b"POST /v1/captions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
            b"boundary=b\r\nContent-Length: 1000000000\r\n\r\n"
        )
        answer = read_to_end(s)  # no body sent: an answer now means it was not read
    assert answer.startswith("HTTP/1.1 413"), answer
    assert '"error":"the request is larger than the 5 MB' in answer

    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(
            b"POST /v1/captions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
            b"boundary=b\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        part = b"--b\r\nContent-Disposition: form-data; name=images; filename=a.jpg\r\n\r\n"
        block = b"x" * 2**16
        for data in [part] + [block] * (5 * 16):  # just past 5 MB; the body never ends
            s.sendall(b"%x\r\n%s\r\n" % (len(data), data))
        answer = read_to_end(s)
    assert answer.startswith("HTTP/1.1 413"), answer
    assert '"error":"the request is larger than the 5 MB' in answer


def read_to_end(s: socket.socket) -> str:
    """What the server sends until it closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data.decode()


def test_login(guarded: Guarded):
    """The page's credentials, as HTTP Basic auth: without them or wrong, a 401 saying how to
    log in; /healthz and /readyz stay open for load balancers; the page asks for them too. A
    wrong login counts toward the failed-login throttle: after ``free`` in a row a 429 with
    Retry-After, the right password unchecked, until the wait is over."""
    web, files = guarded.client, [("images", jpeg(0))]
    for auth in (None, ("alice", "wrong"), ("bob", LOGIN[1])):
        error = refused(web.post("/v1/captions", files=files, auth=auth), 401, "curl -u")
        assert LOGIN[1] not in error
        refused(web.get("/v1/models", auth=auth), 401, "log in")
        refused(web.get("/metrics", auth=auth), 401, "log in")
        assert web.get("/v1/models", auth=LOGIN).status_code == 200  # forgets the failures
    bad = web.get("/v1/models", headers={"authorization": "Basic %%%"})
    refused(bad, 401, "log in")
    assert web.get("/v1/models").headers["www-authenticate"].startswith("Basic")
    assert records(web.post("/v1/captions", files=files, auth=LOGIN))[0]["caption"]
    assert web.get("/healthz").status_code == 200
    assert web.get("/readyz").status_code == 200
    assert web.get("/config").status_code == 401  # Gradio's login guards the page

    for _ in range(guarded.throttle.free):
        refused(web.get("/v1/models", auth=("alice", "guess")), 401, "log in")
    locked = web.get("/v1/models", auth=LOGIN)
    refused(locked, 429, "too many failed logins .* try again in 1 s")
    assert locked.headers["retry-after"] == "1"
    guarded.clock.now += 1
    assert web.get("/v1/models", auth=LOGIN).status_code == 200


def test_no_login_needed_without_auth(api: httpx.Client):
    assert api.get("/v1/models").status_code == 200
    assert api.get("/metrics").status_code == 200


def test_page_is_mounted_beside_the_api(api: httpx.Client):
    page = api.get("/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    info = api.get("/gradio_api/info").json()
    assert "/caption" in info["named_endpoints"]


def test_models_health_ready(api: httpx.Client, service: CaptionService):
    models = api.get("/v1/models").json()["models"]
    assert [m["name"] for m in models] == service.names
    assert [m["default"] for m in models] == [True, False]
    soft, hard = models
    assert soft["attention"] == "soft" and "hard_mode" not in soft["options"]
    assert hard["decoding"]["hard_mode"] == "expectation"  # its stored mode
    assert soft["model_sha256"] == service.get(None).sha256
    assert api.get("/healthz").json() == {"status": "alive"}
    assert api.get("/readyz").json() == {"status": "ready", "models": service.names}


def test_readyz_says_when_the_worker_stopped(tiny_model_file: Path):
    stopped = load_service([tiny_model_file], device="cpu")
    server = Background(build(stopped, ApiSettings(), None))
    try:
        assert httpx.get(server.url + "/readyz").status_code == 200
        stopped.close()
        stopped._worker.join(30)
        refused(httpx.get(server.url + "/readyz"), 503, "worker has stopped")
        assert httpx.get(server.url + "/healthz").status_code == 200
    finally:
        server.close()


def test_openapi_schema_from_the_option_table(api: httpx.Client, service: CaptionService):
    schema = api.get("/openapi.json").json()
    body = schema["paths"]["/v1/captions"]["post"]["requestBody"]
    props = body["content"]["multipart/form-data"]["schema"]["properties"]
    assert set(props) == {"images", "model", "with_attention", *DECODING_OPTIONS}
    defaults = service.get(None).decoding
    for name, opt in DECODING_OPTIONS.items():
        assert props[name]["default"] == getattr(defaults, name)
        assert props[name]["description"].startswith(opt.help)
        if opt.choices:
            assert props[name]["enum"] == list(opt.choices)
        else:
            assert (props[name]["minimum"], props[name]["maximum"]) == (opt.low, opt.high)
    assert props["images"]["maxItems"] == 4
    assert props["model"]["enum"] == service.names
    assert {"/v1/models", "/healthz", "/readyz", "/metrics"} <= set(schema["paths"])


def test_concurrent_clients(api: httpx.Client, service: CaptionService):
    """8 clients at once, each with its photo: every answer is that photo's own caption (as a
    lone request gets it), and every photo went through the worker once."""
    shots = photos(4)
    alone = [records(api.post("/v1/captions", files=[("images", part(p))]))[0] for p in shots]
    before = len(service.batch_sizes)

    def one(i: int) -> dict:
        with httpx.Client(base_url=api.base_url, timeout=120) as client:
            return records(client.post("/v1/captions", files=[("images", part(shots[i % 4]))]))[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    for i, r in enumerate(answers):
        assert r["caption"] == alone[i % 4]["caption"] and r["path"] == shots[i % 4].name
    assert sum(list(service.batch_sizes)[before:]) == 8


@contextmanager
def held(svc: CaptionService) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``svc``'s worker holds its next batch until ``gate`` is set; ``entered`` is set once it
    holds it. The hold is gone when the block ends (the shared service serves on)."""
    entered, gate = threading.Event(), threading.Event()

    def hold(size: int) -> None:
        entered.set()
        gate.wait(60)

    svc.on_batch.append(hold)
    try:
        yield entered, gate
    finally:
        gate.set()
        svc.on_batch.remove(hold)


def test_busy_server_refuses_with_503(service: CaptionService):
    """Beyond --concurrency + --queue-size requests at once: a 503 with Retry-After, at once."""
    server = Background(build(service, ApiSettings(concurrency=1, queue_size=1), None))
    admission = server.app.state.admission
    try:
        with ThreadPoolExecutor(2) as pool, held(service) as (entered, gate):
            url = server.url + "/v1/captions"
            waiting = [pool.submit(httpx.post, url, files=[("images", jpeg(0))], timeout=120)]
            assert entered.wait(60)  # the first request is in the worker
            waiting.append(pool.submit(httpx.post, url, files=[("images", jpeg(0))], timeout=120))
            while admission.inside < 2:  # the second waits for the first's place
                assert not waiting[1].done(), waiting[1].result().text
                threading.Event().wait(0.01)
            response = httpx.post(url, files=[("images", jpeg(0))], timeout=30)
            refused(response, 503, "busy.*try again")
            assert response.headers["retry-after"]
            gate.set()
            assert [f.result().status_code for f in waiting] == [200, 200]
    finally:
        server.close()


def test_stop_answers_api_requests_in_flight_and_refuses_new_ones(service: CaptionService):
    """The graceful stop of `sat serve` covers the HTTP API: a caption request in flight when
    the stop comes is answered, one sent after gets 503 "stopping", then the server closes."""
    guard, stop = Guard(), threading.Event()
    server = Background(build(service, ApiSettings(LIMIT), PageSettings(), guard))
    stopper = threading.Thread(target=serve_until_stopped, args=(server, guard, stop, 60))
    try:
        with ThreadPoolExecutor(1) as pool, held(service) as (entered, gate):
            url = server.url + "/v1/captions"
            taken = pool.submit(httpx.post, url, files=[("images", jpeg(0))], timeout=120)
            assert entered.wait(60)  # the request is in the worker
            stop.set()
            stopper.start()
            while not guard.draining:
                threading.Event().wait(0.01)
            refused(httpx.post(url, files=[("images", jpeg(1))], timeout=30), 503, "stopping")
            assert stopper.is_alive() and guard.in_flight() == 1  # waiting for the one taken
            gate.set()
            assert records(taken.result())[0]["caption"]
        stopper.join(60)
        assert not stopper.is_alive() and not server.is_running
    finally:
        server.close()


def test_metrics(api: httpx.Client):
    files = [("images", jpeg(0)), ("images", ("thin.png", encode(noise((200, 8)), "PNG"), ""))]
    got = records(api.post("/v1/captions", files=files))
    assert "warning" in got[1] and "warning" not in got[0]
    api.post("/v1/captions", data={"beam_size": "0"}, files=[("images", jpeg(0))])
    api.get("/no/such/route/123")
    families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}

    def value(family: str, sample: str, **labels: str) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert (
        value("sat_http_requests", "sat_http_requests_total", route="/v1/captions", status="200")
        >= 1
    )
    assert (
        value("sat_http_requests", "sat_http_requests_total", route="/v1/captions", status="400")
        >= 1
    )
    routes = {s.labels["route"] for s in families["sat_http_requests"].samples}
    assert "/no/such/route/123" not in routes  # a bounded set of labels
    assert "page" in routes or "unmatched" in routes
    count = "sat_http_request_duration_seconds_count"
    assert value("sat_http_request_duration_seconds", count, route="/v1/captions") >= 2
    assert value("sat_batch_size", "sat_batch_size_count") >= 1
    assert value("sat_photos_captioned", "sat_photos_captioned_total") >= 2
    assert value("sat_warnings", "sat_warnings_total") >= 1
    assert "sat_queue_depth" in families
    assert value("sat_max_batch", "sat_max_batch") == 8  # the CPU's default: the service fixture's
    assert value("sat_concurrency", "sat_concurrency") == 4  # the api fixture's


def test_two_processes_answer_alike(service: CaptionService, tiny_model_file: Path):
    """Stateless: two servers with their own service (as two `sat serve` behind a load
    balancer) give the same records for the same request."""
    other = load_service([tiny_model_file], device="cpu")
    answers = []
    try:
        for svc in (service, other):
            server = Background(build(svc, ApiSettings(), None))
            try:
                files = [("images", jpeg(2))]
                answers.append(
                    records(httpx.post(server.url + "/v1/captions", files=files, timeout=120))
                )
            finally:
                server.close()
    finally:
        other.close()
    assert answers[0] == answers[1]


def curl_example() -> str:
    """The curl command of docs/service.md's "HTTP API" section, first of its kind."""
    text = (ROOT / "docs" / "service.md").read_text()
    block = re.search(r"```bash\n(curl [^`]*?/v1/captions[^`]*?)\n```", text)
    assert block, "docs/service.md has no curl example of /v1/captions"
    return block.group(1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_api_only_process(tiny_model_file: Path, tmp_path: Path):
    """`sat serve --api-only` in a process of its own: Gradio never imported, the docs' curl
    example answered, and SIGTERM stops it as it stops the page: the stop logged, exit 0."""
    port = socket_port()
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('gradio imported:', 'gradio' in sys.modules, "
        "file=sys.stderr, flush=True))\n"
        "from showattendtell.cli.main import main\n"
        f"sys.exit(main(['serve', '--api-only', '--model', {str(tiny_model_file)!r}, "
        f"'--port', '{port}', '--device', 'cpu']))\n"
    )
    env = {**os.environ, "SAT_SERVE_AUTH": "alice:s3cret"}
    proc = subprocess.Popen(
        [sys.executable, "-c", probe], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        shutil.copy(photo(0), tmp_path / "photo.jpg")
        command = curl_example().replace("127.0.0.1:7860", f"127.0.0.1:{port}")
        command = command.replace("user:password", "alice:s3cret")
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        (record,) = json.loads(done.stdout)["records"]
        assert record["path"] == "photo.jpg" and record["caption"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    # curl has its answer; the server may still be closing that request (0 or 1 in flight)
    assert re.search(r"stopping: finishing [01] request\(s\)", err), err
    assert "gradio imported: False" in err
    assert "Traceback" not in err


def socket_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until /readyz answers 200 (or the process ended: its error)."""
    with httpx.Client(timeout=5) as client:
        for _ in range(int(timeout / 0.25)):
            if proc.poll() is not None:
                raise AssertionError(f"sat serve ended: {proc.stderr.read()}")
            try:
                if client.get(url + "/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            threading.Event().wait(0.25)
    raise AssertionError(f"sat serve did not become ready in {timeout} s")


def test_shlex_of_the_curl_example():
    """The doc's example is one command with the photos as files of the field images."""
    words = shlex.split(curl_example().replace("\\\n", " "))
    assert words[0] == "curl" and "images=@photo.jpg" in words
