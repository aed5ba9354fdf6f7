"""The in-place KV backend: each layer's self-attention keys and values in lane buffers
that a step reads and extends where they are (`GroupQueryAttention`). `rewrite` makes the
step's graph, `steps` opens and checks it and keeps its I/O binding, `rows` keeps a lane's
buffers."""
