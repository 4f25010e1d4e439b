"""How the apps end on a user's mistake: one line naming the problem, exit status 2.

A bad config value, an unknown config group or key, a missing or mismatched checkpoint, a bad prompt
file or shard, a refused option or a missing optional package is the user's to fix, and the message says
how; a traceback with Hydra's footer buries that line. ``HYDRA_FULL_ERROR=1`` or ``debug=true`` keeps the
full traceback. Anything else (a bug) still raises with its traceback.

``run_app`` composes the configuration as Hydra will and runs the app's cheap checks (``vdtrain.preflight``)
before Hydra makes an output folder and before the app imports torch or Lightning: the common mistakes
are reported in about a second. This module imports neither.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from vdtrain.paths import CONF_DIR

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
# When the app started: an output folder whose every entry is newer was made by this launch.
LAUNCHED = time.time()
# Errors raised for what a user gave: values, files, checkpoints, shards, packages, config types.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ImportError,
    OmegaConfBaseException,
    HydraException,  # an unknown config group option or key, found while composing
    FloatingPointError,  # a non-finite loss or weights: the message names the step and what to change
)
# The same, from modules too heavy to import here; one that was never imported raised nothing.
LAZY_USER_ERRORS = {
    "vdtrain.checkpoint_io": "CheckpointError",
    "vdtrain.data.shards": "ShardError",
    "lightning.fabric.utilities.exceptions": "MisconfigurationException",
}

R = TypeVar("R")
log = logging.getLogger(__name__)


class NothingToDo(Exception):
    """What a command asked for is already done (a resume of a finished run): its message is printed
    and the app exits 0, changing nothing."""


def is_user_error(err: BaseException) -> bool:
    lazy = tuple(getattr(sys.modules[m], name) for m, name in LAZY_USER_ERRORS.items() if m in sys.modules)
    return isinstance(err, USER_ERRORS + lazy)


def one_line(err: BaseException) -> str:
    """The error's message on one line: a DataLoader worker's copy keeps only the original message, a
    Hydra composition error adds OmegaConf's reason, and a list under a ``...:`` line is comma-joined."""
    text = str(err)
    if "Original Traceback" in text:  # torch re-raises a worker's error with the worker's traceback
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = "in a DataLoader worker: " + last.split(": ", 1)[-1]
    if isinstance(err, HydraException) and err.__cause__ is not None:
        text += "\n" + str(err.__cause__).splitlines()[0]
    text = text.split("Config search path:")[0]  # Hydra's where-I-looked footer
    parts: list[str] = []
    listing = False  # the lines after one ending in ":" are its items
    for line in (line.strip() for line in text.splitlines()):
        if not line:
            continue
        if listing:
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
        else:
            parts.append(line)
            listing = line.endswith(":")
    return "; ".join(p.rstrip(".") for p in parts)


def debug_requested(args: list[str]) -> bool:
    """``HYDRA_FULL_ERROR=1``, or ``debug=`` given a value OmegaConf reads as true (True, TRUE, yes, on)."""
    values = [a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("debug=")]
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or any(
        v.strip().lower() in ("true", "yes", "on", "1") for v in values
    )


def fail(app: str, err: BaseException) -> None:
    print(f"{app}: error: {one_line(err)} (debug=true shows the traceback)", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


def interrupted(app: str, what_is_kept: str) -> None:
    """Ctrl-C: one line saying what is kept and how to go on, not a traceback; exit status 130."""
    print(f"{app}: interrupted (Ctrl-C); {what_is_kept}", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)


def run_app(
    app: str,
    config_name: str,
    entry: Callable[[], object],
    check: Callable[[DictConfig], None],
    *,
    light: Callable[[list[str]], list[str]] | None = None,
    prepare: Callable[[], None] | None = None,
) -> None:
    """Compose ``conf/<config_name>.yaml`` with the command line's overrides, ``check`` it (cheap checks
    only: no model, no heavy import), then run the ``@hydra.main`` ``entry``. Hydra's own flags (``--help``,
    ``--cfg``) go straight to Hydra. Configs may name their output folder by ``${run_name:}``: one for every
    rank of a launch.

    A sweep (``-m``) is checked here too, every job before the first starts: its overrides are expanded into
    the jobs Hydra's sweeper will launch, and each is composed and checked as a single run is. A Hydra
    callback could not do it: Hydra composes the sweep's own configuration before any callback runs (a
    misspelt key ends there, in Hydra's multi-line report), writes ``multirun.yaml`` before the jobs start,
    and a job's callback sees its mistake only after the jobs before it ran, maybe for hours.

    An app whose full configuration needs heavy imports (generate's decode parts) gives ``light``, the
    overrides the cheap composition uses instead of the command line's (it may refuse them too), and
    ``prepare``, which makes the full composition possible; that is then composed once more before
    ``entry``, so its mistakes end as one line too."""
    from vdtrain.config import register_configs

    register_configs()
    args = sys.argv[1:]
    sweep = sweep_overrides(args)
    if sweep is None and any(a.startswith("-") for a in args):
        if prepare is not None:
            prepare()
        entry()
        return
    from hydra import compose, initialize_config_dir

    jobs: list[list[str]] = []
    number, finished = None, []
    try:
        jobs = [args] if sweep is None else sweep_jobs(sweep)
        for number, job in enumerate(jobs):
            try:
                check_job(config_name, job, check, light, None if sweep is None else number)
            except NothingToDo as done:
                if sweep is None:
                    raise
                finished.append(f"sweep job #{number}: {done}")
        if prepare is not None:  # every job's cheap checks first: they are the quick ones
            number = None  # a missing package is no job's
            prepare()
            for number in range(len(jobs)):  # the number names the job in an error
                with initialize_config_dir(str(CONF_DIR), version_base=None):
                    compose(config_name, overrides=jobs[number])
    except KeyboardInterrupt:
        interrupted(app, "nothing was started")
    except NothingToDo as done:
        print(f"{app}: {done}")
        sys.exit(0)
    except Exception as err:
        if not is_user_error(err) or debug_requested(args):
            raise
        job = args if number is None else jobs[number]
        err = plain_key_error(err, config_name, job, light) or err
        fail(app, err if sweep is None or number is None else SweepJobError(jobs, number, err))
    if finished and len(finished) == len(jobs):  # a resumed sweep: the task skips a finished job itself
        print("\n".join(f"{app}: {line}" for line in finished))
        sys.exit(0)
    entry()


def check_job(
    config_name: str,
    overrides: list[str],
    check: Callable[[DictConfig], None],
    light: Callable[[list[str]], list[str]] | None,
    number: int | None,
) -> None:
    """``run_app``'s cheap checks of one launch: a single run (``number`` None) or job ``number`` of a
    sweep, composed as Hydra's launcher will compose it (``hydra.mode=MULTIRUN``, its ``hydra.job.num``), so
    that ``check`` finds the job's own folder (``vdtrain.preflight.run_folder``)."""
    from hydra import compose, initialize_config_dir

    job = [] if number is None else ["hydra.mode=MULTIRUN", f"hydra.job.num={number}"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose(
            config_name, overrides=(light(overrides) if light else overrides) + job, return_hydra_config=True
        )
    check(cfg)


MULTIRUN_FLAGS = ("-m", "--multirun")


def sweep_overrides(args: list[str]) -> list[str] | None:
    """A sweep's overrides (``-m``/``--multirun``, or ``hydra.mode=MULTIRUN``) without its flag; None for a
    single run, and for a sweep with other flags or another sweeper (``hydra/sweeper=``, sweeper params),
    which goes to Hydra unchecked: only the basic sweeper's jobs can be listed before it runs."""
    flags = [a for a in args if a.startswith("-")]
    multirun = bool(flags) or "hydra.mode=MULTIRUN" in args
    if not multirun or any(f not in MULTIRUN_FLAGS for f in flags):
        return None
    if any(a.startswith(("hydra/sweeper=", "hydra.sweeper.params")) for a in args):
        return None
    return [a for a in args if a not in MULTIRUN_FLAGS and a != "hydra.mode=MULTIRUN"]


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Each job's overrides, numbered as Hydra will number them (the number names the job's folder): the
    basic sweeper's own expansion (a cartesian product of ``a=1,2``, ``range()``, ``glob()`` ...), from the
    module Hydra launches it from (private, but hydra-core is capped below 1.4 and
    ``tests/test_sweeps.py`` pins the order it gives)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides(overrides)
    swept_hydra = [o.input_line for o in parsed if o.is_sweep_override() and o.is_hydra_override()]
    if swept_hydra:  # Hydra refuses it only after making the sweep's folder
        raise ValueError(f"{swept_hydra[0]}: a sweep cannot vary Hydra's own settings (hydra.*)")
    return [list(job) for job in BasicSweeper.split_arguments(parsed, None)[0]]


class SweepJobError(ValueError):
    """A user error in one job of a sweep: the message names the job by its number and the values that
    set it apart from the others."""

    def __init__(self, jobs: list[list[str]], number: int, err: BaseException) -> None:
        varies = {o.split("=", 1)[0] for job in jobs for o in job if any(o not in other for other in jobs)}
        values = " ".join(o for o in jobs[number] if o.split("=", 1)[0] in varies)
        super().__init__(f"sweep job #{number}{f' ({values})' if values else ''}: {one_line(err)}")


def plain_key_error(
    err: BaseException, config_name: str, args: list[str], light: Callable[[list[str]], list[str]] | None
) -> ValueError | None:
    """Hydra's refusal of a plain ``key=value`` whose key the config lacks advises ``+key=value``, which a
    typed config refuses in turn and an untyped one ignores: instead, the key and the config's keys
    closest to it (composed without it)."""
    found = _CANNOT_OVERRIDE.search(str(err))
    if found is None:
        return None
    key = found.group(1)
    rest = [a for a in args if a.lstrip("~+").split("=", 1)[0] != key]
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            cfg = compose(config_name, overrides=light(rest) if light else rest)
    except Exception:  # another mistake too: it is reported once this one is fixed
        return ValueError(f"unknown config key {key!r}")
    close = closest_keys(key, list(_dotted(cfg)))
    hint = f"did you mean {', '.join(close)}?" if close else "see conf/ for the keys this app takes"
    return ValueError(f"unknown config key {key!r} ({hint})")


_CANNOT_OVERRIDE = re.compile(r"Could not override '([^']+)'")


def closest_keys(key: str, keys: list[str]) -> list[str]:
    """The dotted ``keys`` nearest ``key``: whole paths first, else the same last name anywhere."""
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if close:
        return close
    leaves = {k: k.rsplit(".", 1)[-1] for k in keys}
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(set(leaves.values())), n=3, cutoff=0.75)
    return [k for k, leaf in leaves.items() if leaf in near][:3]


def _dotted(node: object, prefix: str = "") -> list[str]:
    """Every key of a composed config as a dotted path (Hydra's own section left out)."""
    out: list[str] = []
    for key, child in node.items_ex(resolve=False) if isinstance(node, DictConfig) else []:
        if prefix == "" and key == "hydra":
            continue
        out.append(f"{prefix}{key}")
        out += _dotted(child, f"{prefix}{key}.")
    return out


def user_errors(
    app: str, kept: Callable[[DictConfig], str] | None = None
) -> Callable[[Callable[[DictConfig], R]], Callable[[DictConfig], R]]:
    """Decorate a Hydra task function (under ``@hydra.main``): a user error prints
    ``<app>: error: <message>`` to stderr and exits with status 2; Ctrl-C prints one line with what
    ``kept(cfg)`` says is kept and how to go on, exit status 130. An output folder this launch made and
    left with nothing but Hydra's records is removed; one that stays gets the error in its log."""

    def wrap(task: Callable[[DictConfig], R]) -> Callable[[DictConfig], R]:
        @functools.wraps(task)
        def run(cfg: DictConfig) -> R:
            try:
                return task(cfg)
            except BaseException as err:
                debug = os.environ.get("HYDRA_FULL_ERROR") == "1" or cfg.get("debug")
                if isinstance(err, KeyboardInterrupt) and not debug:
                    removed = settle_output(f"{app}: interrupted (Ctrl-C)")
                    interrupted(app, kept(cfg) if kept and not removed else "nothing was kept")
                if not is_user_error(err) or debug:
                    raise
                settle_output(f"{app}: error: {one_line(err)}")
                fail(app, err)
                raise  # unreachable: fail exits

        return run

    return wrap


def sweep_job_folder(key: str) -> Callable[[Callable[[DictConfig], R]], Callable[[DictConfig], R]]:
    """Decorate a Hydra task whose output folder is ``cfg.<key>`` (its config's ``hydra.run.dir: ${<key>}``):
    in a sweep (``-m``) each job's own folder, Hydra's ``hydra.sweep.dir``/``hydra.sweep.subdir``
    (``<key>/<job number>`` in the app's config), replaces it, so that no two jobs write one folder."""

    def wrap(task: Callable[[DictConfig], R]) -> Callable[[DictConfig], R]:
        @functools.wraps(task)
        def run(cfg: DictConfig) -> R:
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode

            if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
                cfg[key] = HydraConfig.get().runtime.output_dir
            return task(cfg)

        return run

    return wrap


def job_arguments() -> list[str]:
    """This launch's command-line arguments; for a job of a sweep, the job's own overrides as Hydra recorded
    them (its values, not the sweep's lists): the command that redoes that job alone."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return sys.argv[1:]
    overrides = HydraConfig.get().overrides
    return [*overrides.task, *(o for o in overrides.hydra if not o.startswith("hydra.mode="))]


def _made_now(folder: Path) -> bool:
    """Every entry is newer than the launch (stops at the first older one: ``folder`` may be the cwd)."""
    return all(p.stat().st_mtime >= LAUNCHED for p in itertools.chain([folder], folder.rglob("*")))


def settle_output(message: str) -> bool:
    """Remove Hydra's output folder if this launch made it and it holds only records and logs (True);
    else write ``message`` to the app's log file there (False)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    folder = Path(HydraConfig.get().runtime.output_dir)
    records_only = folder.is_dir() and _made_now(folder)
    if records_only and all(p.is_dir() or p.suffix in (".log", ".yaml") for p in folder.rglob("*")):
        logging.shutdown()
        shutil.rmtree(folder)
        _no_empty_sweep()
        return True
    record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    return False


def _no_empty_sweep() -> None:
    """A sweep whose first job ended with nothing kept: its folder, made by this launch, would hold only
    Hydra's ``multirun.yaml``; it goes too."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    sweep = Path(hydra.sweep.dir)
    made_now = hydra.mode == RunMode.MULTIRUN and sweep.is_dir() and _made_now(sweep)
    if made_now and [p.name for p in sweep.iterdir()] == ["multirun.yaml"]:
        shutil.rmtree(sweep)
