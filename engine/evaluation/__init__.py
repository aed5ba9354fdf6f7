"""Evaluation of streaming translation: units, streaming metrics, how a log's source
changes, peer formats and the HTML report.

Transcript logs themselves (reading, writing, making them) are `engine.logs`.
"""
