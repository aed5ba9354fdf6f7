"""Live subtitles over WebSocket: the server behind `nmt-incremental serve` and its pages.

`connection` holds the per-connection rules, `credentials` who may write or watch,
`limits` what a connection may send, `state` whether the server takes work, `handshake`
what a request asks for, `admission` the caps on connections (all sans I/O) and `doors`
the listener that applies them (handshake deadline, the descriptor limit), `routes` the
plain HTTP answers (page, assets, health, metrics, the handshake gate), `client` one
connection's I/O (receiving, forwarding subscriptions, sending through its `outbox`, or
at once through `eager` while its sender is idle),
`shutdown` the order of a graceful stop, `app` the `SubtitleServer` that puts them
together on the `websockets` library, `metrics` the Prometheus metrics and `recorder` the
subtitle files of `--record`; the command line is `engine.cli.serve`.
"""
