"""A loopback HTTP endpoint for local reward functions (benchmarks, chaos runs)."""

from __future__ import annotations

from aiohttp import web

from rollart.local.stack import free_port


async def serve_post(handler, path: str = "/score") -> tuple[web.AppRunner, str]:
    """Serve ``handler`` for POST ``path`` on a free loopback port; returns (runner, URL)."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}{path}"
