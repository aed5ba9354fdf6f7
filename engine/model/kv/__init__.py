"""KV backends: where a continuous batch's rows keep their decoder state between calls,
each end to end in its own package, behind one interface (`base.KvBackend`) that the one
continuous batch (`engine.decoding.continuous`) drives: prefill and join rows, step them,
keep them (in a new order, with what they confirmed ahead), release them, their state's
bytes, settle, and how many tokens a step may feed ahead.

    base.py      the interface, what its calls take (`Newcomer`) and return (logits, or
                 the model's choice: `Positions`)
    lockstep.py  the stock decoder graphs, whose rows advance together (not `ragged`:
                 the batch joins newcomers only when empty, no draft, no lookahead)
    copied.py    the state handed to every step and returned one position longer (the
                 masked decoder's own step; arrays.py: its rows' arrays)
    inplace/     lane buffers each step reads and extends in place, the CPU's default:
                 rewrite (the step's graph pass), steps (its sessions, load-time check and
                 I/O binding), rows (the lane's buffers)
    slots/       a KV slot per row in a pool allocated at start, a GPU's default: rewrite
                 (the graph passes), pool (buffers, sessions, load-time check, bindings),
                 graphed (CUDA graphs), rows (each row's slot), manager (the free list)

Which one a model runs is chosen once, at load (`engine.model.backend.select_backend`).
"""
