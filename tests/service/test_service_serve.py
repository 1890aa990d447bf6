"""`sat serve` (service/serve.py, service/auth.py): options, models, logins, the busy port, and
the decoding flags made from decoding.py's option table."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
from PIL import Image

from showattendtell.captioning.catalog import BUNDLED_DIR, ModelNotFound
from showattendtell.cli.main import build_parser, main
from showattendtell.search.decoding import DECODING_OPTIONS

pytest.importorskip("gradio")
from helpers.service import ROOT  # noqa: E402
from showattendtell.service.auth import (  # noqa: E402
    AUTH_ENV,
    AuthError,
    exposure_warning,
    read_auth,
)
from showattendtell.service.capacity import (  # noqa: E402
    CPU,
    GPU,
    Capacity,
    gradio_threads,
    resolve_capacity,
)
from showattendtell.service.worker import load_service, model_paths  # noqa: E402

needs_bundled = pytest.mark.skipif(
    not (BUNDLED_DIR / "flickr8k_lite2_hard.safetensors").is_file(),
    reason="bundled model flickr8k_lite2_hard not installed",
)


def subparser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def serve_on_cpu(*args: str) -> int:
    """`sat serve --device cpu ARGS`'s exit code (the tests that serve patch launch first)."""
    return main(["serve", "--device", "cpu", *args])


def test_serve_cli_defaults_are_safe():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.device) == ("127.0.0.1", 7860, "auto")
    assert args.max_upload_mb > 0 and args.func.__module__ == "showattendtell.service.serve"
    assert args.auth_file is None
    assert args.cache_mb > 0 and args.cache_hours > 0 and args.session_minutes > 0
    # the decoding options of `sat caption`, each None: the model's stored value
    assert all(getattr(args, name) is None for name in DECODING_OPTIONS)


def test_decoding_flags_come_from_the_option_table():
    """Every DecodingConfig field is a flag of every command that decodes, with its help text;
    the table, not a list in the CLI, decides (an option added to it appears everywhere)."""
    for command in ("caption", "evaluate", "serve", "export"):
        actions = {a.dest: a for a in subparser(command)._actions}
        for name, opt in DECODING_OPTIONS.items():
            assert actions[name].option_strings == [opt.flag], (command, name)
            assert actions[name].help == opt.help and actions[name].default is None


def test_a_new_option_in_the_table_reaches_the_cli(monkeypatch):
    from dataclasses import replace

    from showattendtell.cli.common import add_decoding_args

    extra = replace(DECODING_OPTIONS["beam_size"], name="top_k", label="top k", help="k words")
    monkeypatch.setitem(DECODING_OPTIONS, "top_k", extra)  # the one table, wherever it is read
    import argparse

    p = argparse.ArgumentParser()
    add_decoding_args(p)
    assert p.parse_args(["--top-k", "4"]).top_k == 4


def test_model_option_is_declared_once():
    """--model comes from cli_common.add_model_arg everywhere: one help text, and only
    `sat serve` takes it more than once (its model menu)."""
    sources = [ROOT / "service" / "serve.py", *(ROOT / "src/showattendtell/commands").glob("*.py")]
    for path in sources:
        assert '"--model"' not in path.read_text(), path.name
    helps = {
        c: next(a.help for a in subparser(c)._actions if a.dest == "model")
        for c in ("caption", "evaluate", "serve")
    }
    assert helps["caption"] == helps["evaluate"] and helps["serve"].startswith(helps["caption"])
    assert build_parser().parse_args(["serve", "--model", "a", "--model", "b"]).model == ["a", "b"]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--beam-size", "0"], "beam size"),
        (["--max-length", "500"], "maximum length"),
        (["--hard-mode", "best"], "hard-attention mode"),
        (["--length-penalty", "nan"], "length penalty"),
        (["--no-repeat-ngram", "-1"], "no-repeat"),
        (["--cache-mb", "-1"], "--cache-mb"),
        (["--session-minutes", "0"], "--session-minutes"),
        (["--max-sessions", "0"], "--max-sessions"),
        (["--concurrency", "0"], "--concurrency must be at least 1, not 0"),
        (["--max-batch", "-3"], "--max-batch must be at least 1, not -3"),
        (["--queue-size", "0"], "--queue-size must be at least 1, not 0"),
        (["--host", "::1"], "--host ::1: IPv6 addresses are not supported"),
        (["--port", "70000"], "--port"),
    ],
)
def test_serve_bad_option_exits_2_before_loading(option, message, monkeypatch, capsys):
    def must_not_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("showattendtell.service.worker.load_service", must_not_load)
    assert main(["serve", *option]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_busy_port_says_port_in_one_line(monkeypatch, capsys):
    """A second `sat serve` on a taken port: one line naming --port N, before any model loads,
    never Gradio's advice about GRADIO_SERVER_PORT."""

    def must_not_load(*a, **k):
        raise AssertionError("a model was loaded although the port is taken")

    monkeypatch.setattr("showattendtell.service.worker.load_service", must_not_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert f"port {port}" in err and "--port N" in err and "GRADIO_SERVER_PORT" not in err


def test_busy_port_when_the_server_finds_it_taken(tiny_model_file, monkeypatch, capsys):
    """The port taken while the models loaded: binding it fails, and says so in the same one
    line."""
    port = _free()
    monkeypatch.setattr("showattendtell.service.server.build", lambda *a: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        monkeypatch.setattr("showattendtell.service.serve.check_port", lambda host, port: None)
        assert serve_on_cpu("--model", str(tiny_model_file), "--port", str(port)) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if not line.startswith("INFO: ")]
    assert f"port {port}" in line and "--port N" in line and line.startswith("error: ")


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_second_sat_serve_on_a_busy_port(tmp_path):
    """The real command, as a user runs it twice."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "showattendtell.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert re.fullmatch(
        rf"error: port {port} on 127\.0\.0\.1 is already in use .*--port N.*\n", run.stderr
    )


def _fake_launch(monkeypatch, load: bool = True) -> dict:
    """Patch the server: `sat serve` loads its models and returns instead of serving.
    ``load=False``: the models are not loaded either (a test of what reaches the server's
    settings, which no model changes); ``seen["loaded"]`` has what they would be loaded with."""
    seen: dict = {}

    class Unloaded:
        captioners: dict = {}

        def __init__(self, device: str) -> None:
            self.device = device  # where the models would be: --device, as given

        def close(self) -> None:
            seen["service_closed"] = True

    def load_service(paths, device, **kwargs):
        seen["loaded"] = (paths, device, kwargs)
        return Unloaded(device)

    if not load:
        monkeypatch.setattr("showattendtell.service.worker.load_service", load_service)
    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)  # `sat serve` sets it: unset after

    class Stopped:
        """A server that has ended: `sat serve` closes it and returns."""

        is_running = False
        url = "http://127.0.0.1:0"

        def __init__(self, app, host, port):
            seen.update(app=app, host=host, port=port)

        def close(self) -> None:
            seen["closed"] = True

    def build(service, settings, page, guard):
        seen.update(
            service=service,
            settings=settings,
            page=page,
            guard=guard,
            auth=settings.auth,
            decoding={n: c.decoding for n, c in service.captioners.items()},
        )
        if page is not None:
            seen.update(
                examples=page.examples,
                cache=page.cache,
                session_minutes=page.session_minutes,
                max_sessions=page.max_sessions,
            )
        return "app"

    monkeypatch.setattr("showattendtell.service.server.build", build)
    monkeypatch.setattr("showattendtell.service.server.Background", Stopped)
    monkeypatch.setattr("showattendtell.service.serve.check_port", lambda host, port: None)
    return seen


def test_serve_api_options(tiny_model_file, monkeypatch):
    """The HTTP API gets the page's limits and login; --api-only serves it without the page."""
    seen = _fake_launch(monkeypatch, load=False)
    monkeypatch.setenv(AUTH_ENV, "alice:pw")
    base = ["--model", str(tiny_model_file), "--max-upload-mb", "2", "--concurrency", "3"]
    assert serve_on_cpu(*base, "--max-images", "5", "--queue-size", "9") == 0
    s = seen["settings"]
    assert (s.max_upload_bytes, s.max_images, s.concurrency, s.queue_size) == (2 * 2**20, 5, 3, 9)
    assert s.auth == [("alice", "pw")] and seen["page"] is not None and seen["app"] == "app"
    assert seen["closed"] and seen["service_closed"]  # the server stopped, then the service
    assert seen["loaded"][:2] == ([str(tiny_model_file)], "cpu")
    assert serve_on_cpu(*base, "--api-only") == 0
    assert seen["page"] is None
    assert main(["serve", "--max-images", "0"]) == 2


def test_serve_decoding_options_become_every_models_defaults(
    tiny_model_file,
    tiny_expected_file,
    monkeypatch,
):
    seen = _fake_launch(monkeypatch)
    models = ["--model", str(tiny_model_file), "--model", str(tiny_expected_file)]
    assert serve_on_cpu(*models, "--beam-size", "1", "--max-length", "5") == 0
    soft, hard = seen["decoding"].values()
    assert (soft.beam_size, soft.max_length) == (hard.beam_size, hard.max_length) == (1, 5)
    assert hard.hard_mode == "expectation"  # not given: the model's stored value
    assert serve_on_cpu("--model", str(tiny_expected_file), "--hard-mode", "sample") == 0
    (hard,) = seen["decoding"].values()
    assert hard.hard_mode == "sample" and hard.beam_size == 3  # 3: stored


def test_serve_passes_the_cache_and_session_bounds(tiny_model_file, monkeypatch):
    seen = _fake_launch(monkeypatch, load=False)
    bounds = ["--cache-mb", "5", "--cache-hours", "0", "--session-minutes", "10"]
    assert serve_on_cpu("--model", str(tiny_model_file), *bounds, "--max-sessions", "7") == 0
    assert seen["cache"].max_bytes == 5 * 2**20 and seen["cache"].max_age_s is None
    assert (seen["session_minutes"], seen["max_sessions"]) == (10, 7)


def test_serve_model_names(capsys):
    assert main(["serve", "--model", "no_such_model"]) == 2
    err = capsys.readouterr().err
    assert "no model of that name" in err and err.count("\n") == 1
    with pytest.raises(ModelNotFound):
        model_paths(["no_such_model"])


@needs_bundled
def test_an_unknown_model_is_said_before_the_service_is_imported():
    """`sat serve --model nope`: the one line at once, without importing torch or Gradio."""
    probe = (
        "import sys\n"
        "from showattendtell.cli.main import main\n"
        "code = main(['serve', '--model', 'nope'])\n"
        "print(code, sorted(m for m in ('torch', 'gradio') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split("\n")[-2] == "2 []", done.stdout + done.stderr
    assert done.stderr.startswith("error: --model nope: ") and done.stderr.count("\n") == 1


def test_serve_bundled_model_by_name(monkeypatch):
    hard = BUNDLED_DIR / "flickr8k_lite2_hard.safetensors"
    assert model_paths(["flickr8k_lite2_hard"]) == [[hard]]
    assert model_paths(["flickr8k_lite2_soft+flickr8k_lite2_hard"]) == [
        [BUNDLED_DIR / "flickr8k_lite2_soft.safetensors", hard]
    ]
    seen = _fake_launch(monkeypatch)
    assert serve_on_cpu("--model", "flickr8k_lite2_hard") == 0
    assert list(seen["decoding"]) == ["flickr8k_lite2_hard"]
    assert seen["decoding"]["flickr8k_lite2_hard"].hard_mode == "argmax"  # stored


def test_serve_warns_without_login_beyond_localhost(tiny_model_file, tmp_path, monkeypatch, capsys):
    seen = _fake_launch(monkeypatch, load=False)
    monkeypatch.delenv(AUTH_ENV, raising=False)
    base = ["--model", str(tiny_model_file), "--port", str(_free())]
    assert serve_on_cpu(*base, "--host", "0.0.0.0") == 0
    assert "warning: serving on 0.0.0.0 without a login" in capsys.readouterr().err
    assert seen["auth"] is None
    assert serve_on_cpu(*base) == 0  # 127.0.0.1: no warning
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setenv(AUTH_ENV, "alice:pa ss:word")
    assert serve_on_cpu(*base, "--host", "0.0.0.0") == 0
    assert "warning" not in capsys.readouterr().err
    assert seen["auth"] == [("alice", "pa ss:word")]
    monkeypatch.delenv(AUTH_ENV)
    creds = tmp_path / "logins"
    creds.write_text("# users\nbob:hunter2\n\ncarol:x\n")
    assert serve_on_cpu(*base, "--host", "0.0.0.0", "--auth-file", str(creds)) == 0
    assert seen["auth"] == [("bob", "hunter2"), ("carol", "x")]
    assert serve_on_cpu(*base, "--auth-file", str(tmp_path / "missing")) == 2
    assert "cannot read --auth-file" in capsys.readouterr().err


def test_auth_settings():
    assert read_auth(None, {}) is None
    assert read_auth(None, {AUTH_ENV: "u:p"}) == [("u", "p")]
    for bad in ("nopassword", "user:", ":pw", "two words:pw"):
        with pytest.raises(AuthError, match="expected user:password") as e:
            read_auth(None, {AUTH_ENV: bad})
        assert "pw" not in str(e.value)  # a password is never echoed
    assert exposure_warning("0.0.0.0", None) and exposure_warning("example.org", None)
    assert exposure_warning("0.0.0.0", [("u", "p")]) is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(host, None) is None


def test_serve_takes_the_precision_option(tiny_model_file):
    """`sat serve --precision` reaches every loaded model (bf16 autocast works on a CPU too)."""
    args = build_parser().parse_args(["serve", "--precision", "bf16"])
    assert args.precision == "bf16"
    service = load_service([tiny_model_file], "cpu", precision="bf16")
    try:
        assert all(c.autocast is not None for c in service.captioners.values())
        assert service.caption(Image.new("RGB", (64, 64), (200, 30, 30))).words
    finally:
        service.close()


def test_capacity_defaults_are_decided_by_the_device():
    """64 requests at once, batches of 64 and 2 torch threads on a GPU; 8, 8 and torch's own on
    the CPU; told by the device's name alone (no CUDA call); a value given always wins."""
    assert resolve_capacity("cpu") == CPU == Capacity(8, 8, None)
    for gpu in ("cuda", "cuda:0", "cuda:3"):
        assert resolve_capacity(gpu) == GPU == Capacity(64, 64, 2)
    assert resolve_capacity("cuda:0", concurrency=3) == Capacity(3, 64, 2)
    assert resolve_capacity("cuda", max_batch=1, threads=16) == Capacity(64, 1, 16)
    assert resolve_capacity("cpu", concurrency=100, max_batch=32, threads=1) == Capacity(100, 32, 1)
    # the page's thread pool: Gradio's 40 while enough, else room for twice the captions
    assert gradio_threads(8) == 40 and gradio_threads(64) == 128


def test_serve_capacity_flags_default_to_the_device(tiny_model_file, monkeypatch):
    """--concurrency, --max-batch and --threads are None in the parser and decided once the
    models are loaded, by their device: a (fake) GPU service gets 64 / 64 / 2 torch threads,
    the CPU 8 / 8 and torch's threads untouched; a flag given wins on either."""
    import torch

    args = build_parser().parse_args(["serve"])
    assert (args.concurrency, args.max_batch, args.threads) == (None, None, None)
    helps = {a.dest: a.help for a in subparser("serve")._actions}
    assert "64 on a GPU, 8 on the CPU" in helps["concurrency"]
    assert "64 on a GPU, 8 on the CPU" in helps["max_batch"]
    seen = _fake_launch(monkeypatch, load=False)
    before = torch.get_num_threads()
    model = ["--model", str(tiny_model_file), "--examples"]
    try:
        assert main(["serve", "--device", "cuda", *model]) == 0
        assert seen["loaded"][2]["max_batch"] is None  # load_service: the device's default
        assert seen["settings"].concurrency == 64 and torch.get_num_threads() == 2
        torch.set_num_threads(before)
        flags = ["--concurrency", "5", "--max-batch", "7", "--threads", "1"]
        assert main(["serve", "--device", "cuda:1", *model, *flags]) == 0
        assert seen["loaded"][2]["max_batch"] == 7
        assert seen["settings"].concurrency == 5 and torch.get_num_threads() == 1
        torch.set_num_threads(before)
        assert serve_on_cpu(*model) == 0
        assert seen["settings"].concurrency == 8 and torch.get_num_threads() == before
        assert serve_on_cpu(*model, "--threads", "0") == 2  # checked before anything loads
    finally:
        torch.set_num_threads(before)


def test_load_service_takes_the_batch_of_its_device(tiny_model_file):
    service = load_service([tiny_model_file], "cpu")
    try:
        assert service.device == "cpu" and service.max_batch == CPU.max_batch
    finally:
        service.close()
    service = load_service([tiny_model_file], "cpu", max_batch=3)
    try:
        assert service.max_batch == 3
    finally:
        service.close()


def test_the_page_thread_pool_follows_the_concurrency(service):
    """Gradio's queue and thread pool take every request --concurrency lets in: with 64 at
    once, 128 threads (each caption also pre- and postprocesses in the pool), not Gradio's 40."""
    from showattendtell.service.app import prepare

    for concurrency, threads in ((8, 40), (64, 128)):
        app = prepare(service, concurrency=concurrency)
        try:
            assert app.max_threads == threads
            assert app._queue.max_thread_count == threads  # the queue's slots for running events
        finally:
            service.cache.stop()
