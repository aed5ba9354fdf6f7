"""What the Redis bus keeps in Redis and runs there: the scripts that claim, renew and
release a stream's lease and append to its histories (each one step inside Redis, so a
fence cannot be passed between a check and a write), and how an entry is stored."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

import protocol
from engine.replies import Reply
from engine.streaming.history import Entry
from engine.streaming.lifecycle import Owner
from protocol import ErrorMessage, TranslationUpdate

CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return {0, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local created = 0
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[2], ARGV[3])
  created = 1
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {1, epoch, created}
"""
# The epoch counter starts from the clock (ms) when missing, so that a Redis restarted
# without its data, or an epoch that expired with its history, never hands out an epoch
# that an older life already had. `created`: this claim made the counter, which `RELEASE`
# may then delete (a claim that opened nothing leaves nothing behind).

APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local ids = {}
for i = 3, #KEYS do
  ids[#ids + 1] = redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[2], '*',
                             'k', ARGV[4], 'e', ARGV[1], 'm', ARGV[5])
  redis.call('PEXPIRE', KEYS[i], ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if ARGV[4] == 'c' then
  redis.call('DEL', KEYS[2])
elseif #ARGV > 5 then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], unpack(ARGV, 6))
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return ids
"""
# KEYS[1]: the stream's epoch; KEYS[2]: its term counts (language -> "matched placed");
# the rest: its history keys. An append of an older life (a node that lost the stream
# without knowing it yet) is refused here. The epoch expires with the histories, the
# counts too (`RENEW` keeps them while a life holds the stream). ARGV[6...]: the counts'
# language, value pairs when they changed since the last append (they ride on it, no
# round trip of their own), replacing the hash; a close mark deletes it (the id opened
# anew counts from nothing).

RENEW = """
local holder = redis.call('GET', KEYS[1])
local current = redis.call('GET', KEYS[2])
if current and current ~= ARGV[3] then return 0 end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  return 0
end
if not current then redis.call('SET', KEYS[2], ARGV[3]) end
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""
# A lease that expired while nobody took the stream over (or a Redis restarted without
# its data) is taken back with the same epoch; one that another life holds is lost.
# KEYS[3...]: what the stream keeps beside its histories (its glossaries, its term
# counts), which live as long as the life holding it does, and its term to live after.

RELEASE = """
local released = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then released = redis.call('DEL', KEYS[1]) end
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
return released
"""
# ARGV[2]: the epoch of a claim that made the counter and opened no stream (else ''):
# deleted while still that claim's, as nothing was ever stamped with it.

KEEP_HASH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
if #ARGV > 2 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
"""
# A hash a stream's current life keeps beside its histories, replaced whole: its
# glossaries (language -> text), or its term counts when no append of their stream was
# queued to carry them. KEYS[1]: the stream's epoch, KEYS[2]: the hash; ARGV[1]: the life
# writing it (a life that lost the stream writes nothing), ARGV[2]: its time to live (the
# histories'), then field, value pairs (none: the hash goes).

KIND_REPLY = "r"
KIND_CLOSED = "c"
KIND_STARTED_OVER = "s"


@dataclass(frozen=True)
class Keys:
    """The bus's keys, under `prefix` so that several services may share one Redis."""

    prefix: str

    def lease(self, stream_id: str) -> str:
        return f"{self.prefix}:lease:{stream_id}"

    def epoch(self, stream_id: str) -> str:
        return f"{self.prefix}:epoch:{stream_id}"

    def glossaries(self, stream_id: str) -> str:
        return f"{self.prefix}:g:{stream_id}"

    def terms(self, stream_id: str) -> str:
        return f"{self.prefix}:t:{stream_id}"

    def history(self, stream_id: str, lang: str) -> str:
        # The language is last and never holds a colon: any stream id maps to one key.
        return f"{self.prefix}:h:{stream_id}:{lang}"


@dataclass
class Append:
    """One reply (or close mark) waiting to be appended, with whom to tell once it is."""

    stream_id: str
    langs: list[str]
    epoch: int
    kind: str
    payload: str
    reply: Reply | None
    owner: Owner | None
    queued: float
    terms: list[str] = field(default_factory=list)  # counts riding on it (`APPEND`)


@dataclass
class Watch:
    """A history key this node reads for its local viewers."""

    stream_id: str
    lang: str
    last: str  # the id read up to


def terms_fields(counts: Mapping[str, tuple[int, int]]) -> list[str]:
    """A stream's term counts as the hash's language, value pairs."""
    return [part for lang, (m, p) in sorted(counts.items()) for part in (lang, f"{m} {p}")]


def terms_of(raw: Mapping[str, str]) -> dict[str, tuple[int, int]]:
    """The hash read back (a value that is not two numbers is left out)."""
    counts: dict[str, tuple[int, int]] = {}
    for lang, value in raw.items():
        parts = str(value).split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            counts[str(lang)] = (int(parts[0]), int(parts[1]))
    return counts


def redis_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError

    return (RedisError, OSError)


def entry_of(entry_id: str, fields: dict[str, str]) -> Entry:
    """A Redis Stream entry as a history entry."""
    epoch = int(fields["e"]) if fields.get("e") else None
    if fields.get("k") == KIND_STARTED_OVER:
        return Entry(entry_id, None, epoch, started_over=True)
    if fields.get("k") != KIND_REPLY:
        return Entry(entry_id, None, epoch)
    message = protocol.parse(fields["m"], max_bytes=1 << 22, max_text_chars=1 << 20)
    if isinstance(message, TranslationUpdate):
        return Entry(entry_id, with_cursor(message, entry_id), epoch)
    assert isinstance(message, ErrorMessage)
    return Entry(entry_id, message, epoch)


def with_cursor(update: TranslationUpdate, cursor: str) -> TranslationUpdate:
    return update.with_cursor(cursor)


def redacted(url: str) -> str:
    """`url` with its password shown as `***`: what logs, errors and the startup line may
    print of a bus URL (its secret opens the shared store to anyone who reads them)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
