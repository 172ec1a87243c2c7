"""A toy stage for the registry test: what adding a stage takes (a runner and one registry entry)."""

from __future__ import annotations

RAN: list[str] = []


async def run_toy(config, stop) -> None:
    RAN.append(config.job)


async def run_toy_crashing_at_teardown(config, stop) -> None:
    """A member whose work ends cleanly but whose process would crash in the interpreter's teardown,
    as a native library's destructor can (an atexit handler stands in for it)."""
    import atexit
    import os
    import signal

    atexit.register(os.kill, os.getpid(), signal.SIGSEGV)
    print(f"toy member of {config.job} stopped", flush=True)
