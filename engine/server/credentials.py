"""Who may do what, decided once at the handshake.

`Credentials` (the server's secrets) turn the token a client presents into its `Access`
(write every stream, one stream, watch), and the connection's core checks every message
against it, so a viewer's credential never writes, closes or takes over a stream whatever
it sends. Sans I/O: the handshake's path and headers in, an `Access` or a `Refusal` out.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from engine.server.handshake import Refusal
from protocol import InvalidMessage, Subscribe


def presented_token(path: str, authorization: str | None) -> str | None:
    """The token a request carries: `Authorization: Bearer X`, else `?token=X`.

    The query form exists because browsers cannot set headers on a WebSocket.
    """
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and credentials.strip():
            return credentials.strip()
    values = parse_qs(urlsplit(path).query).get("token")
    return values[0] if values else None


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing does not leak the secret."""
    given = (presented or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected.encode("utf-8"))


@dataclass(frozen=True)
class Access:
    """What one connection may do, from the credential its handshake presented.

    `credential` names it (`writer`, `stream_key`, `viewer`, `none`). `write`: streams
    without a key of their own; `write_keyed`: those with one too (the writer token);
    `keys`: the streams whose key it presented; `keyed`: every stream that has a key.
    The default may do everything a server without secrets allows.
    """

    credential: str = "none"
    view: bool = True
    write: bool = True
    write_keyed: bool = False
    keys: frozenset[str] = frozenset()
    keyed: frozenset[str] = frozenset()

    def may_write(self, stream_id: str) -> bool:
        """May it push partials to, close or take over `stream_id`?"""
        if stream_id in self.keys:
            return True
        if stream_id in self.keyed:
            return self.write_keyed
        return self.write

    def may_view(self, stream_id: str) -> bool:
        return self.view or stream_id in self.keys


@dataclass(frozen=True)
class Credentials:
    """Who may write, who may watch, who may read `/metrics`: the server's secrets.

    `writer` (`--token`) writes and watches every stream; without it anyone may write
    (streams with a key excepted). `viewer` (`--viewer-token`) watches; without it anyone
    may watch. `stream_keys` maps a stream id to a key that writes that stream alone
    (with the writer token, nothing else does). `metrics` guards `/metrics` (without it
    the writer token does). A viewer credential never writes, closes or takes over a
    stream, so a subtitle page's URL can be handed to an audience.
    """

    writer: str | None = None
    viewer: str | None = None
    stream_keys: Mapping[str, str] = field(default_factory=dict)
    metrics: str | None = None

    def __post_init__(self) -> None:
        for name, secret in (("token", self.writer), ("viewer token", self.viewer)):
            if secret is not None and not secret:
                raise ValueError(f"the {name} must not be empty")
        if self.metrics is not None and not self.metrics:
            raise ValueError("the metrics token must not be empty")
        keys: dict[str, str] = {}
        for stream_id, key in self.stream_keys.items():
            if not key:
                raise ValueError(f"the key of stream {stream_id!r} must not be empty")
            if self.writer is not None and key == self.writer:
                raise ValueError(f"the key of stream {stream_id!r} is the writer token")
            try:  # ids as the server compares them: valid, in NFC
                keys[Subscribe(stream_id).stream_id] = key
            except InvalidMessage as exc:
                raise ValueError(f"--stream-key: {exc}") from None
        object.__setattr__(self, "stream_keys", keys)
        if self.viewer is not None and self.viewer in {self.writer, *keys.values()}:
            raise ValueError("the viewer token must differ from every writer secret")

    @property
    def any(self) -> bool:
        """Whether `/ws` knows any secret (without one, a presented token is ignored)."""
        return self.writer is not None or self.viewer is not None or bool(self.stream_keys)

    def access(self, presented: str | None) -> Access | None:
        """What a handshake presenting `presented` may do; None: refuse it (401).

        A credential adds to what anyone may do; a presented one that matches nothing is
        refused even where anyone may watch, so that a misconfigured writer hears so at
        once. Every secret is compared (in constant time), whichever matches.
        """
        keyed = frozenset(self.stream_keys)
        anyone = Access("none", self.viewer is None, self.writer is None, keyed=keyed)
        if presented is None or not self.any:
            return anyone if (anyone.view or anyone.write) else None
        writer = self.writer is not None and token_matches(presented, self.writer)
        keys = frozenset(
            [sid for sid, key in self.stream_keys.items() if token_matches(presented, key)]
        )
        viewer = self.viewer is not None and token_matches(presented, self.viewer)
        if writer:
            return Access("writer", True, True, write_keyed=True, keyed=keyed)
        if keys:
            return Access("stream_key", anyone.view, anyone.write, keys=keys, keyed=keyed)
        if viewer:
            return Access("viewer", True, anyone.write, keyed=keyed)
        return None

    def metrics_allowed(self, presented: str | None) -> bool:
        """`/metrics`: its own token, else the writer's, else open (never the viewer's)."""
        guard = self.metrics if self.metrics is not None else self.writer
        return guard is None or token_matches(presented, guard)


UNAUTHORIZED = Refusal(401, "Missing or wrong token.\n", (("WWW-Authenticate", "Bearer"),))


def authorize(
    path: str,
    authorization: str | None,
    origin: str | None,
    *,
    credentials: Credentials,
    allowed_origins: frozenset[str] | None,
) -> Refusal | Access:
    """Decide whether a WebSocket handshake may proceed, and with what rights.

    Origin is checked only when an allowlist is set and a browser sent one: a speech
    pipeline sends no Origin and is held to the token instead. Authentication comes
    first, so an unauthenticated client learns nothing about the allowlist.
    """
    access = credentials.access(presented_token(path, authorization))
    if access is None:
        return UNAUTHORIZED
    if allowed_origins is not None and origin is not None and origin not in allowed_origins:
        return Refusal(403, "Origin not allowed.\n")
    return access
