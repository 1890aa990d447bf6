"""The service benchmarks' shared start-up (benchmarks/service_latency.py, imported by
service_soak.py): a server that stops before its API answers ends the run with its own words."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("gradio_client")
from benchmarks.service_latency import wait_for_api  # noqa: E402


def test_a_server_that_stops_first_ends_the_run_with_the_end_of_its_log():
    with tempfile.TemporaryFile("w+") as log:
        script = "import sys; print('starting'); sys.exit('error: --model m: no such file')"
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, text=True
        )
        proc.wait(60)
        with pytest.raises(SystemExit) as e:
            wait_for_api(proc, "http://127.0.0.1:9/", log, timeout=60)
    message = str(e.value)
    assert message.startswith("sat serve exited:") and "error: --model m: no such file" in message
