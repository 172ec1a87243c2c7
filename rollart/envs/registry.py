"""Environment registry: built-in names, or any class by import path (``package.module:Class``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from rollart.envs.base import Env
from rollart.envs.grid import FrozenLake, Sokoban
from rollart.envs.math import ArithmeticMath

BUILTIN_ENVS: dict[str, Callable[..., Env]] = {
    "frozenlake": FrozenLake,
    "sokoban": Sokoban,
    "math": ArithmeticMath,
}


class UnknownEnvError(ValueError):
    pass


def resolve_env_class(name: str) -> Callable[..., Env]:
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name]
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise UnknownEnvError(f"unknown env {name!r}: use one of {sorted(BUILTIN_ENVS)} or 'package.module:Class'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownEnvError(f"cannot import env {name!r}: {exc}") from None


def make_env(name: str, kwargs: dict[str, Any] | None = None) -> Env:
    env = resolve_env_class(name)(**(kwargs or {}))
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise UnknownEnvError(f"env {name!r} has no async {method}()")
    return env
