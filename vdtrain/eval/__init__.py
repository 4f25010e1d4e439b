"""Evaluation: one runner for every method (speed vs AR, quality), result tables, plots, the
after-epoch callback."""
