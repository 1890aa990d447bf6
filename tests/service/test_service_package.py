"""The service as a package: the example photos it ships, its modules, and the documented
`sat serve` options."""

from __future__ import annotations

import fnmatch
import re

import pytest
from PIL import Image

from showattendtell.cli.main import build_parser

pytest.importorskip("gradio")
from helpers.service import ROOT  # noqa: E402
from showattendtell.service.auth import AUTH_ENV  # noqa: E402
from showattendtell.service.uploads import EXAMPLES_DIR, find_examples  # noqa: E402

MODULES = (
    "worker",
    "uploads",
    "drawing",
    "captioning",
    "events",
    "app",
    "auth",
    "serve",
    "options",
    "cache",
    "login",
    "guard",
    "blocks",
    "http_api",
    "api_guard",
    "metrics",
    "server",
)


def test_example_photos_ship_with_the_package():
    examples = find_examples()
    assert len(examples) >= 3 and all(p.parent == EXAMPLES_DIR.resolve() for p in examples)
    readme = (EXAMPLES_DIR / "README.md").read_text()
    line = next(
        x
        for x in (ROOT / "pyproject.toml").read_text().splitlines()
        if x.startswith('"showattendtell.service" = [')
    )  # package-data (tomllib: 3.11+)
    patterns = re.findall(r'"([^"]+)"', line.split("=", 1)[1])
    for p in examples:
        assert not re.fullmatch(r"\d{12}\.jpg", p.name)  # not the COCO file name
        assert p.stat().st_size < 150_000
        with Image.open(p) as img:
            assert img.format == "JPEG" and 480 <= max(img.size) <= 640
        row = next(line for line in readme.splitlines() if f"`{p.name}`" in line)
        assert re.search(r"\| \d+ \(", row) and "staticflickr.com" in row
        assert "creativecommons.org/licenses/by" in row
        assert any(fnmatch.fnmatch(f"examples/{p.name}", pat) for pat in patterns)
    assert "resized" in readme.lower()
    assert find_examples([]) == []


def test_service_modules():
    import showattendtell.service.app as app_module

    for name in MODULES:
        assert (ROOT / "service" / f"{name}.py").is_file()
    source = (ROOT / "service" / "app.py").read_text()
    assert "MAX_BEAM_SIZE" not in source and "DecompressionBombError" not in source
    assert not hasattr(app_module, "caption_image")  # app.py is the layout only


def test_service_functions_are_short():
    """No function of the service runs over 80 lines (build_app was 120)."""
    import ast

    for name in MODULES:
        tree = ast.parse((ROOT / "service" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{name}.{node.name}: {length} lines"


def serve_docs() -> str:
    """Where users read about `sat serve`: docs/service.md, else the README's section."""
    page = ROOT / "docs" / "service.md"
    if page.is_file():
        return page.read_text()
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Web service", 1)[1].split("\n## ", 1)[0]


def test_docs_describe_existing_serve_options():
    section = serve_docs()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {s for a in serve._actions for s in a.option_strings}
    documented = set(re.findall(r"`(--[a-z-]+)", section))
    assert documented and documented <= known, documented - known
    for option in ("--auth-file", "--beam-size", "--hard-mode", "--model"):
        assert option in documented
    assert AUTH_ENV in section
