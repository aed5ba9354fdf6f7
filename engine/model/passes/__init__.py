"""Graph rewrites, onnx -> onnx, that need no onnxruntime: each takes a graph and returns one."""
