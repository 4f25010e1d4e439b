"""Which drafter each method decodes with, decided before anything decodes.

An evaluation may ask for presets that need different drafter kinds (eagle2 drafts with an EAGLE head, a
block tree with a drafter that drafts blocks). By default each preset decodes with the first of the
target's shipped drafters that can serve it (``target.drafter``, then ``target.more_drafters``); a drafter
the user gave is checked against every requested preset first, and where it cannot serve one the error
names the shipped drafter that would. The check is the builder's own (``check_drafter``); evaluate's
preflight (``vdtrain.preflight.drafter_serves``) makes the part of it a drafter's config decides first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vdtrain.decode.methods import DecodeConfig, tree_builder
from vdtrain.drafters.base import Drafter
from vdtrain.preflight import cannot_serve


def refusal(config: DecodeConfig, drafter: Drafter) -> str | None:
    """Why ``drafter`` cannot serve method ``config``; None where it can (or the method needs none)."""
    if not config.needs_drafter:
        return None
    try:
        tree_builder(config.tree).check_drafter(drafter)
    except ValueError as err:
        return str(err)
    return None


def _shipped_refusal(config: DecodeConfig, source: str, load: Callable[[str], Drafter]) -> str | None:
    """``refusal`` for one of the target's shipped drafters; one that cannot be loaded for this target
    (another family's, a missing file) serves nothing."""
    try:
        drafter = load(source)
    except (ValueError, OSError) as err:
        return str(err)
    return refusal(config, drafter)


def drafters_for(
    configs: Sequence[DecodeConfig],
    given: str | None,
    shipped: Sequence[str],
    load: Callable[[str], Drafter],
) -> dict[str, str]:
    """Method name -> the drafter source it decodes with, for every method that needs one.

    ``given``: the drafter the user named (None: the target's own); ``shipped``: the target's drafters,
    its default first; ``load``: a source's drafter (called at most once per source by the caller's cache).
    """
    needy = [c for c in configs if c.needs_drafter]
    if not needy:
        return {}
    if given is None and not shipped:
        names = [c.name for c in needy]
        raise ValueError(f"methods {names} need a drafter: set drafter=<export folder, .ckpt or Hub repo id>")
    out: dict[str, str] = {}
    for config in needy:
        if given is not None:
            why = refusal(config, load(given))
            if why is None:
                out[config.name] = given
                continue
            serving = next((s for s in shipped if s != given and not _shipped_refusal(config, s, load)), None)
            raise cannot_serve(given, config.name, why, serving)
        reasons = []
        for source in shipped:
            why = _shipped_refusal(config, source, load)
            if why is None:
                out[config.name] = source
                break
            reasons.append(f"{source}: {why}")
        else:
            raise ValueError(
                f"none of this target's drafters can decode {config.name} ({'; '.join(reasons)}): "
                "give one that can with drafter=, or leave the method out"
            )
    return out
