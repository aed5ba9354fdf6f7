"""Graph rewrites, onnx -> onnx, with no onnxruntime: each takes a graph and returns one,
or None with a logged reason when the graph is not of a shape it knows.

- `merged_split`: the merged decoder's `If` branches as two standalone graphs;
- `masks`: a decoder that takes a per-row attention mask and positions (continuous batching);
- `per_token`: int8 activations quantized per token (rows independent of their batch);
- `head`: a decoder cut at its vocabulary projection (run on threads of its own);
- `shapes`: shape computations made constant where provable (fewer nodes per call),
  over the symbolic shapes of `symbolic`;
- `graph`: what they share (loading, a view of producers, consumers and constants).

Each KV backend's own rewrites live in its package (`engine.model.kv.inplace.rewrite`,
`engine.model.kv.slots.rewrite`).

The loader (`engine.model.load`) applies them and `engine.model.checks` compares the result
with the original before anything runs it.
"""
