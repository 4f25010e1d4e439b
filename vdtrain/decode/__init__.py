"""Decoding: the one sampling pipeline, AR generation and (later) the speculative engine."""
