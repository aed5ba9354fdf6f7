"""The ONNX layer: model files, graph passes (onnx -> onnx), load-time checks and sessions.

Imports nothing above it; the layers above import its modules by name.

    names.py     the one table of file, input and output names
    passes/      graph rewrites, no onnxruntime: merged split, masks, per token, head
    checks.py    load-time checks: signatures, and every rewrite probed against its original
    sessions.py  `RuntimeOptions`, the device, and how a session is opened
    files.py     which files a load runs, and the decoder graphs the passes take
    layouts.py   one class per native decoder layout, and what the calls exchange
    logits.py    a graph cut at its output projection, and logits projected as read
    cut.py       cutting a rewritten graph at its output projection, checked
    masked.py    `MaskedDecoder`: the batchable decoder, each row at its own length
    backend.py   `select_backend`: the one place a KV backend is chosen
    kv/          the KV backends, one interface, each end to end in its own package:
                 copied, inplace/, slots/ (graph rewrite, check, sessions, rows)
    load.py      choose the files once -> passes -> checks -> sessions -> KV backend
    marian.py    `MarianOnnx`: encode, prefill, step
    config.py  tokenizer.py
"""
