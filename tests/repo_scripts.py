"""Loads a script of the repository that is not part of the package (examples/, benchmarks/) as a
module, so tests can call its functions."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_repo_script(relative_path: str) -> ModuleType:
    """The module of ROOT / relative_path (e.g. "benchmarks/ab_compare.py"), executed once per call."""
    path = ROOT / relative_path
    name = "repo_" + relative_path.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
