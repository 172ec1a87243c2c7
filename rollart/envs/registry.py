"""Environment registry: built-in names, or any class by import path (``package.module:Class``)."""

from __future__ import annotations

from typing import Any, Callable

from rollart.envs.base import Env
from rollart.envs.grid import FrozenLake, Sokoban
from rollart.envs.math import ArithmeticMath
from rollart.imports import import_by_path

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
    if ":" not in name:
        raise UnknownEnvError(f"unknown env {name!r}: use one of {sorted(BUILTIN_ENVS)} or 'package.module:Class'")
    try:
        return import_by_path(name, "env")
    except ValueError as exc:
        raise UnknownEnvError(str(exc)) from None


def make_env(name: str, kwargs: dict[str, Any] | None = None) -> Env:
    env = resolve_env_class(name)(**(kwargs or {}))
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise UnknownEnvError(f"env {name!r} has no async {method}()")
    return env
