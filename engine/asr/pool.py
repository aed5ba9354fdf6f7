"""Speech recognition in worker processes: a pool of N processes, each holding the
recognizers of the audio streams pinned to it (the worker's side is `engine.asr.worker`).

Why processes: pocketsphinx holds the GIL while it decodes, so recognizers in threads of
one process share one core with each other, with the event loop and with the engine's
Python. In N processes recognition gets N cores of its own, which whoever builds the
process takes off the models' share, so recognition and translation together stay within
the machine's cores instead of adding to them.

Why 'spawn': the server has threads before the pool starts (ONNX Runtime's pools, the
scheduler's lanes, anyio's workers, this pool's readers), and `fork` copies a process
whose other threads may hold locks (the allocator's, logging's, ONNX Runtime's) that the
child then waits on forever; a forked worker would also inherit every descriptor the
server has open (its listening socket, the clients' connections, the other workers'
pipe ends) and hold them past their owners. 'spawn' starts a fresh interpreter that gets
only its own pipe end; its imports are paid at server start and when a worker is
replaced, never per stream. Like every 'spawn' child, a worker imports the parent's main
module again: a script that starts a pool needs the `if __name__ == "__main__":` idiom.

How a stream goes: `open` pins it to the least-loaded live worker (the one with the
fewest open streams), which makes the stream's recognizer and `RecognizerStream` there;
the returned `PooledStream` is a `SpeechStream` whose calls are each sent down the
worker's pipe and answered with the events or a typed failure. A worker answers in
order, and making a recognizer takes it a while, so new streams take turns (`OpenTurns`):
one is made at a time per worker, and a running stream's audio waits behind at most one.
Calls block the calling thread, never the event loop: they are made from worker threads
(`anyio.to_thread`), and a writer thread and a reader thread per worker move the
messages, the reader resolving each call's future.

A worker that dies (a crash in the recognizer's C code, `kill -9`, the OOM killer): its
reader sees the pipe close, every call waiting on it ends at once, and each of its
streams fails as a raising recognizer does: `RecognizerFailed` whose events close the
segment in progress with the words shown last, its cause `WorkerDied` naming the worker
and how it ended. The next `open` starts a replacement. Workers stop when `close` asks,
and on their own when the pipe from the server closes (the server died), so none
outlives it. `close` stops them, kills the ones that do not stop in time, and reaps them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import Final

from engine.asr.errors import PoolClosed, RecognizerFailed, WorkerDied
from engine.asr.recognizer import RecognizerFactory, SpeechStream
from engine.asr.worker import (
    Accept,
    Drop,
    Failed,
    Flush,
    Heard,
    Open,
    Opened,
    Outcome,
    Raised,
    Request,
    Stop,
    serve,
)
from protocol import PartialTranscript

log = logging.getLogger(__name__)

START_METHOD: Final = "spawn"  # see the module docstring
STOP_TIMEOUT_S = 5.0
"""How long `close` waits for workers to finish what they were sent before killing them."""


class OpenTurns:
    """Which of one worker's requests go down its pipe now, and which wait their turn.

    A worker answers in order, and making a recognizer takes it a while (a model's data
    is loaded for each): a burst of new streams sent at once would queue ahead of every
    running stream's audio, and a client opening and ending streams in a loop would stall
    every speaker on that worker. So one `Open` at a time is in flight per worker; the
    others wait here, in order, and each is sent once the one before is answered, behind
    whatever audio was sent meanwhile. A running stream's call thus waits behind at most
    one recognizer being made, and every waiting `Open` gets its turn. Sans I/O: the
    worker's threads carry out what it says, under the worker's lock.
    """

    def __init__(self) -> None:
        self.in_flight: int | None = None  # the request id of the Open being answered
        self.waiting: deque[tuple[int, Open]] = deque()

    def submit(self, rid: int, message: Request) -> bool:
        """Whether to send `message` now (else it waits for its turn)."""
        if not isinstance(message, Open):
            return True
        if self.in_flight is None:
            self.in_flight = rid
            return True
        self.waiting.append((rid, message))
        return False

    def answered(self, rid: int) -> tuple[int, Open] | None:
        """Request `rid` is answered (or could not be sent): the waiting `Open` to send
        now, if its turn came."""
        if rid != self.in_flight:
            return None
        self.in_flight = None
        if not self.waiting:
            return None
        turn = self.waiting.popleft()
        self.in_flight = turn[0]
        return turn

    def __len__(self) -> int:
        """Opens not answered yet: the one in flight and those waiting."""
        return len(self.waiting) + (self.in_flight is not None)


class _Worker:
    """One worker process and the two threads that talk to it."""

    def __init__(self, index: int, factory: RecognizerFactory) -> None:
        context = multiprocessing.get_context(START_METHOD)
        self.index = index
        ours, theirs = context.Pipe(duplex=True)
        self.process: BaseProcess = context.Process(
            target=serve, args=(theirs, factory), name=f"nmt-recognizer-{index}", daemon=True
        )
        self.process.start()
        theirs.close()  # the child's end is the child's alone: its death closes the pipe
        self.pid = self.process.pid  # kept: a closed Process object no longer says it
        self.conn = ours
        self.streams = 0  # open streams pinned here (for least-loaded placement)
        self.closing = False
        self.death: str | None = None  # how it ended, once it has
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Outcome]] = {}
        self.turns = OpenTurns()
        self._outbox: queue.SimpleQueue[tuple[int | None, Request] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(
            target=self._read, name=f"nmt-recognizer-{index}-reader", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write, name=f"nmt-recognizer-{index}-writer", daemon=True
        )
        self._reader.start()
        self._writer.start()

    @property
    def alive(self) -> bool:
        return self.death is None

    def __repr__(self) -> str:
        return f"recognition worker {self.index} (pid {self.pid})"

    def request(self, message: Request) -> Future[Outcome]:
        """Send `message`; the future of its answer (`WorkerDied` if the worker ends
        first, or already has)."""
        future: Future[Outcome] = Future()
        with self._lock:
            if self.death is not None:
                raise WorkerDied(f"{self!r} {self.death}")
            rid = next(self._ids)
            self._pending[rid] = future
            if self.turns.submit(rid, message):
                self._outbox.put((rid, message))
        return future

    def tell(self, message: Request) -> None:
        """Send `message`, which has no answer (nothing if the worker has ended)."""
        with self._lock:
            if self.death is None:
                self._outbox.put((None, message))

    def stop(self) -> None:
        """Ask the worker to exit after answering what it was sent."""
        self.closing = True
        self.tell(Stop())

    def _write(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            try:
                self.conn.send(item)
            except (OSError, ValueError):  # the worker is gone (the reader says how)
                return
            except Exception as exc:  # a request that does not pickle: that call fails
                rid = item[0]
                with self._lock:
                    future = self._pending.pop(rid, None) if rid is not None else None
                    if rid is not None:
                        self._next_turn(rid)
                if future is not None:
                    future.set_exception(exc)

    def _read(self) -> None:
        """Resolve each answer's future until the pipe closes, then `_ended`. This thread
        alone waits for the process (two threads reaping one child race in waitpid)."""
        broken = False
        try:
            while True:
                rid, outcome = self.conn.recv()
                with self._lock:
                    future = self._pending.pop(rid, None)
                    self._next_turn(rid)
                if future is not None:
                    future.set_result(outcome)
        except (EOFError, OSError):
            pass  # the worker ended
        except Exception:  # it sent something that does not load: it cannot be trusted
            broken = True
        self._ended(broken)

    def _next_turn(self, rid: int) -> None:
        """Request `rid` is done with: send the `Open` whose turn it is now (under the
        lock)."""
        turn = self.turns.answered(rid)
        if turn is not None and self.death is None:
            self._outbox.put(turn)

    def _ended(self, broken: bool) -> None:
        """Reap the process (killed if it lingers: a worker that closed its pipe or sent
        garbage is of no use) and fail every call still waiting on it."""
        self.process.join(STOP_TIMEOUT_S if self.closing and not broken else 1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        code = self.process.exitcode
        if self.closing and not broken:
            how = "stopped: the recognition pool was closed"
        elif broken:
            how = "sent something unreadable and was killed"
        elif code is not None and code < 0:
            how = f"died: killed by {_signal_name(-code)}"
        elif code is not None:
            how = f"died: exited with status {code}"
        else:
            how = "died"
        with self._lock:
            self.death = how
            pending = list(self._pending.values())
            self._pending.clear()
            self.turns = OpenTurns()  # their futures are among `pending`
            self._outbox.put(None)  # the writer thread ends
        if not self.closing:
            log.error("%r %s; its streams failed", self, how)
        for future in pending:
            future.set_exception(WorkerDied(f"{self!r} {how}"))

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the process to end (killed past it), then for its
        threads; release the pipe."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            log.warning("%r did not stop within %.1f s: killed", self, timeout)
            self.process.kill()
            self._reader.join()
        self._writer.join(STOP_TIMEOUT_S)
        self.conn.close()
        with contextlib.suppress(ValueError):  # still running: only if its reaping failed
            self.process.close()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class RecognizerPool:
    """N recognition worker processes; streams spread over them by load (see the module
    docstring). `factory` makes one recognizer per stream in the worker (it must pickle).

    `start` starts the processes (without waiting for their imports: a stream opened
    meanwhile waits for its worker); `open` (blocking: call it from a worker thread)
    pins a new stream to a worker; `close` stops them all. Thread-safe. Usable as a
    context manager (`start` ... `close`).
    """

    def __init__(self, factory: RecognizerFactory, workers: int) -> None:
        if workers < 1:
            raise ValueError("a recognizer pool needs at least one worker")
        try:
            pickle.dumps(factory)
        except Exception as exc:
            raise ValueError(
                "a recognizer factory run in worker processes must pickle (a module-level "
                f"function or class, or a functools.partial of one): {exc}"
            ) from exc
        self.factory = factory
        self.size = workers
        self._replaced = 0  # dead workers whose slot got a new process
        self._workers: list[_Worker] = []
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the worker processes (once; `PoolClosed` after `close`)."""
        with self._lock:
            if self._closed:
                raise PoolClosed("the recognition pool is closed")
            if not self._workers:
                self._workers = [_Worker(i, self.factory) for i in range(self.size)]

    def __enter__(self) -> RecognizerPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The process ids of the live workers."""
        with self._lock:
            return [w.pid for w in self._workers if w.alive and w.pid is not None]

    @property
    def loads(self) -> list[int]:
        """Open streams per worker slot."""
        with self._lock:
            return [w.streams for w in self._workers]

    @property
    def opening(self) -> list[int]:
        """Streams per worker slot whose recognizer is being made or waits its turn."""
        with self._lock:
            return [len(w.turns) for w in self._workers]

    @property
    def lost(self) -> int:
        """Workers that died (those stopped by `close` are not counted), from the moment
        their death is seen."""
        with self._lock:
            return self._replaced + sum(1 for w in self._workers if not w.alive and not w.closing)

    @property
    def alive(self) -> int:
        """Live workers."""
        with self._lock:
            return sum(1 for w in self._workers if w.alive)

    def open(
        self,
        stream_id: str,
        *,
        sample_rate: int | None = None,
        first_segment: int = 0,
        first_seq: int = 0,
        offset_ms: float = 0.0,
    ) -> PooledStream:
        """A new stream on the least-loaded worker (dead workers are replaced first), as
        `RecognizerStream(factory(), stream_id, ...)` would make it; blocks until the
        worker has made it. Raises what making it raised (e.g. `AudioFormatError`, the
        factory's own error), `WorkerDied`, or `PoolClosed`."""
        worker = self._place()
        key = next(self._keys)
        message = Open(key, stream_id, sample_rate, first_segment, first_seq, offset_ms)
        try:
            outcome = worker.request(message).result()
            if isinstance(outcome, Raised):
                raise outcome.error
            assert isinstance(outcome, Opened), outcome
        except BaseException:
            self._release(worker)
            raise
        return PooledStream(
            self,
            worker,
            key,
            stream_id,
            outcome.rate_in,
            first_segment=first_segment,
            first_seq=first_seq,
            offset_ms=offset_ms,
        )

    def _place(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise PoolClosed("the recognition pool is closed")
            if not self._workers:
                raise RuntimeError("the recognition pool is not started")
            for i, worker in enumerate(self._workers):
                if not worker.alive:  # its reader reaped it; its slot gets a new process
                    self._replaced += 1
                    worker.join(STOP_TIMEOUT_S)
                    self._workers[i] = _Worker(i, self.factory)
                    log.info("%r started in place of pid %s", self._workers[i], worker.pid)
            chosen = min(self._workers, key=lambda w: w.streams)
            chosen.streams += 1
            return chosen

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            worker.streams -= 1

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every worker (each answers what it was sent first; past `timeout` it is
        killed) and reap them; calls still waiting get `WorkerDied`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
            self._replaced += sum(1 for w in workers if not w.alive and not w.closing)
        for worker in workers:
            worker.stop()
        deadline = time.monotonic() + timeout
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))


class PooledStream(SpeechStream):
    """A `SpeechStream` whose `RecognizerStream` lives in a worker process: each call
    blocks until the worker answers (make them from a worker thread). Events,
    `segment_id`, `seq` and `heard_ms` are those the stream would have in this process
    (the numbering follows the worker's events); `busy_s`/`cpu_s` are the worker's time
    on its calls. When the worker dies, the call in flight (and any later one) raises
    `RecognizerFailed` from `WorkerDied`, its events the segment in progress made final.
    `close` when done (it frees the worker's slot)."""

    def __init__(
        self,
        pool: RecognizerPool,
        worker: _Worker,
        key: int,
        stream_id: str,
        rate_in: int,
        *,
        first_segment: int,
        first_seq: int,
        offset_ms: float,
    ) -> None:
        super().__init__(
            stream_id,
            rate_in,
            first_segment=first_segment,
            first_seq=first_seq,
            offset_ms=offset_ms,
        )
        self.pool = pool
        self._worker = worker
        self._key = key
        self._lost = False
        self._closed = False

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid

    def accept(self, pcm: bytes | bytearray | memoryview) -> list[PartialTranscript]:
        """`RecognizerStream.accept`, in the worker."""
        return self._call(Accept(self._key, self._take(pcm)))

    def flush(self) -> list[PartialTranscript]:
        """`RecognizerStream.flush`, in the worker."""
        self._finish()
        return self._call(Flush(self._key))

    def close(self) -> None:
        """Done with the stream: the worker forgets it (if not flushed) and its slot is
        free. Never blocks; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.finished and not self._lost:
            self._worker.tell(Drop(self._key))
        self.pool._release(self._worker)

    def _call(self, message: Accept | Flush) -> list[PartialTranscript]:
        try:
            if self._lost:
                raise WorkerDied(f"{self._worker!r} {self._worker.death}")
            outcome = self._worker.request(message).result()
        except WorkerDied as exc:
            self._lost = True
            events = self._numbering.finalize()
            raise RecognizerFailed(self.stream_id, self.heard_ms, events) from exc
        if isinstance(outcome, Raised):
            raise outcome.error
        assert isinstance(outcome, (Heard, Failed)), outcome
        self.busy_s += outcome.busy_s
        self.cpu_s += outcome.cpu_s
        self._numbering.follow(outcome.events)
        if isinstance(outcome, Failed):
            raise RecognizerFailed(self.stream_id, outcome.at_ms, outcome.events) from (
                outcome.cause
            )
        return outcome.events
