"""Getting real models: the catalog of hub repos, downloads into the Hugging Face cache,
and `--model NAME` resolution (`resolve_model`).

`huggingface_hub` is imported only when the cache or the network is actually used, so that
resolving a plain model directory costs nothing.
"""
