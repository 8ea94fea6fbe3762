"""The human view of `finetune plan`: a table of parts, the peak, whether it fits, what to change.

Example:
    print(render("quickstart", recipe, "config.json", plan, 8 * GiB, []))
"""

from __future__ import annotations

from collections.abc import Sequence

from finetune.plan.memory import GiB, MemoryPlan, describe_checkpointing, sequences_per_record
from finetune.plan.suggest import Suggestion
from finetune.recipe import Recipe


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f}"


def _header(name: str, recipe: Recipe, source: str, plan: MemoryPlan) -> list[str]:
    train = recipe.train
    layout = f"{plan.nproc} processes, {plan.strategy}, per rank" if plan.nproc > 1 else "1 process"
    sequences = sequences_per_record(recipe)
    records = (
        f"{train.micro_batch_size} pairs ({train.micro_batch_size * sequences} sequences)" if sequences > 1 else ""
    )
    return [
        f"{name}: {recipe.model.base} (config: {source}); objective {train.objective}",
        f"{plan.device}, {layout}; micro-batch {records or train.micro_batch_size} x {recipe.data.max_seq_len} tokens, "
        f"{describe_checkpointing(train.gradient_checkpointing, plan.checkpointed_layers, plan.num_layers)}, "
        f"precision {train.precision}",
        *_moe_lines(recipe, plan),
        "",
    ]


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.1f}M"


def _moe_lines(recipe: Recipe, plan: MemoryPlan) -> list[str]:
    """Mixture of experts: total and active parameters, experts, router, and where the LoRA is."""
    if not plan.moe:
        return []
    moe = plan.moe
    router = "trained" if recipe.lora.train_router else "frozen"
    return [
        f"mixture of experts: {_billions(moe['total_params'])} parameters, {_billions(moe['active_params'])} active per "
        f"token ({_billions(moe['active_params_without_input_embedding'])} without the input embedding); experts "
        f"{_billions(moe['expert_params'])}, router {_billions(moe['router_params'])} ({router})",
        f"LoRA {_billions(moe['lora_params'])} parameters, {_billions(moe['expert_lora_params'])} of them on expert "
        f"tensors (a rank-{recipe.lora.r} pair per expert)",
    ]


def _table(plan: MemoryPlan) -> list[str]:
    """The parts, then the peak (and what is offloaded), one column of GiB: the totals count in the widths, as
    a peak of 100 GiB or more is wider than every part (`138.05` stood out of its column)."""
    rows = [("part", "GiB", "where", "what")]
    rows += [(p.name, _gib(p.num_bytes), p.where, p.note) for p in plan.parts]
    totals = [("peak", _gib(plan.peak_bytes), "per device")]
    if plan.host_bytes and plan.device == "cuda":
        totals.append(("host", _gib(plan.host_bytes), "offloaded to CPU memory"))
    widths = [max(len(row[i]) for row in rows + totals) for i in range(2)]
    widths.append(max(len(row[2]) for row in rows))
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
    return lines + [f"{name:<{widths[0]}}  {gib:>{widths[1]}}  {what}" for name, gib, what in totals]


def _verdict(plan: MemoryPlan, device_bytes: int, found: list[Suggestion]) -> list[str]:
    spare = device_bytes - plan.peak_bytes
    if spare >= 0:
        return ["", f"fits {_gib(device_bytes)} GiB: yes, {_gib(spare)} GiB to spare"]
    lines = ["", f"fits {_gib(device_bytes)} GiB: no, {_gib(-spare)} GiB short. Changes, each alone:"]
    for change in found:
        command = " ".join(change.overrides) + (f" --nproc {change.nproc}" if change.nproc != plan.nproc else "")
        verdict = "fits" if change.fits else "still too big"
        lines.append(f"  {change.description}: peak {_gib(change.plan.peak_bytes)} GiB, {verdict}  ({command})")
    if not found:
        lines.append("  none of QLoRA, checkpointing, a smaller micro-batch or FSDP applies; use a larger device")
    return lines


def render(
    name: str,
    recipe: Recipe,
    source: str,
    plan: MemoryPlan,
    device_bytes: int | None,
    found: list[Suggestion],
    *,
    notes: Sequence[str] = (),
) -> str:
    """The whole human view as one string; `notes` (one line each: bf16 on a CPU without bf16 units) last."""
    lines = _header(name, recipe, source, plan) + _table(plan)
    if device_bytes is not None:
        lines += _verdict(plan, device_bytes, found)
    lines += ["", *notes] if notes else []
    lines.append("")
    lines.append("estimate of the training step's peak (not evaluation or saving); see README 'Will it fit?'")
    return "\n".join(lines)
