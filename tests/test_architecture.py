"""The floor plan (docs/architecture.md): the package's wings import downwards only, without
cycles, and a function-local import of the project's own modules is the exception, named here
with its reason. Read with ``ast`` from the sources, so a type-only import counts too."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "showattendtell"
SERVICE = ROOT / "service"

# Low to high: a module may import its own wing and any lower one, never a higher one.
RANKS = {
    "errors": 0,
    "progress": 0,
    "outputs": 0,
    "torch_files": 0,
    "registry": 0,
    "kernels": 1,
    "network": 2,
    "search": 3,
    "evaluation": 3,
    "model": 4,
    "ensemble": 4,
    "model_file": 4,
    "images": 5,
    "data": 6,
    "captioning": 7,
    "training": 7,
    "cli": 8,
    "service": 8,
}

# Function-local imports of the project's own modules, each kept for start-up time: the CLI's
# parsers import no torch (`sat --help`), and each subcommand's `run` imports its job once.
LOCAL_IMPORTS_ALLOWED = {
    "showattendtell": "the package's lazy public API: `import showattendtell` stays torch-free",
    "showattendtell.kernels.gpu_kernels": "Triton is imported only on a GPU that runs it",
    "showattendtell.captioning.catalog": "names models torch-free (`sat models`, `sat serve`'s "
    "checks); describing a model file's contents needs the model file reader",
    "showattendtell.cli.main": "each subcommand's module is imported when it runs",
    "showattendtell.cli.models": "its run imports the model file reader",
    "showattendtell.cli.export_job": "Lightning (seconds to import) only to read a training "
    "checkpoint: re-exporting a model file never imports it",
    "showattendtell.service.serve": "its run imports the app once the checks passed",
    "showattendtell.service.server": "the page (Gradio) is imported only when it is served: "
    "`sat serve --api-only` never imports Gradio",
    "showattendtell.cli.train_checks": "`sat train`'s checks run before Lightning is imported",
}

# A subcommand split into a torch-free parser and its job: the parser's function-local imports
# of the project are its job modules, and nothing else (its checks import at the top).
JOBS = {
    "showattendtell.cli.caption": {
        "showattendtell.cli.caption_job",
        "showattendtell.cli.caption_ray",
    },
    "showattendtell.cli.evaluate": {"showattendtell.cli.evaluate_job"},
    "showattendtell.cli.export": {"showattendtell.cli.export_job"},
}


def modules() -> dict[str, Path]:
    found = {}
    for base, prefix in ((PACKAGE, "showattendtell"), (SERVICE, "showattendtell.service")):
        for path in base.rglob("*.py"):
            if PACKAGE / "service" in path.parents:  # a development symlink to service/
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


MODULES = modules()


def imported(name: str, node: ast.Import | ast.ImportFrom, path: Path) -> set[str]:
    """The project modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        candidates = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        candidates = [base] + [f"{base}.{a.name}" for a in node.names]
    out = set()
    for c in candidates:
        while c and c not in MODULES:
            c = c.rpartition(".")[0]
        if c and c != name and c != "showattendtell":
            out.add(c)
    return out


@functools.cache
def graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(module: the modules it imports, module: its function-local project imports)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    local: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        in_functions = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = imported(name, node, path)
                edges[name] |= targets
                if targets and id(node) in in_functions:
                    local.setdefault(name, []).extend(sorted(targets))
    return edges, local


def rank(module: str) -> int:
    part = module.split(".")[1]
    assert part in RANKS, f"{module}: a new wing or root module needs its rank in RANKS"
    return RANKS[part]


def test_every_module_has_a_rank():
    for name in MODULES:
        if name != "showattendtell":
            rank(name)


def test_no_import_runs_upwards():
    edges, _ = graph()
    upwards = [
        f"{a} -> {b}"
        for a, targets in edges.items()
        if a != "showattendtell"
        for b in targets
        if rank(b) > rank(a)
    ]
    assert upwards == []


def test_no_import_cycles():
    edges, _ = graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_the_public_api_imports_nothing_from_the_cli():
    edges, _ = graph()
    public = [m for m in edges if m.startswith("showattendtell.captioning")]
    assert public and all(not t.startswith("showattendtell.cli") for m in public for t in edges[m])


def test_function_local_imports_of_the_project_are_the_named_exceptions():
    _, local = graph()
    named = LOCAL_IMPORTS_ALLOWED.keys() | JOBS.keys()
    unexpected = {m: t for m, t in local.items() if m not in named}
    assert unexpected == {}, "import these at the top, or name the reason in this test"


@pytest.mark.parametrize("parser", sorted(JOBS))
def test_a_parser_imports_its_job_and_nothing_else_in_a_function(parser):
    _, local = graph()
    jobs = JOBS[parser]
    packages = {job.rpartition(".")[0] for job in jobs}  # `from showattendtell.cli import job`
    assert set(local.get(parser, ())) - packages == jobs


@pytest.mark.parametrize("module", sorted(LOCAL_IMPORTS_ALLOWED))
def test_every_named_exception_still_exists(module):
    _, local = graph()
    assert module in local, f"{module} has no local import now: take it off the list"
