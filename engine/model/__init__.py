"""The ONNX layer: model files, graph passes (onnx -> onnx), load-time checks and sessions.

Imports nothing above it. The layers above import the names below from `engine.model`,
never its modules, so that the layer can be rearranged inside without touching them.

    names.py     the one table of file, input and output names
    passes/      graph rewrites, no onnxruntime: merged split, masks, per token, head
    checks.py    load-time checks: signatures, and every rewrite probed against its original
    sessions.py  `RuntimeOptions` and how a session is opened
    layouts.py   one class per decoder layout, and what the calls exchange
    load.py      choose the files once -> passes -> checks -> sessions
    marian.py    `MarianOnnx`: encode, prefill, step
    config.py  tokenizer.py
"""
