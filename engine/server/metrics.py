"""Prometheus metrics of the subtitle server.

Built on `prometheus_client` rather than hand-written text: the exposition format has
escaping, histogram and content-negotiation rules (text 0.0.4 vs OpenMetrics) that the
library keeps right as Prometheus evolves, and it is a small pure-Python dependency.
Each server gets its own registry, so several servers (tests) never share counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from engine.server.admission import Reason

if TYPE_CHECKING:
    from engine.decoding.scheduler import DecodeScheduler
    from engine.streaming.controller import IncrementalTranslator

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; live subtitles are judged in tens to hundreds of milliseconds."""


class _EngineStats(Collector):
    """Exposes one of the engine's own counters (the controller's `stats`: events,
    superseded, cancelled, ...; the decode scheduler's: decoder steps, prefills, draft
    tokens offered and accepted, ...) at scrape time, so the engine needs no dependency on
    Prometheus."""

    def __init__(
        self, stats: Callable[[], Mapping[str, int] | None], name: str, documentation: str
    ) -> None:
        self._stats = stats
        self._name = name
        self._documentation = documentation

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=["kind"])
        for kind, count in sorted((self._stats() or {}).items()):
            family.add_metric([kind], count)
        yield family


class _SchedulerStats(Collector):
    """Each model's decode scheduler counters, labelled by its target language (one
    scheduler per model: with fan-out, one per language)."""

    def __init__(self, stats: Callable[[], Mapping[str, Mapping[str, int]] | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "nmt_scheduler_work",
            "Decode scheduler work per model, by target language (decoder_steps, "
            "decoder_step_rows, prefill_calls, prefill_rows, encoder_calls, encoder_rows, "
            "rows_ended, rows_cancelled, "
            "draft_offered, draft_accepted, lookahead_offered, lookahead_accepted, "
            "queue_wait_ms, idle_ms, held_turns, held_us).",
            labels=["kind", "lang"],
        )
        for lang, stats in sorted((self._stats() or {}).items()):
            for kind, count in sorted(stats.items()):
                family.add_metric([kind, lang], count)
        yield family


class _EngineCollector(Collector):
    """A collector that reads the engine when scraped (`engine`: None before it is up)."""

    def __init__(self, engine: Callable[[], IncrementalTranslator | None]) -> None:
        self._engine = engine

    def _schedulers(self) -> list[tuple[str, DecodeScheduler]]:
        """Each loaded model's decode scheduler, by target language, sorted."""
        nmt = self._engine()
        targets = nmt.targets.items() if nmt is not None else []
        return sorted((lang, target.scheduler) for lang, target in targets)


class _KvSlotStats(_EngineCollector):
    """Each model's KV slot pool, by target language: its slots, those free, and the
    bytes it holds (allocated at start: the decoder's state does not grow with load)."""

    def collect(self) -> Iterable[Metric]:
        slots = GaugeMetricFamily(
            "nmt_kv_slots",
            "KV slots per model (state: total, free): rows whose decoder state is kept "
            "in place; a request waits while none is free.",
            labels=["state", "lang"],
        )
        size = GaugeMetricFamily(
            "nmt_kv_slot_bytes", "Memory of each model's KV slot pool.", labels=["lang"]
        )
        for lang, scheduler in self._schedulers():
            pool = scheduler.kv_slots
            if pool is None:
                continue
            slots.add_metric(["total", lang], pool["total"])
            slots.add_metric(["free", lang], pool["free"])
            size.add_metric([lang], pool["bytes"])
        yield slots
        yield size


class _DecoderState(_EngineCollector):
    """Each model's decoder state kept by its lanes (self-attention in place, or copied
    per step), by target language: `live`, what its running rows' positions and sources
    occupy; `reserved`, what the arrays holding them span (buffers for more rows and
    positions, mapped as they are written: resident memory lies between the two). Why:
    under load this state, not per-stream bookkeeping, is what grows with the rows."""

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "nmt_decoder_state_bytes",
            "Decoder keys and values the lanes hold per model (state: live, reserved), "
            "as of each lane's last turn.",
            labels=["state", "lang"],
        )
        for lang, scheduler in self._schedulers():
            state = scheduler.state_bytes
            if state is None:
                continue
            family.add_metric(["live", lang], state.live)
            family.add_metric(["reserved", lang], state.reserved)
        yield family


class _ModelInfo(Collector):
    """One series per loaded model (value 1): its target and source language, directory,
    batching and whether its language is the default, so a dashboard can tell what a
    server translates into."""

    def __init__(self, models: Callable[[], Iterable[Mapping[str, str]]]) -> None:
        self._models = models

    def collect(self) -> Iterable[Metric]:
        keys = ["lang", "source_lang", "model", "batching", "default"]
        family = GaugeMetricFamily(
            "nmt_model_info", "The models loaded, one per target language.", labels=keys
        )
        for model in self._models():
            family.add_metric([model.get(key, "") for key in keys], 1.0)
        yield family


class _BusStats(_EngineCollector):
    """The update bus's counters (a shared bus: appends, leases renewed and lost,
    takeovers, finals refused while Redis was down, reconnects, ...), its latencies
    (append: publish to Redis's acknowledgement; read: an entry's time in Redis until a
    node reads it) as quantiles of recent samples, and local viewers (totals)."""

    def collect(self) -> Iterable[Metric]:
        nmt = self._engine()
        bus = nmt.bus if nmt is not None else None
        events = CounterMetricFamily(
            "nmt_bus_events",
            "Update bus work by kind (appended, append_round_trips, terms_written, "
            "terms_alone, scripts_loaded, entries_read, lease_renewals, renewal_round_trips, "
            "lease_losses, takeovers, stale_refused, finals_refused, updates_dropped, "
            "close_marks_lost, resume_gaps, "
            "redis_errors, redis_reconnects, redis_oom, redis_refused).",
            labels=["kind"],
        )
        for kind, count in sorted((bus.stats if bus is not None else {}).items()):
            events.add_metric([kind], count)
        if nmt is not None:
            events.add_metric(["answered_from_history"], nmt.stats["answered_from_history"])
        yield events
        latency = GaugeMetricFamily(
            "nmt_bus_latency_seconds",
            "Update bus latency over recent samples, by step (append, read) and quantile.",
            labels=["step", "quantile"],
        )
        for step in ("publish", "read"):
            samples = sorted(getattr(bus, f"{step}_seconds", ()))
            for q in (0.5, 0.95, 0.99):
                if samples:
                    value = samples[min(len(samples) - 1, int(q * len(samples)))]
                    latency.add_metric([step, str(q)], value)
        yield latency
        # Totals only: a stream id is chosen by whoever subscribes, and one series per
        # id would let any viewer grow the scrape (and Prometheus) without bound.
        counts = nmt.bus.hub.viewers() if nmt is not None else {}
        viewers = GaugeMetricFamily("nmt_bus_viewers", "Viewer subscriptions on this node.")
        viewers.add_metric([], sum(counts.values()))
        yield viewers
        watched = GaugeMetricFamily(
            "nmt_bus_viewed_streams", "Streams with at least one viewer on this node."
        )
        watched.add_metric([], len(counts))
        yield watched
        up = GaugeMetricFamily("nmt_bus_ready", "1 while the update bus publishes, else 0.")
        up.add_metric([], 1.0 if bus is None or bus.ready else 0.0)
        yield up


class ServerMetrics:
    """The counters, gauges and histogram that `/metrics` serves."""

    def __init__(
        self,
        open_streams: Callable[[], int],
        engine_stats: Callable[[], Mapping[str, int] | None],
        scheduler_stats: Callable[[], Mapping[str, Mapping[str, int]] | None] = lambda: None,
        models: Callable[[], Iterable[Mapping[str, str]]] = list,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connections = Gauge(
            "nmt_server_connections", "Open WebSocket connections.", ["role"], registry=r
        )
        self.connections_accepted = Counter(
            "nmt_server_connections_accepted", "WebSocket connections accepted.", registry=r
        )
        self.handshakes_refused = Counter(
            "nmt_server_handshakes_refused",
            "WebSocket handshakes refused, by HTTP status.",
            ["status"],
            registry=r,
        )
        self.connections_rejected = Counter(
            "nmt_server_connections_rejected",
            "Connections refused or dropped by the server's caps, by reason: "
            "max_connections (503), per_address (429), handshake_timeout (no request "
            "within --handshake-timeout), pending_evicted (the oldest unfinished handshake, "
            "dropped for a newer one), pending_full (a new connection dropped: every pending "
            "handshake is recent), fd_limit (accept() failed: no descriptor left; the "
            "connection is answered 503 from a spare descriptor when it can be).",
            ["reason"],
            registry=r,
        )
        for reason in Reason:  # every series from the start, at 0
            self.connections_rejected.labels(reason.value)
        self.pending_handshakes = Gauge(
            "nmt_server_pending_handshakes",
            "Connections accepted whose HTTP request has not arrived yet.",
            registry=r,
        )
        self.max_connections = Gauge(
            "nmt_server_max_connections",
            "The cap on WebSocket connections (--max-connections).",
            registry=r,
        )
        self.open_streams = Gauge(
            "nmt_server_open_streams", "Streams open in the engine.", registry=r
        )
        self.open_streams.set_function(lambda: float(open_streams()))
        self.messages_in = Counter(
            "nmt_server_messages_received",
            "Messages received, by type (invalid: could not be decoded).",
            ["type"],
            registry=r,
        )
        self.messages_out = Counter(
            "nmt_server_messages_sent", "Messages sent, by type.", ["type"], registry=r
        )
        self.errors = Counter(
            "nmt_server_errors", "Error messages sent, by code.", ["code"], registry=r
        )
        self.dropped_updates = Counter(
            "nmt_server_dropped_updates",
            "Non-final updates dropped because a client read too slowly.",
            registry=r,
        )
        self.dropped_errors = Counter(
            "nmt_server_dropped_errors",
            "Error replies dropped because a client sent faster than it read.",
            registry=r,
        )
        self.update_latency = Histogram(
            "nmt_update_latency_seconds",
            "Time from a partial's arrival at the engine to its translation update, by "
            "target language.",
            ["lang"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(
            _EngineStats(
                engine_stats,
                "nmt_engine_events",
                "Engine work by outcome (events accepted, superseded, cancelled, updates, ...).",
            )
        )
        r.register(_SchedulerStats(scheduler_stats))
        r.register(_ModelInfo(models))
        # The series counted per message, held by label: `labels()` takes a lock and
        # builds a key on every call, which the message path need not pay.
        self._received: dict[str, Counter] = {}
        self._sent: dict[str, Counter] = {}
        self._latency: dict[str, Histogram] = {}

    def received(self, kind: str) -> None:
        """One message of `kind` received."""
        child = self._received.get(kind)
        if child is None:
            child = self._received[kind] = self.messages_in.labels(kind)
        child.inc()

    def sent(self, kind: str) -> None:
        """One message of `kind` sent."""
        child = self._sent.get(kind)
        if child is None:
            child = self._sent[kind] = self.messages_out.labels(kind)
        child.inc()

    def latency(self, lang: str, seconds: float) -> None:
        """An update of `lang` made `seconds` after its partial arrived."""
        child = self._latency.get(lang)
        if child is None:
            child = self._latency[lang] = self.update_latency.labels(lang)
        child.observe(seconds)

    @classmethod
    def watching(cls, engine: Callable[[], IncrementalTranslator | None]) -> ServerMetrics:
        """Metrics that read, at scrape time, the engine `engine()` returns (None while a
        model loads: no streams, no engine series)."""

        def open_streams() -> int:
            nmt = engine()
            return len(nmt.streams) if nmt is not None else 0

        def engine_stats() -> Mapping[str, int] | None:
            nmt = engine()
            return nmt.stats if nmt is not None else None

        def scheduler_stats() -> dict[str, Mapping[str, int]] | None:
            """Each model's decode scheduler counters, by target language."""
            nmt = engine()
            if nmt is None:
                return None
            return {lang: t.scheduler.stats for lang, t in nmt.targets.items()}

        def models() -> list[dict[str, str]]:
            """What `nmt_model_info` says about each loaded model, default language first."""
            nmt = engine()
            if nmt is None:
                return []
            targets = nmt.targets
            return [
                {
                    "lang": lang,
                    "source_lang": t.config.source_lang or "",
                    "model": str(t.model.model_dir),
                    "batching": t.scheduler.batching,
                    "default": str(lang == targets.default).lower(),
                }
                for lang, t in targets.items()
            ]

        metrics = cls(open_streams, engine_stats, scheduler_stats, models)
        metrics.registry.register(_BusStats(engine))
        metrics.registry.register(_KvSlotStats(engine))
        metrics.registry.register(_DecoderState(engine))
        return metrics

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, negotiated from `Accept`."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
