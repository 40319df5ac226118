"""Package attributes imported on first use (PEP 562), so that importing a package does not
import torch until one of its torch-backed names is used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_attributes(package: str, exports: dict[str, str], subpackages: tuple[str, ...] = ()) -> Callable:
    """A module ``__getattr__`` for ``package``: ``exports`` maps a public name to the module
    defining it (imported, then cached on the package); ``subpackages`` are imported by name."""

    def __getattr__(name: str):
        if name in subpackages:
            return importlib.import_module(f"{package}.{name}")
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    return __getattr__
