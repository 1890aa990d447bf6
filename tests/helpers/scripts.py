"""Python files outside the package loaded as modules: the scripts in scripts/ (no package)
and hubconf.py, for the tests of their functions and main()."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_file(path: Path) -> ModuleType:
    """The Python file at ``path`` as a module named after it, loaded afresh (its top level runs
    again; it is not put in sys.modules)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module."""
    return load_file(REPO / "scripts" / f"{name}.py")
