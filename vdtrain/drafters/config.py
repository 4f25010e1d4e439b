"""A drafter's configuration: its shape, the target it must match, its kind and that kind's options.

``DrafterConfig`` is what ``config.json`` of an export folder holds and what a Lightning checkpoint keeps
beside the weights, so a saved drafter rebuilds without its target. Its ``options`` are an instance of
the kind's own options dataclass (``Drafter.Options``: an eagle3 drafter's fused layers and norms, a
Medusa drafter's heads); ``to_dict`` / ``from_dict`` write and read them as a JSON object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vdtrain.config import DrafterTrainConfig
from vdtrain.drafters.registry import drafter_class
from vdtrain.targets import draft_layer_class
from vdtrain.targets.base import DraftLayer, Target, TargetIdentity

# What a config written before drafter kinds existed holds (no ``kind`` key): every drafter was one.
KIND_BEFORE_KINDS = "eagle1"
# Top-level keys of LlamaGen drafter configs written before ``DrafterConfig.layer`` (still read).
LLAMAGEN_LAYER_FIELDS = (
    "n_head",
    "n_kv_head",
    "multiple_of",
    "ffn_dim_multiplier",
    "norm_eps",
    "rope_base",
    "caption_rope",
)


def kind_options(kind: str, given: Mapping[str, Any] | Any) -> Any:
    """``given`` (a mapping, or the kind's options already) as drafter ``kind``'s options dataclass; a key
    the kind does not have is refused naming the kind's own (the one place that checks it)."""
    options_class = drafter_class(kind).Options
    if isinstance(given, options_class):
        return given
    if not isinstance(given, Mapping):
        raise ValueError(f"{kind} options must be a mapping, got {type(given).__name__}")
    known = [f.name for f in dataclasses.fields(options_class)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"{unknown} are not {kind} options; its options: {known}")
    try:
        return options_class(**given)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{kind} options {dict(given)}: {err}") from err


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter's shape plus what it must match in its target (``target`` = the identity dict).

    ``layer`` holds the hyper-parameters of the target family's ``DraftLayer`` (``settings_fields``):
    heads and FFN width for LlamaGen, heads, FFN and norms for Chameleon. ``options`` are the kind's
    (``Drafter.Options``; a mapping is turned into them).
    """

    hidden_size: int
    prefix_length: int
    grid: tuple[int, int]
    vocab_size: int
    family: str = "llamagen"
    layer: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)
    kind: str = DrafterTrainConfig.kind  # a key of vdtrain.drafters.registry.DRAFTERS
    options: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        # JSON turns tuples into lists: normalise so a round trip compares equal.
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        object.__setattr__(self, "layer", dict(self.layer))
        object.__setattr__(self, "options", kind_options(self.kind, self.options))
        if self.target:
            target = dict(self.target)
            if "grid" in target:
                target["grid"] = tuple(int(g) for g in target["grid"])
            object.__setattr__(self, "target", target)
        if len(self.grid) != 2:
            raise ValueError(f"grid must be (height, width), got {self.grid}")
        if self.prefix_length < 1:
            raise ValueError(f"prefix_length must be >= 1, got {self.prefix_length}")
        self.layer_class.check(self.hidden_size, self.grid, self.layer)
        if self.target:
            # The recorded identity must agree with the shape the drafter was built for.
            record = {
                "family": self.family,
                "hidden_size": self.hidden_size,
                "vocab_size": self.vocab_size,
                "grid": self.grid,
                "prefix_length": self.prefix_length,
            }
            bad = [
                f"{k}: {v!r} vs target {self.target.get(k)!r}"
                for k, v in record.items()
                if self.target.get(k) != v
            ]
            if bad:
                raise ValueError(
                    "drafter config disagrees with its recorded target identity: " + "; ".join(bad)
                )
        drafter_class(self.kind).check(self)

    @property
    def layer_class(self) -> type[DraftLayer]:
        return draft_layer_class(self.family)

    @property
    def num_image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def max_seq_len(self) -> int:
        return self.prefix_length + self.num_image_tokens

    @property
    def target_layers(self) -> int | None:
        """The recorded target's decoder layers (None where not recorded)."""
        return self.target.get("num_layers") if self.target else None

    def identity(self) -> TargetIdentity | None:
        return TargetIdentity(**self.target) if self.target else None

    @classmethod
    def for_target(
        cls,
        target: Target,
        kind: str = DrafterTrainConfig.kind,
        layer: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> DrafterConfig:
        """A new ``kind`` drafter of ``target``'s family, with the target's own layer hyper-parameters.

        ``layer`` may change the family layer's ``settings_fields`` (heads, FFN size, ...), never the
        width. ``options`` (None: not given) set the kind's options over its defaults for a new drafter
        of this target (``Drafter.options_for``: eagle3 fuses the family's choice of layers).
        """
        ident, owner = target.identity, drafter_class(kind)
        layer_class = draft_layer_class(ident.family)
        overrides = dict(layer or {})
        unknown = sorted(set(overrides) - set(layer_class.settings_fields))
        if unknown:
            raise ValueError(
                f"cannot override {unknown} of a {ident.family} drafter layer; "
                f"allowed: {list(layer_class.settings_fields)}"
            )
        given = {k: v for k, v in options.items() if v is not None}
        kind_options(kind, given)  # an unknown key is refused before the target's defaults mix in
        return cls(
            hidden_size=ident.hidden_size,
            prefix_length=ident.prefix_length,
            grid=ident.grid,
            vocab_size=ident.vocab_size,
            family=ident.family,
            layer={**layer_class.settings_of(target), **overrides},
            target=dataclasses.asdict(ident),
            kind=kind,
            options={**owner.options_for(target), **given},
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (tuples become lists; ``from_dict`` restores them); no ``options`` for a kind with
        none."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layer"], out["target"] = dict(self.layer), dict(self.target)
        options = _json_ready(dataclasses.asdict(self.options))
        out["options"] = options
        if not options:
            del out["options"]
        out["grid"] = list(self.grid)
        if "grid" in out["target"]:
            out["target"]["grid"] = list(out["target"]["grid"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DrafterConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"a drafter config is a JSON object, got {type(data).__name__}")
        data = _nest_legacy_layer(data)
        data.setdefault("kind", KIND_BEFORE_KINDS)
        data = _nest_legacy_options(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown drafter config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as err:  # a required key missing, or a value of the wrong type (a number for grid)
            raise ValueError(f"incomplete or mistyped drafter config: {err}") from err


def _json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_json_ready(v) for v in value]
    return value


def _nest_legacy_layer(data: Mapping[str, Any]) -> dict[str, Any]:
    """Configs written before ``layer`` existed kept LlamaGen's layer fields at the top level."""
    data = dict(data)
    if "layer" not in data and data.get("family", "llamagen") == "llamagen":
        legacy = [name for name in LLAMAGEN_LAYER_FIELDS if name in data]
        if legacy:
            data["layer"] = {name: data.pop(name) for name in legacy}
    return data


# What configs written before a kind's options were its own kept at the top level: eagle3's settings,
# written by every kind (another kind's at these defaults).
LEGACY_TOP_LEVEL_OPTIONS = {"feature_layers": [], "input_norm": False, "tap_norm": False}


def _nest_legacy_options(data: dict[str, Any]) -> dict[str, Any]:
    """``LEGACY_TOP_LEVEL_OPTIONS`` found at the top level go into ``options`` where the kind has them;
    another kind's, at their defaults, are dropped."""
    top = {name: data.pop(name) for name in LEGACY_TOP_LEVEL_OPTIONS if name in data}
    if not top:
        return data
    kind = data["kind"]
    own = {f.name for f in dataclasses.fields(drafter_class(kind).Options)}
    foreign = sorted(k for k, v in top.items() if k not in own and v not in (LEGACY_TOP_LEVEL_OPTIONS[k], ()))
    if foreign:
        raise ValueError(f"{foreign} are not {kind} options")
    data["options"] = {**{k: v for k, v in top.items() if k in own}, **dict(data.get("options") or {})}
    return data
