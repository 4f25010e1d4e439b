"""A line at least every minute while a long decode runs: a redirected log (SLURM, a file) gets no
progress bar, and a CPU decode of a few prompts can take many minutes with nothing else printed."""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Any

from vdtrain.durations import duration

log = logging.getLogger("vdtrain.eval")
# the promise is a line at least once a minute: a loaded machine wakes the thread and runs the lines late
# (61-67 s apart at 60 under load, issue 58), so it beats with room to spare
EVERY_S = 45.0


class Heartbeat:
    """Counts prompts decoded (``update``, as a tqdm bar does, and forwards to ``bar``) and, from a
    daemon thread, logs ``<label>: done/total prompts, <elapsed>`` every ``every`` seconds."""

    def __init__(self, label: str, total: int, bar: Any = None, every: float = EVERY_S) -> None:
        self.label, self.total, self.bar, self.every = label, total, bar, every
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._started = 0.0

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            elapsed = duration(time.monotonic() - self._started)
            log.info("%s: %d/%d prompts, %s so far", self.label, self.done, self.total, elapsed)

    def __enter__(self) -> Heartbeat:
        self._started = time.monotonic()
        log.info("%s: decoding %d prompts", self.label, self.total)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        if kind is None:
            log.info("%s: done in %s", self.label, duration(time.monotonic() - self._started))
