"""Prometheus metrics shared by every process, named ``rollart_<stage>_<thing>_<unit>``.

The bus layer's metrics live under the stage name ``bus`` and carry the consumer ``group`` and
``topic`` (the logical name, so dashboards work across jobs; ``job`` is a label too). Each process
serves ``/metrics`` on ``metrics.port`` when configured.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from rollart.health import HEALTH, Health

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

BUS_LABELS = ("job", "group", "topic")

MESSAGES_PROCESSED = Counter(
    "rollart_bus_messages_processed_total", "Messages whose handler finished and whose output was acknowledged",
    BUS_LABELS)
MESSAGES_FAILED = Counter(
    "rollart_bus_messages_failed_total", "Handler attempts or decodes that failed, by reason",
    (*BUS_LABELS, "reason"))
MESSAGES_DEAD_LETTERED = Counter(
    "rollart_bus_messages_dead_lettered_total", "Messages sent to the topic's DLQ", BUS_LABELS)
MESSAGES_DEDUPLICATED = Counter(
    "rollart_bus_messages_deduplicated_total", "Messages skipped because their id was already processed",
    BUS_LABELS)
HANDLER_LATENCY = Histogram(
    "rollart_bus_handler_latency_seconds", "Time from dispatch to done (handler plus output acks)",
    BUS_LABELS, buckets=_LATENCY_BUCKETS)
CONSUMER_LAG = Gauge(
    "rollart_bus_consumer_lag_messages", "Log end offset minus committed offset",
    (*BUS_LABELS, "partition"))
IN_FLIGHT = Gauge(
    "rollart_bus_in_flight_messages", "Messages dispatched to handlers and not yet done", ("job", "group"))
PAUSED = Gauge(
    "rollart_bus_paused", "1 while the consumer has paused its partitions for backpressure", ("job", "group"))
PRODUCED = Counter(
    "rollart_bus_messages_produced_total", "Messages acknowledged by the broker", ("job", "topic"))
LOOP_PROGRESS = Gauge(
    "rollart_bus_last_poll_timestamp_seconds", "Unix time of the consumer loop's last poll (liveness)",
    ("job", "group"))


def serve_metrics(port: int, host: str = "0.0.0.0", health: Health = HEALTH) -> int:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` (see rollart.health) in a background thread;
    returns the bound port (``port=0``: any free port)."""
    metrics_app = make_wsgi_app()

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path in ("/healthz", "/readyz"):
            verdict = health.liveness() if path == "/healthz" else health.readiness()
            start_response("200 OK" if verdict.ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [verdict.detail.encode() + b"\n"]
        return metrics_app(environ, start_response)

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
    return server.server_address[1]
