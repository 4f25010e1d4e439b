"""DeepSpeed ZeRO checkpoint folders (what ``trainer=deepspeed_stage_{2,3}`` writes as ``last.ckpt/``):
recognised, checked whole, and gathered into full fp32 weights.

Under ZeRO each rank writes only its partition of the fp32 master weights (``*_optim_states.pt``); the
model-states file beside them holds Lightning's client state (the drafter config, the step) and the
module's weights in the training dtype (bf16 under ``bf16-mixed``), or under ZeRO-3 empty placeholders.
So the drafter is read from the partitions, joined by DeepSpeed's own ``zero_to_fp32``; a folder missing
a rank's files is refused in one line that names the ranks. Torch and DeepSpeed load only when a folder
is read: ``is_zero_checkpoint`` serves the light checks that run before them.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TAG_FILE = "latest"  # DeepSpeed's pointer to the tag folder it wrote last (Lightning's tag: "checkpoint")
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-1/2: one model-states file
ZERO3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"  # ZeRO-3: one per rank
# One per rank; "bf16_" prefixes the files of DeepSpeed's bf16 optimizer.
OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def is_zero_checkpoint(path: Path) -> bool:
    """A folder DeepSpeed's ``save_checkpoint`` wrote: its ``latest`` file, or a tag folder of states."""
    return path.is_dir() and (
        (path / TAG_FILE).is_file()
        or any(path.glob("*/*_model_states.pt"))
        or any(path.glob("*/*_optim_states.pt"))
    )


def is_checkpoint(path: Path) -> bool:
    """A training checkpoint ``resume=`` and ``Drafter.from_pretrained`` take: a Lightning ``.ckpt`` file
    or a DeepSpeed ZeRO folder."""
    return path.is_file() or is_zero_checkpoint(path)


def incomplete(path: Path, why: str) -> Exception:
    from vdtrain.checkpoint_io import CheckpointError

    return CheckpointError(
        f"incomplete DeepSpeed ZeRO checkpoint {str(path)!r}: {why}; copy the whole folder as training "
        "wrote it (every rank's files), or use an earlier checkpoint"
    )


def tag_folder(path: Path) -> Path:
    """The folder of the checkpoint's states: the tag ``latest`` names, else the only tag folder."""
    latest = path / TAG_FILE
    if latest.is_file():
        folder = path / latest.read_text().strip()
        if not folder.is_dir():
            raise incomplete(path, f"{TAG_FILE} names {folder.name!r}, which is not there")
        return folder
    tags = sorted({p.parent for p in path.glob("*/*_states.pt")})
    if len(tags) != 1:
        raise incomplete(path, f"no {TAG_FILE} file, and {len(tags)} tag folders to choose from")
    return tags[0]


def check_zero_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """The tag folder and the model-states file's contents (Lightning's client state and DeepSpeed's
    bookkeeping; ``module`` holds no usable weights under ZeRO-3), after checking that every rank's
    files are there: one ``*_optim_states.pt`` per rank (and one model-states file per rank under
    ZeRO-3), as many as the data-parallel world the run had."""
    import torch

    from vdtrain.checkpoint_io import CheckpointError

    folder = tag_folder(path)
    names = (MODEL_STATES, ZERO3_MODEL_STATES.format(rank=0))
    first = next((folder / n for n in names if (folder / n).is_file()), None)
    if first is None:
        raise incomplete(path, f"{folder.name}/ has no {names[0]} (ZeRO-1/2) or {names[1]} (ZeRO-3)")
    try:
        states = torch.load(first, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a truncated file: say which one
        raise CheckpointError(f"cannot read {str(first)!r}: {err}") from err
    world = int(states.get("dp_world_size", 1))
    ranks = {int(m[1]) for f in folder.iterdir() if (m := OPTIM_STATES.fullmatch(f.name))}
    if first.name != MODEL_STATES:  # ZeRO-3: each rank's model states too
        ranks &= {r for r in range(world) if (folder / ZERO3_MODEL_STATES.format(rank=r)).is_file()}
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise incomplete(path, f"the files of rank(s) {missing} of the {world} that trained are missing")
    return folder, states


def gather_fp32(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full fp32 state dict of the module DeepSpeed trained (gathered from every rank's partition of
    the master weights by DeepSpeed's ``zero_to_fp32``), and the model-states file's contents."""
    from vdtrain.checkpoint_io import CheckpointError

    folder, states = check_zero_checkpoint(path)
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise CheckpointError(
            f"{str(path)!r} is a DeepSpeed ZeRO checkpoint: reading it needs the deepspeed package ({err})"
        ) from err
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
            state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=folder.name)
    except Exception as err:  # a truncated or inconsistent shard: one line naming the folder
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot gather DeepSpeed ZeRO checkpoint {str(path)!r}: {first_line}") from err
    return state, states
