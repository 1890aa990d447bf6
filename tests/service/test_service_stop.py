"""Stopping `sat serve` (the real command, as a service manager stops it): SIGTERM with requests
in flight answers them all, refuses new ones with a message, logs one line and exits 0."""

from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
from pathlib import Path
from typing import IO

import httpx
import pytest
from helpers.photos import photo
from helpers.processes import free_port, start_sat

pytestmark = pytest.mark.slow


class Lines:
    """A child's output, read line by line in a thread, so that a test waits for a line (an
    event) rather than for a fixed time."""

    def __init__(self, stream: IO[str]):
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.lines)}")
            if re.search(pattern, line):
                return line


def test_sigterm_answers_the_requests_in_flight_then_exits_0(tiny_model_file: Path, tmp_path):
    port = free_port()
    args = ["serve", "--device", "cpu", "--model", str(tiny_model_file), "--port", str(port)]
    env = {**os.environ, "GRADIO_TEMP_DIR": str(tmp_path / "cache")}
    proc = start_sat([*args, "--examples", "--concurrency", "1"], tmp_path, env=env)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    api = f"http://127.0.0.1:{port}/gradio_api"
    try:
        out.wait_for("Running on local URL")
        with httpx.Client(timeout=120) as web:
            n = len(web.get(api + "/info").json()["named_endpoints"]["/caption"]["parameters"])
            files = {"files": ("photo.jpg", photo(0).read_bytes(), "image/jpeg")}
            (path,) = web.post(api + "/upload", files=files).json()
            image = {"path": path, "orig_name": "photo.jpg", "meta": {"_type": "gradio.FileData"}}
            body = {"data": [image] + [None] * (n - 1)}
            # three requests taken (one captioned at a time: two wait in the queue); their
            # answers wait in the server until each is fetched
            events = [
                web.post(api + "/call/caption", json=body).json()["event_id"] for _ in range(3)
            ]
            proc.send_signal(signal.SIGTERM)
            err.wait_for(r"stopping: finishing 3 request")
            late = web.post(api + "/call/caption", json=body)
            assert late.status_code == 503 and "stopping" in late.json()["error"]
            for event in events:
                answer = web.get(f"{api}/call/caption/{event}").text
                assert "event: complete" in answer and '"caption"' in answer
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(err.lines)
    assert len(re.findall(r"(?m)^INFO: stopping: ", log)) == 1 and "Traceback" not in log
    assert "unanswered" not in log
