"""The private Lightning members vdtrain overrides or sets, in one place. Lightning may change them in any
release without notice, so ``pyproject.toml`` caps ``lightning`` below the next minor version and
tests/test_lightning_private.py checks each one against the installed Lightning, naming what changed.
Raise the cap only with that test passing on the new release.
"""

from __future__ import annotations

# (class, method, its parameter names) for the methods vdtrain overrides or calls
METHODS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # FiniteCheckpoint overrides it to refuse non-finite weights (train/checkpointing.py)
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_save_checkpoint", ("self", "trainer", "filepath")),
    # FiniteCheckpoint._save_last_now calls these two to write last.ckpt on SIGTERM, Ctrl-C, SIGUSR1
    (
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "_save_last_checkpoint",
        ("self", "trainer", "monitor_candidates"),
    ),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_monitor_candidates", ("self", "trainer")),
    # AppendingWriter overrides it to keep an existing metrics.csv (train/csv_log.py)
    ("lightning.pytorch.loggers.csv_logs.ExperimentWriter", "_check_log_dir_exists", ("self",)),
)
# (class, attribute) for the private state vdtrain reads or sets
ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_last_global_step_saved"),  # FiniteCheckpoint
    ("lightning.pytorch.Trainer", "_signal_connector"),  # CtrlC sets its received_sigterm
    ("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "received_sigterm"),
    ("lightning.pytorch.loggers.CSVLogger", "_experiment"),  # AppendingCSVLogger.experiment
    ("lightning.pytorch.loggers.CSVLogger", "_fs"),
)
