"""Draft-tree builders written as batched tensor programs (no per-row or per-node host work).

Builders subclass ``vdtrain.decode.engine.DraftTreeBuilder``; import them from their modules
(``vdtrain.decode.builders.dynamic``) in code that sits above the engine (``methods``, ``peanut``).
"""
