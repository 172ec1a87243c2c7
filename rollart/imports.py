"""Objects named by import path, ``package.module:attr`` (custom envs, reward functions)."""

from __future__ import annotations

import importlib
from typing import Any


def import_by_path(path: str, what: str) -> Any:
    """The object ``attr`` (dotted: ``Class.method`` too) of ``package.module``; ValueError naming
    ``what`` and the path when the path is malformed or the import fails."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r}: expected 'package.module:name'")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {what} {path!r}: {exc}") from None
    return obj
