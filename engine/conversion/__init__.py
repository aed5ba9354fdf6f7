"""Conversion of MarianMT checkpoints into the ONNX files the engine runs.

Build-time only: torch, transformers and optimum are imported inside the functions that
need them, so importing this package (or the runtime) never pulls them in.
"""
