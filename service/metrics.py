"""What `sat serve` exposes at ``GET /metrics``, in Prometheus' text format.

prometheus-client writes the format and keeps the counters thread-safe (the worker thread counts
batches and captions, the server's event loop counts requests), so nothing here formats text.
Each server has a registry of its own: two servers in one process (the tests) never share counts.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from showattendtell.captioning.captioner import CaptionResult

from .worker import CaptionService

# request latency buckets in seconds: a tiny model on a GPU answers in milliseconds, a beam of
# 20 over 32 photos on 2 CPU cores in tens of seconds
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    """The service's counters, fed by the HTTP middleware (requests) and by the worker's
    listeners (batches, captions, warnings: the page's photos and the API's alike)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service: CaptionService, concurrency: int | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sat_http_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "sat_http_request_duration_seconds",
            "Time from a request's arrival to its answer, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "sat_batch_size",
            "Photos captioned together in one batch by the worker",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "sat_queue_depth", "Photos waiting for the captioning worker", registry=r
        )
        self.queue_depth.set_function(lambda: service.queue_depth)
        # the limits in force (`sat serve` decides their defaults by device): what a batch
        # size or a queue depth is measured against
        self.max_batch = Gauge(
            "sat_max_batch", "Most photos captioned as one batch (--max-batch)", registry=r
        )
        self.max_batch.set_function(lambda: service.max_batch)
        if concurrency is not None:
            self.concurrency = Gauge(
                "sat_concurrency",
                "Requests worked on at once by the HTTP API (--concurrency)",
                registry=r,
            )
            self.concurrency.set(concurrency)
        self.photos = Counter("sat_photos_captioned", "Photos captioned", registry=r)
        self.warnings = Counter(
            "sat_warnings",
            "Captions given with a warning (an unfamiliar or degenerate photo, an unsure caption)",
            registry=r,
        )
        self.service = service
        service.on_batch.append(self.batch_size.observe)
        service.on_caption.append(self.captioned)

    def close(self) -> None:
        """Stop counting the service's batches and captions (its server has stopped). Closing
        again does nothing: `sat serve`'s stop closes the server, and so may its owner."""
        for listeners, listener in (
            (self.service.on_batch, self.batch_size.observe),
            (self.service.on_caption, self.captioned),
        ):
            if listener in listeners:
                listeners.remove(listener)

    def captioned(self, result: CaptionResult) -> None:
        self.photos.inc()
        if result.warning:
            self.warnings.inc()

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
