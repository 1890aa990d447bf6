"""What the README says can be run, runs: every `sat` command line in its code blocks parses with
the current command line, and its lists of commands and options match the parsers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from showattendtell.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_block_commands() -> list[str]:
    commands = []
    for block in re.findall(r"```(?:bash|console)\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            line = re.split(r"\s+#", line)[0].strip()
            if line.startswith("sat "):
                commands.append(line)
    return commands


def subparsers() -> dict:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_the_readme_has_sat_commands():
    assert len(code_block_commands()) >= 20


@pytest.mark.parametrize("command", code_block_commands())
def test_every_readme_command_parses(command, monkeypatch):
    argv = shlex.split(command)[1:]
    monkeypatch.chdir(ROOT)  # configs/... are relative to the repository
    if argv[0] in ("train", "features"):
        from showattendtell.commands.train import build_cli

        with pytest.raises(SystemExit) as e:  # --print_config parses, prints and exits
            build_cli([*argv[1:], "--print_config"])
        assert e.value.code in (0, None), command
        return
    build_parser().parse_args(argv)  # a bad option would exit 2 here


def test_the_commands_table_lists_every_subcommand():
    table = README.split("<!-- section: commands -->", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `sat (\w+)", table, re.M))
    assert documented == set(subparsers())


@pytest.mark.parametrize("name", ["caption", "evaluate", "serve"])
def test_commands_that_read_a_model_take_the_documented_options(name):
    options = {o for a in subparsers()[name]._actions for o in a.option_strings}
    for option in ("--model", "--device", "--precision", "--beam-size", "--max-length",
                   "--length-penalty", "--no-repeat-ngram", "--hard-mode"):
        assert option in options, (name, option)


def test_export_stores_the_decoding_options():
    options = {o for a in subparsers()["export"]._actions for o in a.option_strings}
    assert {"--beam-size", "--hard-mode", "--interpolate", "--alpha", "--half"} <= options


def test_tiny_config_needs_a_data_root_and_says_so():
    assert "configs/tiny.yaml --data.root" in README
    assert "--data.root" in (ROOT / "configs" / "tiny.yaml").read_text()


def test_layout_names_every_module():
    layout = README.split("<!-- section: layout -->", 1)[1]
    package = ROOT / "src" / "showattendtell"
    for f in [*package.glob("*.py"), *package.glob("commands/*.py")]:
        if f.stem != "__init__":
            assert f.name in layout, f.name
