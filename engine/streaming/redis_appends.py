"""The Redis bus's writes of a stream's replies: one queue per node, appended in order,
many per round trip (one pipeline of `APPEND` scripts), each writer told once Redis has
its reply. A stream's term counts ride on the same pipeline: kept here until the next
append of their stream's life is sent, they go in as that script's extra arguments (no
command and no round trip of their own); only counts with no such append queued are
written apart (`KEEP_HASH`), in the same pipeline as the appends of the moment.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

import anyio

from engine.streaming.fanout import Hub
from engine.streaming.redis_health import BACKOFF, UNREACHABLE, Health, describe, refusal
from engine.streaming.redis_store import (
    KIND_CLOSED,
    Append,
    Keys,
    redis_errors,
    terms_fields,
    with_cursor,
)
from protocol import ErrorCode, ErrorMessage, TranslationUpdate

Call = tuple[Any, list[str], list[Any]]
"""A script (redis-py's object: its digest and source), its keys and its arguments."""


async def send_scripts(
    redis: Any, calls: list[Call], stats: Counter[str], trips: str = "append_round_trips"
) -> list[Any]:
    """The calls in one pipeline, each script by its digest (`EVALSHA`): one round trip
    (a pipeline of redis-py's script objects asks Redis first whether it has them,
    one more every time). A Redis without them (restarted, or its scripts flushed)
    answers `NOSCRIPT` and ran nothing of those calls: they are loaded and those
    calls sent again, in order. Each call's answer or error is returned in its place;
    `stats` counts the round trips (as `trips`) and `scripts_loaded`."""
    from redis.exceptions import NoScriptError

    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        async with redis.pipeline(transaction=False) as pipe:
            for i in todo:
                script, keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            answers = await pipe.execute(raise_on_error=False)
        stats[trips] += 1
        for i, answer in zip(todo, answers, strict=True):
            results[i] = answer
        todo = [i for i in todo if isinstance(results[i], NoScriptError)]
        if not todo or attempt:
            break
        for script in {id(calls[i][0]): calls[i][0] for i in todo}.values():
            script.sha = await redis.script_load(script.script)
        stats["scripts_loaded"] += 1
    return results


BATCH = 256
"""Appends sent in one round trip at most."""

HISTORY_TTL_MS = 6 * 3600 * 1000
"""A (stream, language) history that nobody appends to expires after this, and the
stream's epoch and term counts with it (renewed while a node holds the stream)."""


class Appender:
    """A node's appends: `queue` a reply or a mark, `keep_terms` a stream's counts; `run`
    sends them. `stats` (`appended`, `stale_refused`, `append_round_trips`,
    `terms_written`: counts written, `terms_alone`: of them, those that had no append
    to ride on) and `publish_seconds` are the bus's, which the metrics read."""

    def __init__(
        self,
        keys: Keys,
        history_size: int,
        hub: Hub,
        health: Health,
        stats: Counter[str],
        publish_seconds: deque[float],
    ) -> None:
        self.keys = keys
        self.history_size = history_size
        self.hub = hub
        self.health = health
        self.stats = stats
        self.publish_seconds = publish_seconds
        self.outgoing: deque[Append] = deque()
        self.in_flight: list[Append] = []  # the batch being appended
        # stream -> (epoch, counts) not written yet: the latest only.
        self.terms: dict[str, tuple[int, Mapping[str, tuple[int, int]]]] = {}
        self._sending: dict[str, tuple[int, Mapping[str, tuple[int, int]]]] = {}
        self._has_outgoing = anyio.Event()

    @property
    def busy(self) -> bool:
        """Something is queued or being sent."""
        return bool(self.outgoing or self.in_flight or self.terms)

    def holds(self, stream_id: str) -> bool:
        """Whether a reply or mark of the stream is still queued or being sent."""
        return any(item.stream_id == stream_id for item in [*self.outgoing, *self.in_flight])

    def queue(self, item: Append) -> None:
        self.outgoing.append(item)
        self._has_outgoing.set()

    def keep_terms(self, stream_id: str, epoch: int, counts: Mapping[str, tuple[int, int]]) -> None:
        self.terms[stream_id] = (epoch, dict(counts))
        self._has_outgoing.set()

    def _carriers(self, batch: list[Append]) -> list[tuple[str, int, list[str]]]:
        """Give each stream's pending counts to its last reply in `batch` of the same
        life; returns those left to write apart (stream, epoch, fields). Counts of a
        stream closing in this batch are dropped: its close mark deletes them."""
        last: dict[tuple[str, int], Append] = {}
        closing: set[str] = set()
        for item in batch:
            if item.kind == KIND_CLOSED:
                closing.add(item.stream_id)
            else:
                last[(item.stream_id, item.epoch)] = item
        alone: list[tuple[str, int, list[str]]] = []
        self._sending = dict(self.terms)
        for stream_id, (epoch, counts) in self.terms.items():
            fields = terms_fields(counts)
            carrier = last.get((stream_id, epoch))
            if carrier is not None:
                carrier.terms = fields
            elif stream_id not in closing:
                alone.append((stream_id, epoch, fields))
        self.terms.clear()
        return alone

    async def run(self, redis: Any, scripts: Mapping[str, Any]) -> None:
        """Append queued replies in order, many per round trip; tell each writer once
        Redis has its reply."""
        while True:
            if not self.outgoing and not self.terms:
                self._has_outgoing = anyio.Event()
                await self._has_outgoing.wait()
            batch = [self.outgoing.popleft() for _ in range(min(len(self.outgoing), BATCH))]
            self.in_flight = batch
            alone = self._carriers(batch)
            calls = [self._append_call(scripts, item) for item in batch]
            calls += [
                (
                    scripts["keep_hash"],
                    [self.keys.epoch(stream_id), self.keys.terms(stream_id)],
                    [epoch, HISTORY_TTL_MS, *fields],
                )
                for stream_id, epoch, fields in alone
            ]
            try:
                results = await send_scripts(redis, calls, self.stats)
            except redis_errors() as exc:
                self.health.failed("appending replies", exc)
                results = [exc] * (len(batch) + len(alone))
            else:
                self.health.succeeded()
            refused = [r for r in results if isinstance(r, BaseException) and refusal(r)]
            if refused:
                self.health.write_refused("appending replies", refused[0])
            elif not any(isinstance(r, BaseException) for r in results):
                self.health.wrote()
            retry = self._terms_done(batch, alone, results)
            now = time.perf_counter()
            for item, result in zip(batch, results[: len(batch)], strict=True):
                if isinstance(result, BaseException):
                    self._not_appended(item, describe(result) if refusal(result) else UNREACHABLE)
                elif not result:
                    self.stats["stale_refused"] += 1
                    self._not_appended(item, "this stream was taken over by another server node")
                else:
                    self.stats["appended"] += 1
                    self.publish_seconds.append(now - item.queued)
                    self._appended(item, list(result))
            self.in_flight = []
            if retry and not self.outgoing:  # counts that failed: again, but not at once
                await anyio.sleep(BACKOFF[0])

    def _append_call(self, scripts: Mapping[str, Any], item: Append) -> Call:
        keys = [
            self.keys.epoch(item.stream_id),
            self.keys.terms(item.stream_id),
            *(self.keys.history(item.stream_id, lang) for lang in item.langs),
        ]
        args = [item.epoch, self.history_size, HISTORY_TTL_MS, item.kind, item.payload]
        return scripts["append"], keys, [*args, *item.terms]

    def _terms_done(
        self, batch: list[Append], alone: list[tuple[str, int, list[str]]], results: list[Any]
    ) -> bool:
        """Count the counts written; those that failed to go through (Redis unreachable)
        wait for the next round, unless newer ones came meanwhile (True: some did)."""
        sent = [(i.stream_id, r) for i, r in zip(batch, results, strict=False) if i.terms]
        sent += [(s, r) for (s, _, _), r in zip(alone, results[len(batch) :], strict=True)]
        retry = False
        for stream_id, result in sent:
            if isinstance(result, BaseException) and not refusal(result):
                self.terms.setdefault(stream_id, self._sending[stream_id])
                retry = True
            elif result:
                self.stats["terms_written"] += 1
        self.stats["terms_alone"] += sum(1 for r in results[len(batch) :] if r == 1)
        self._sending = {}
        return retry

    def _appended(self, item: Append, ids: list[str]) -> None:
        reply = item.reply
        if reply is None:
            return
        cursor = ids[0] if ids else None
        if isinstance(reply, TranslationUpdate) and cursor is not None and len(ids) == 1:
            reply = with_cursor(reply, cursor)
        # Its viewers on every node (this one's too) have it from their reads.
        self.hub.publish(reply, item.owner, viewers=False)

    def _not_appended(self, item: Append, why: str) -> None:
        """A reply Redis did not take: a final's becomes an `unavailable` error to its
        writer (which sends the final again), a partial's is dropped (counted)."""
        reply = item.reply
        if reply is None:
            kind = "close_marks_lost" if item.kind == KIND_CLOSED else "restart_marks_lost"
            self.health.lost(kind, why)
            return
        final = reply.seq if isinstance(reply, ErrorMessage) else None
        if isinstance(reply, TranslationUpdate):
            final = reply.seq if reply.is_final else None
        if final is None:
            self.health.lost("updates_dropped", why)
            return
        self.health.lost("finals_refused", why)
        error = ErrorMessage(
            ErrorCode.UNAVAILABLE,
            f"{why}: send this final transcript again (reconnect first)",
            None,
            reply.stream_id,
            final,
            reply.lang,
        )
        self.hub.to_owner(error, item.owner)
