"""The acceptance report: simulated (teacher-forced) against real (decoded) acceptance, per draft depth.

Validation's ``val/tau_sim`` is a chain estimate from the drafter's top-1 agreement; serving accepts what
a real decode accepts, which can be less. The report sets the two side by side on the same prompts and
draws, per temperature and per depth d = 1..D:

- P_sim(≥d) = Π_{i≤d} a_i, with a_i the agreement at depth i of the drafter teacher-forced on the target's
  own AR samples at that temperature, and τ_sim = 1 + Σ_d P_sim(≥d) (``simulated_tau``, as validation);
- P_real(≥d), the share of the method's verification steps that accepted at least d drafts, τ_real (the
  eval table's τ) and S;
- the null stream's a_d and τ_sim (the same samples under the null condition): every CFG step drafts it
  too, so a drafter weak there loses acceptance no conditional figure shows.

τ_sim − τ_real is the gap (docs/evaluation.md, "Simulated vs real acceptance").
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vdtrain.config import AcceptanceReportConfig
from vdtrain.decode.run import DecodeStats
from vdtrain.drafters.base import Drafter
from vdtrain.drafters.losses import simulated_tau
from vdtrain.eval.quality import QualityConfig
from vdtrain.eval.runner import EvalResult, UnitRecord, evaluate
from vdtrain.eval.table import EvalRow
from vdtrain.sharding import Ranks
from vdtrain.targets.base import Target
from vdtrain.train.agreement import depth_agreement

log = logging.getLogger(__name__)


@dataclass
class DepthRow:
    depth: int
    agreement: float  # a_d: teacher-forced top-1 agreement at draft depth d
    p_sim: float  # Π_{i≤d} a_i
    p_real: float  # share of verification steps that accepted ≥ d drafts (mean over prompts)
    null_agreement: float | None = None  # a_d of the null stream (the same samples, null condition)


@dataclass
class AcceptanceReport:
    """One method at one temperature."""

    method: str
    temperature: float
    depths: list[DepthRow]
    tau_sim: float  # 1 + Σ_{d≤D} P_sim(≥d)
    tau_real: float  # mean tokens committed per verified step (the eval table's τ)
    S: float  # step compression of the same decode
    tau_sim_null: float | None = None  # τ_sim of the null stream's agreements

    @property
    def gap(self) -> float:
        return self.tau_sim - self.tau_real


def real_acceptance(stats: Sequence[DecodeStats], depth: int) -> list[float]:
    """P_real(≥d) for d = 1..depth: per prompt, the share of its verification steps whose accepted length
    (committed − 1) is at least d, averaged over prompts as τ is, so that 1 + Σ over all depths is τ."""
    shares = np.zeros(depth)
    for s in stats:
        accepted = np.asarray(s.committed_per_step) - 1
        if accepted.size:
            shares += [(accepted >= d).mean() for d in range(1, depth + 1)]
    return (shares / len(stats)).tolist()


def build_report(
    method: str,
    temperature: float,
    agreement: Sequence[float],
    row: EvalRow,
    stats: Sequence[DecodeStats],
    null_agreement: Sequence[float] | None = None,
) -> AcceptanceReport:
    """The report from the per-depth agreements (the conditional stream's, and the null stream's if
    given) and the real decode's row and per-prompt stats."""
    p_sim = np.cumprod(agreement).tolist()
    p_real = real_acceptance(stats, len(agreement))
    null = [None] * len(agreement) if null_agreement is None else [float(a) for a in null_agreement]
    chains = zip(agreement, p_sim, p_real, null, strict=True)
    depths = [DepthRow(d + 1, float(a), ps, pr, n) for d, (a, ps, pr, n) in enumerate(chains)]
    tau_null = None if null_agreement is None else simulated_tau(null_agreement)
    return AcceptanceReport(
        method, float(temperature), depths, simulated_tau(agreement), row.tau, row.S, tau_null
    )


@torch.no_grad()
def teacher_forced_agreement(
    drafter: Drafter,
    target: Target,
    prompts: Sequence[str],
    tokens: torch.Tensor,
    depth: int,
    batch_size: int,
    null: bool = False,
) -> list[float]:
    """``depth_agreement`` over ``prompts`` (``tokens`` [N, h·w] their image tokens), batch by batch, under
    their captions or (``null``) the target's null condition; every prompt has as many image tokens, so
    batches weigh by their size."""
    total = np.zeros(depth)
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        cond = target.encode_captions(batch)
        if null:
            cond = target.null_condition(cond)
        agreement = depth_agreement(drafter, target, cond, tokens[start : start + len(batch)], depth)
        total += np.asarray(agreement, dtype=float) * len(batch)
    return (total / len(prompts)).tolist()


def measure(
    target: Target,
    drafter: Drafter,
    result: EvalResult,
    cfg: AcceptanceReportConfig,
    *,
    seed: int,
    batch_size: int,
    ar_runs: dict[tuple[float, int], UnitRecord] | None = None,
    cuda_graphs: bool | str | None = "auto",
    decode_overrides: Mapping[str, Any] | None = None,
    ranks: Ranks | None = None,
) -> list[AcceptanceReport]:
    """The reports for ``cfg.method`` at ``cfg.temperatures`` on ``result``'s prompts. Decodes that
    ``result`` already holds are reused; the others run through ``evaluate`` with the same seeds (no
    warm-up: only counts are read, and forwards an earlier ``compile`` wrapped stay compiled), AR from
    ``ar_runs`` where it holds the temperature. With ``ranks``, every process calls this: the missing
    decodes are split among them and gathered."""
    missing = [float(t) for t in cfg.temperatures if (cfg.method, float(t)) not in result.decoded]
    decoded = dict(result.decoded)
    rows = {(r.method, r.temperature): r for r in result.rows}
    if missing:
        extra = evaluate(
            target,
            drafter,
            result.prompts,
            [cfg.method],
            missing,
            seed=seed,
            batch_size=batch_size,
            progress=False,
            warmup=False,
            cuda_graphs=cuda_graphs,
            ar_runs=ar_runs,
            decode_overrides=decode_overrides,
            quality=QualityConfig(metrics=[]),  # only counts are read: no scoring, no noise-floor decode
            ranks=ranks,
        )
        assert extra is not None  # no store: every process merges
        decoded.update(extra.decoded)
        rows.update({(r.method, r.temperature): r for r in extra.rows})
    reports = []
    for t in map(float, cfg.temperatures):
        key = (cfg.method, t)
        if key not in decoded:  # a relaxed method at T = 0 (evaluate leaves it out)
            log.info("acceptance report: %s does not run at T = %g, left out", cfg.method, t)
            continue
        stats = decoded[key].stats
        deepest = max([1, *(d for s in stats for d in s.depth_per_step)])
        depth = deepest if cfg.depth is None else cfg.depth
        agreement, null = (
            teacher_forced_agreement(
                drafter, target, result.prompts, decoded["ar", t].tokens, depth, batch_size, stream
            )
            for stream in (False, True)
        )
        reports.append(build_report(cfg.method, t, agreement, rows[key], stats, null))
    return reports


def acceptance_metrics(reports: Sequence[AcceptanceReport]) -> dict[str, float]:
    """``eval/acceptance/{tau_sim,tau_real,tau_gap,S,tau_sim_null}_T<t>`` and
    ``{p_sim,p_real,a_null}_d<d>_T<t>`` (the null stream's where measured)."""
    out: dict[str, float] = {}
    for r in reports:
        t = f"T{r.temperature:g}"
        out |= {
            f"eval/acceptance/tau_sim_{t}": r.tau_sim,
            f"eval/acceptance/tau_real_{t}": r.tau_real,
            f"eval/acceptance/tau_gap_{t}": r.gap,
            f"eval/acceptance/S_{t}": r.S,
        }
        if r.tau_sim_null is not None:
            out[f"eval/acceptance/tau_sim_null_{t}"] = r.tau_sim_null
        for row in r.depths:
            out[f"eval/acceptance/p_sim_d{row.depth}_{t}"] = row.p_sim
            out[f"eval/acceptance/p_real_d{row.depth}_{t}"] = row.p_real
            if row.null_agreement is not None:
                out[f"eval/acceptance/a_null_d{row.depth}_{t}"] = row.null_agreement
    return out


def acceptance_markdown(reports: Sequence[AcceptanceReport]) -> str:
    """A summary row per temperature (τ_sim, τ_real, the gap, S, the null stream's τ_sim), then the
    per-depth chain probabilities with the null stream's agreement."""
    lines = [
        "| T | method | τ_sim | τ_real | gap τ_sim − τ_real | S | τ_sim, null stream |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.temperature:g} | {r.method} | {r.tau_sim:.2f} | {r.tau_real:.2f} | {r.gap:+.2f} | {r.S:.2f} "
        f"| {_figure(r.tau_sim_null, 2)} |"
        for r in reports
    ]
    lines += [
        "",
        "| T | d | a_d | P_sim(≥d) | P_real(≥d) | P_sim − P_real | a_d, null stream |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.temperature:g} | {d.depth} | {d.agreement:.3f} | {d.p_sim:.3f} | {d.p_real:.3f} "
        f"| {d.p_sim - d.p_real:+.3f} | {_figure(d.null_agreement, 3)} |"
        for r in reports
        for d in r.depths
    ]
    return "\n".join(lines) + "\n"


def _figure(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_report(reports: Sequence[AcceptanceReport], folder: str | os.PathLike[str]) -> Path:
    """``acceptance.md`` and ``acceptance.json`` (each report with its gap) in ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.md").write_text(acceptance_markdown(reports))
    data = [{**asdict(r), "tau_gap": r.gap} for r in reports]
    (out / "acceptance.json").write_text(json.dumps({"acceptance": data}, indent=2) + "\n")
    return out
