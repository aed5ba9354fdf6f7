"""The KV slot pool's free list: which slots each running request holds, apart from the
scheduling policy, which only asks whether a request's rows fit (vLLM's Scheduler /
KVCacheManager split).

Pure and single-threaded like the policy that calls it (under the scheduler's lock).
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")  # a request: hashable, as every running request is


class SlotsExhausted(ValueError):
    """Rows were asked for that the free slots cannot hold now (the policy asks `fits`
    first: this is a bug in the caller, not a full pool)."""


class KvSlotManager(Generic[K]):
    """`total` KV slots, each held by at most one owner (a request) at a time; a request
    takes one per row it may hold (a beam's width) when it joins, and gives them all back
    when it leaves. Slots most recently given back are given first: their pages are warm.
    """

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a KV slot pool needs at least one slot")
        self.total = total
        self._free: list[int] = list(range(total))[::-1]  # the next one given last
        self._held: dict[K, tuple[int, ...]] = {}

    @property
    def free(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def fits(self, rows: int) -> bool:
        """Whether `rows` more rows fit in the free slots now."""
        return rows <= len(self._free)

    def could_fit(self, rows: int) -> bool:
        """Whether `rows` rows fit in the pool at all (a wider request could never run)."""
        return rows <= self.total

    def allocate(self, owner: K, rows: int) -> tuple[int, ...]:
        """Give `owner` `rows` free slots (in the order its rows use them)."""
        if owner in self._held:
            raise ValueError("this request holds KV slots already")
        if not self.fits(rows):
            raise SlotsExhausted(f"{rows} KV slots asked for, {len(self._free)} free")
        taken = self._free[len(self._free) - rows :]
        del self._free[len(self._free) - rows :]
        self._held[owner] = held = tuple(taken[::-1])
        return held

    def release(self, owner: K) -> None:
        """`owner`'s slots are free again (nothing when it holds none)."""
        self._free.extend(self._held.pop(owner, ())[::-1])

    def slots_of(self, owner: K) -> tuple[int, ...]:
        """The slots `owner` holds (none when it holds none)."""
        return self._held.get(owner, ())
