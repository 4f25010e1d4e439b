"""Durations as people read them in a log line."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """``1h02m``, ``5m12s``, ``40s``."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
