"""Environments: the interface, built-ins (FrozenLake, Sokoban, math), a registry, fault injection."""

from rollart.envs.base import FORMAT_PENALTY, Env, StepResult, TextEnv
from rollart.envs.faults import EnvFailure, FaultSpec, FaultyEnv, Latency
from rollart.envs.grid import FrozenLake, Sokoban
from rollart.envs.math import ArithmeticMath
from rollart.envs.registry import BUILTIN_ENVS, UnknownEnvError, make_env, resolve_env_class

__all__ = [
    "ArithmeticMath", "BUILTIN_ENVS", "Env", "EnvFailure", "FORMAT_PENALTY", "FaultSpec", "FaultyEnv", "FrozenLake",
    "Latency", "Sokoban", "StepResult", "TextEnv", "UnknownEnvError", "make_env", "resolve_env_class",
]
