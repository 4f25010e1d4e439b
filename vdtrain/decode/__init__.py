"""Decoding: the one sampling pipeline, AR generation, the speculative engine and its parts (draft-tree
builders, acceptance rules, verification schedules), and the methods made of them (``methods``)."""
