"""Optional dependencies: the error that names the extra of jax_fp4 bringing a missing one."""

from __future__ import annotations

import importlib


def missing_extra(needed: str, extra: str, user: str) -> ModuleNotFoundError:
    """The error for an optional dependency `needed` that is not installed: which extra of
    jax_fp4 brings it, as the pip command."""
    return ModuleNotFoundError(
        f"{user} needs {needed}, which comes with jax_fp4's optional extra {extra!r}: "
        f"pip install 'jax_fp4[{extra}]'",
        name=needed,
    )


def import_extra(module: str, extra: str, user: str):
    """`importlib.import_module(module)`, or missing_extra's error where its package is absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.split(".")[0]:
            raise
        raise missing_extra(err.name, extra, user) from err
