"""The server's Prometheus metrics (prometheus_client), one registry per app.

Request metrics are counted by the app as requests pass. What the device did is read from the sessions
at scrape time (``compiled_executables()``: each executable's compiled shapes, the device steps it ran,
where it came from, the engine reloads it caused), so the figures are the runtime's own and nothing is
counted twice. Computed tokens are each executable's compiled ``input_ids`` elements times its steps;
real tokens are the tokens the requests brought; their ratio is the batch fill.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "optimum_ipu"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def device_counters(sessions: Sequence[Any]) -> dict[str, Any]:
    """The sessions' device steps, computed tokens, switches, and executables by source."""
    steps = computed = switches = 0
    sources: dict[str, int] = {}
    for session in sessions:
        for entry in session.compiled_executables():
            calls = int(entry.get("calls", 0))
            steps += calls
            shape = entry["shapes"].get("input_ids")
            if shape is not None:
                computed += math.prod(shape) * calls
            switches += int(entry.get("switches", 0))
            sources[str(entry.get("source"))] = sources.get(str(entry.get("source")), 0) + 1
    return {"device_steps": steps, "computed_tokens": computed, "switches": switches, "sources": sources}


class _SessionCollector(Collector):
    def __init__(self, sessions: Callable[[], Sequence[Any]], real_tokens: Callable[[], int]) -> None:
        self._sessions = sessions
        self._real_tokens = real_tokens

    def collect(self) -> Iterator[Any]:
        counters = device_counters(self._sessions())
        steps = CounterMetricFamily(f"{PREFIX}_device_steps", "device steps run by the model's executables")
        steps.add_metric([], counters["device_steps"])
        yield steps
        computed = CounterMetricFamily(
            f"{PREFIX}_computed_tokens", "tokens the device computed (compiled input_ids shape x steps)"
        )
        computed.add_metric([], counters["computed_tokens"])
        yield computed
        switches = CounterMetricFamily(f"{PREFIX}_switches", "engine reloads of executables sharing a device")
        switches.add_metric([], counters["switches"])
        yield switches
        executables = GaugeMetricFamily(
            f"{PREFIX}_executables", "executables loaded, by where they came from", labels=["source"]
        )
        for source, count in sorted(counters["sources"].items()):
            executables.add_metric([source], count)
        yield executables
        real = self._real_tokens()
        fill = GaugeMetricFamily(f"{PREFIX}_batch_fill", "real tokens per computed token since start")
        fill.add_metric([], real / counters["computed_tokens"] if counters["computed_tokens"] else 0.0)
        yield fill


class ServerMetrics:
    """The app's metrics and the registry ``/metrics`` renders."""

    def __init__(self, sessions: Callable[[], Sequence[Any]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests", "requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors",
            "requests refused or failed",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight",
            "requests received and not yet answered (queue depth)",
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "time from request to the last byte of its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inputs = Counter(
            f"{PREFIX}_inputs", "sequences embedded, classified or prompted", registry=self.registry
        )
        self.real_tokens = Counter(
            f"{PREFIX}_real_tokens", "tokens the requests brought", registry=self.registry
        )
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens", "tokens generated", registry=self.registry
        )
        self._real_total = 0
        self._lock = threading.Lock()
        self.registry.register(_SessionCollector(sessions, lambda: self._real_total))

    def count_real(self, inputs: int, tokens: int) -> None:
        """Sequences and tokens a request brought to the model (or a generation produced)."""
        self.inputs.inc(inputs)
        self.real_tokens.inc(tokens)
        with self._lock:
            self._real_total += tokens
