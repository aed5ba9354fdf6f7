"""Transcript logs: what a replay reads, in one JSON Lines format (`format`), and the tools
that make them: synthetic logs from parallel text (`make`), recogniser stability hints
(`hints`) and several streams' logs merged into one (`merge`). How a log's partials change
is measured in `engine.evaluation.revisions`.
"""
