"""Draft-tree builders, written as batched tensor programs (no per-row or per-node host work).

``base`` holds the interface the engine's loop calls; ``static`` (EAGLE-1, LANTERN++), ``dynamic``
(EAGLE-2), ``peanut`` (PEANUT's adaptive dynamic trees), ``jacobi`` (SJD) and ``sjd_pac`` (SJD-PAC) the
builders. ``vdtrain.decode.methods`` picks one per method preset.
"""
