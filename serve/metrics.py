"""Request metrics through Ray's metrics API, so the Ray dashboard (Metrics tab, Grafana) and Prometheus show them
next to Serve's own per-deployment numbers. Exported names get Ray's `ray_` prefix, e.g.
`ray_medray_serve_requests_total`."""
from __future__ import annotations

from functools import cache

LATENCY_BOUNDARIES_S = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]


class ServeMetrics:
    def __init__(self):
        from ray.util.metrics import Counter, Histogram

        self.requests = Counter("medray_serve_requests", "HTTP requests by route and status code",
                                tag_keys=("route", "status"))
        self.latency = Histogram("medray_serve_request_seconds", "seconds from request to last token",
                                 boundaries=LATENCY_BOUNDARIES_S, tag_keys=("mode", "stream"))
        self.tokens = Counter("medray_serve_tokens", "prompt and completion tokens", tag_keys=("kind", "mode"))
        self.retrievals = Counter("medray_serve_agent_retrievals",
                                  "agent-mode environment calls (retrievals; tool calls for a tool policy) by outcome",
                                  tag_keys=("outcome",))

    def request(self, route: str, status: int) -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status)})

    def finished(self, mode: str, stream: bool, seconds: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.latency.observe(seconds, tags={"mode": mode, "stream": str(stream).lower()})
        for kind, count in (("prompt", prompt_tokens), ("completion", completion_tokens)):
            if count:  # Ray counters take positive increments only
                self.tokens.inc(count, tags={"kind": kind, "mode": mode})

    def agent_turns(self, turns: list[dict]) -> None:
        for turn in turns:
            self.retrievals.inc(1, tags={"outcome": "error" if turn["error"] else "ok"})


@cache
def serve_metrics() -> ServeMetrics:
    """This process's metrics (created on first use, inside a replica that is connected to Ray)."""
    return ServeMetrics()
