"""A CSV logger that appends: a resumed run keeps every row its ``metrics.csv`` already holds.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts, and keeps rows in memory
until every 100th step, so a killed run loses its recent rows too. This one adopts the file's header and
rows, writes each logged row at once, and rewrites the file only when a new column appears (keeping
every row). After a resume, the steps between the checkpoint and the kill appear twice: the later rows
are the resumed run's.
"""

from __future__ import annotations

import csv
import os

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        """Adopt the columns of an existing file instead of deleting it."""
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as file:
                self.metrics_keys = sorted(next(csv.reader(file), []))


class AppendingCSVLogger(CSVLogger):
    def __init__(self, save_dir: str | os.PathLike[str]) -> None:
        super().__init__(save_dir, name="", version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingWriter(log_dir=self.log_dir)
        return self._experiment
