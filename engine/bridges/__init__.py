"""Bridges: writer clients that connect a speech recogniser's server to
`nmt-incremental serve`, so that users of WhisperLive, whisper_streaming / SimulStreaming,
Vosk server or a cloud recogniser need no adapter of their own
(`nmt-incremental bridge KIND URL --stream-id ID`).

Each kind has one sans-I/O mapper (`whisperlive.py`, `whisper_streaming.py`, `vosk.py`,
`cloud.py`): feed it the recogniser's messages, get `PartialTranscript` events. The rules
every writer must keep (seq and segment ids that grow, one final per segment, times on one
clock, an interrupted segment closed honestly) are `events.EventWriter`'s, shared by all;
what the recogniser sends is read as untrusted input (`upstream.py`).
`runner.Bridge` is the I/O: the recogniser's connection (or a relayed one, both through
`transport.py`), the audio (`audio.py`), reconnects, and `engine.remote.RemoteTranslator`
towards our server; `options.py` what a bridge is asked to do and what it did.
"""
