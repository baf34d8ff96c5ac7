"""Tensors moving between files: ``items`` (what to write), ``spans`` (tensor ranges as byte reads),
``fill`` and ``pipeline`` (reads overlapped with casts and writes, memory bounded by a budget), ``flat``,
``window``, ``shards`` (splitting an output into files of at most N bytes) and ``integrity`` (the problems a
verify reports). It knows no checkpoint format.
"""
