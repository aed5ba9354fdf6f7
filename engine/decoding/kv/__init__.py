"""KV backends: where a continuous batch's rows keep their decoder state between calls,
behind one interface (`base.KvBackend`) that the one continuous batch
(`engine.decoding.continuous`) drives: prefill and join rows, step them, keep them (in a
new order, with what they confirmed ahead), release them, their state's bytes, settle.

    base.py      the interface and what its calls return (logits, or the model's choice)
    copied.py    the state handed to every step and returned one position longer
    inplace.py   lane buffers each step reads and extends in place (the CPU's default)
    slots.py     a KV slot per row, in a pool allocated at start (a GPU's default)

Which one a model runs is chosen once, at load (`engine.model.backend.select_backend`);
`engine.decoding.backends` builds it.
"""
