"""Incremental translation of partial transcripts: the layer between decoding and I/O.

`lifecycle` decides each stream's life (admission, ownership, closing) in one table,
`session` translates one stream's events (sans I/O), `policies` choose what becomes
stable, `controller` runs many streams at once (`IncrementalTranslator`), `bus` records
their replies and hands out each stream's life (`UpdateBus`), and `fanout` carries the
replies to this process's writers and viewers (`Subscription`).
"""
