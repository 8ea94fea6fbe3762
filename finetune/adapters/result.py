"""What one merge, subtract or swap did, in memory or on disk: one report type for logs, the CLI and benchmarks.

Example:
    report = loaded.merge("legal")            # or merge_checkpoint(...)
    print(report.summary())                   # merge legal:1: rewrote 14 tensors in 0.004 s; merged now: legal:1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ArithmeticResult:
    operation: str
    merged: dict[str, float]
    """The ledger afterwards: adapter name -> weight."""
    tensors_rewritten: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    out: Path | None = None
    """On disk: the directory written."""
    shards: int = 0
    exact: bool = True
    """Every rewritten tensor computed from the pristine base (always, in memory)."""
    max_drift_bound: float = 0.0
    """Not exact: the largest difference from an exact result the fp32 arithmetic can have caused."""

    def summary(self) -> str:
        merged = ", ".join(f"{n}:{w:g}" for n, w in self.merged.items()) or "nothing"
        if self.out is None:
            head = f"{self.operation}: rewrote {self.tensors_rewritten} tensors in {self.seconds:.3f} s; merged now: {merged}"
        else:
            how = (
                "exact, from the pristine base"
                if self.exact
                else "fp32 arithmetic on the merged weights (no pristine base): largest possible drift vs an exact "
                f"merge {self.max_drift_bound:.3e}"
            )
            head = (
                f"{self.operation}: wrote {self.out} ({self.shards} shard(s), {self.tensors_rewritten} tensors with "
                f"updates, {self.seconds:.2f} s); merged now: {merged}; {how}"
            )
        return "\n".join([head, *self.notes])
