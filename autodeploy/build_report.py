"""What a build did, transform by transform, and how its verification went: the records the pipeline and
the verification write (gathered in a ``BuildReport``) and ``LLM.pipeline_report()`` prints.

A neutral module: the pipeline fills these records and the runtime (and a reloaded deployment) only reads
them, so ``autodeploy.runtime`` needs no import of the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransformRecord:
    """One transform run: what ``autodeploy inspect`` and ``llm.pipeline_report()`` show."""

    name: str
    stage: str
    seconds: float
    matches: int
    changed: bool
    nodes_before: int | None
    nodes_after: int | None
    notes: str = ""
    ops_after: dict[str, int] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)  # extra report lines (e.g. the kernel each node got)


@dataclass
class VerificationReport:
    """The build-time verification (``autodeploy/verification.py``): how closely the twin matched Hugging Face."""

    twin: str  # what the twin reduced
    device: str
    dtype: str
    max_abs_error: float
    relative_error: float
    tolerance: float
    seconds: float
    note: str = ""  # why the twin's dtype differs from the deploy's, when it does
    vision_relative_error: float | None = None  # a vision-language model's image features against Hugging Face's
    compared: str = "logit"  # what was compared: the logits, an embedder's hidden states, a cross-encoder's scores

    def __str__(self) -> str:
        note = f"; {self.note}" if self.note else ""
        if self.vision_relative_error is not None:
            note += f"; image features relative error {self.vision_relative_error:.2g}"
        return (
            f"verified on a twin ({self.twin}; {self.device} {self.dtype}): max |Δ{self.compared}| {self.max_abs_error:.2g} "
            f"(relative {self.relative_error:.2g} ≤ {self.tolerance:.3g}) in {self.seconds:.1f}s{note}"
        )


def format_report(records: list[TransformRecord], top_ops: int = 8) -> str:
    """A human table: one line per transform, then the op histogram after each stage."""
    width = max([len("transform")] + [len(r.name) for r in records]) + 2
    lines = [f"{'transform':<{width}}{'stage':<14}{'time (s)':>9}{'matches':>9}{'nodes':>15}  notes"]
    for r in records:
        nodes = f"{r.nodes_before if r.nodes_before is not None else '-'}→{r.nodes_after if r.nodes_after is not None else '-'}"
        lines.append(f"{r.name:<{width}}{r.stage:<14}{r.seconds:>9.3f}{r.matches:>9}{nodes:>15}  {r.notes}")
    lines.append(f"{'total':<{width + 14}}{sum(r.seconds for r in records):>9.3f}")
    for r in records:
        if r.details:
            lines.append(f"{r.name}:")
            lines += [f"  {line}" for line in r.details]
    last_by_stage: dict[str, TransformRecord] = {}
    for r in records:
        last_by_stage[r.stage] = r
    for stage, r in last_by_stage.items():
        if r.ops_after:
            total = sum(r.ops_after.values())
            shown = ", ".join(f"{name}×{count}" for name, count in list(r.ops_after.items())[:top_ops])
            more = len(r.ops_after) - top_ops
            lines.append(f"after {stage}: {r.nodes_after} nodes, {total} ops: {shown}{f', … {more} more' if more > 0 else ''}")
    return "\n".join(lines)


@dataclass
class BuildReport:
    """Everything a build reports: each transform's record, in run order, and the verification (None when
    ``verify.enabled`` was off). ``str()`` is what ``LLM.pipeline_report()`` prints."""

    records: list[TransformRecord] = field(default_factory=list)
    verification: VerificationReport | None = None

    def __str__(self) -> str:
        report = format_report(self.records)
        return report if self.verification is None else f"{report}\n{self.verification}"
