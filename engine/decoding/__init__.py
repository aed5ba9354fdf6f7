"""Decoding: searches as per-request state, batches, one scheduler per model (a policy
and the engine running it), `Translator`."""
