"""The report's plots: matplotlib figures of one or several runs, overlaid in one colour per run.

Figures are built with `matplotlib.figure.Figure` (no pyplot, no global state, the Agg renderer for PNG),
so they render the same in a training process, a test or a server. Each line is labelled with its run's
name (base-model lines `<name>: base model`), which is how the tests read the plotted points back.

- `loss`: training loss against optimizer steps and against tokens seen;
- `lr`: learning rate, the same two ways;
- `eval`: held-out loss and perplexity at each evaluation, with the base model's value as a dashed line;
- `throughput`: training tokens per second at each logged step;
- `rewards` (preference runs only): the implicit rewards of the chosen and rejected completions and their
  margin, and the reward accuracy, at each logged step and (markers) each evaluation.

Example:
    figures = make_figures([read_run(Path("runs/a")), read_run(Path("runs/b"))])
    png_bytes(figures["loss"])
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

from finetune.report.runs import RunHistory

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGURE_NAMES = ("loss", "lr", "eval", "throughput")
PREFERENCE_FIGURE = "rewards"
"""Added to `FIGURE_NAMES` when a run logged preference metrics (`reward_margin`)."""
ONLINE_FIGURE = "sampled_rewards"
"""Added when a run logged an online objective's rewards (`reward`: GRPO)."""
BASE_SUFFIX = ": base model"
START_SUFFIX = ": starting adapter"
RUN_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_FEW_POINTS = 30  # below this many points a line also gets markers, so single evaluations stay visible


def _colour(index: int) -> str:
    return RUN_COLOURS[index % len(RUN_COLOURS)]


def _new_figure(panels: int) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.2 * panels, 3.4), dpi=100)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    # Fixed margins: matplotlib's constrained layout would cost about as much as rendering the figure.
    figure.subplots_adjust(left=0.09 / panels + 0.03, right=0.98, bottom=0.15, top=0.9, wspace=0.28)
    return figure, list(axes)


def _plot(axes: Axes, x: list[float], y: list[float], label: str, colour: str) -> None:
    marker = "o" if len(x) < _FEW_POINTS else None
    axes.plot(x, y, label=label, color=colour, marker=marker, markersize=3, linewidth=1.4)


def _finish(axes: Axes, title: str, xlabel: str, ylabel: str, has_data: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    if xlabel == "step":
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title(title, fontsize=10)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    if has_data:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", va="center", color="grey")


def _steps_and_tokens(runs: Sequence[RunHistory], key: str, ylabel: str) -> Figure:
    """`key` of the training records against optimizer steps (left) and tokens seen (right)."""
    from matplotlib.ticker import EngFormatter

    figure, (by_step, by_tokens) = _new_figure(2)
    has_data = False
    for index, run in enumerate(runs):
        steps, values = run.series(key)
        tokens, token_values = run.series(key, x="tokens_seen")
        _plot(by_step, steps, values, run.name, _colour(index))
        _plot(by_tokens, tokens, token_values, run.name, _colour(index))
        has_data = has_data or bool(steps)
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    _finish(by_step, f"{ylabel} by optimizer step", "step", ylabel, has_data)
    _finish(by_tokens, f"{ylabel} by tokens seen", "tokens seen", ylabel, has_data)
    return figure


def _held_out(runs: Sequence[RunHistory]) -> Figure:
    """Held-out loss (left) and perplexity (right, log scale) per evaluation; the base model dashed. A GRPO run's
    evaluations score its own samples: they are left out (its sampled reward has a plot of its own)."""
    figure, (loss_axes, ppl_axes) = _new_figure(2)
    has_data = False
    for index, run in enumerate(runs):
        if run.scores_own_samples:
            continue
        for axes, key in ((loss_axes, "eval_loss"), (ppl_axes, "eval_ppl")):
            steps, values = run.series(key, evaluation=True)
            _plot(axes, steps, values, run.name, _colour(index))
            base = run.base_metric(key)
            if base is not None:
                axes.axhline(
                    base,
                    color=_colour(index),
                    linestyle="--",
                    linewidth=1,
                    label=run.name + (START_SUFFIX if run.starts_from_adapter else BASE_SUFFIX),
                )
            has_data = has_data or bool(steps) or base is not None
    if has_data:
        from matplotlib.ticker import FuncFormatter

        ppl_axes.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:.4g}")  # 360, not 3.6 × 10²
        ppl_axes.yaxis.set_major_formatter(plain)
        low, high = ppl_axes.get_ylim()
        if high / max(low, 1e-12) < 10:  # within a decade there are no major ticks: label the minor ones
            ppl_axes.yaxis.set_minor_formatter(plain)  # (across decades they would pile into one smear)
    _finish(loss_axes, "held-out loss at each evaluation", "step", "loss", has_data)
    _finish(ppl_axes, "held-out perplexity at each evaluation", "step", "perplexity", has_data)
    return figure


def _throughput(runs: Sequence[RunHistory]) -> Figure:
    figure, (axes,) = _new_figure(1)
    has_data = False
    for index, run in enumerate(runs):
        steps, values = run.series("tokens_per_s")
        _plot(axes, steps, values, run.name, _colour(index))
        has_data = has_data or bool(steps)
    _finish(axes, "training throughput", "step", "tokens / s", has_data)
    return figure


def _rewards(runs: Sequence[RunHistory]) -> Figure:
    """Rewards and margin (left), reward accuracy (right): training records as lines, evaluations as markers."""
    figure, (reward_axes, accuracy_axes) = _new_figure(2)
    has_data = False
    styles = (
        ("rewards_chosen", "chosen", "-"),
        ("rewards_rejected", "rejected", ":"),
        ("reward_margin", "margin", "--"),
    )
    for index, run in enumerate(runs):
        colour = _colour(index)
        for key, label, style in styles:
            steps, values = run.series(key)
            reward_axes.plot(steps, values, label=f"{run.name}: {label}", color=colour, linestyle=style, linewidth=1.4)
            has_data = has_data or bool(steps)
        _plot(accuracy_axes, *run.series("reward_accuracy"), run.name, colour)
        eval_steps, eval_values = run.series("eval_reward_accuracy", evaluation=True)
        accuracy_axes.plot(eval_steps, eval_values, "s", color=colour, label=f"{run.name}: held out")
    _finish(reward_axes, "implicit rewards by optimizer step", "step", "reward", has_data)
    _finish(accuracy_axes, "reward accuracy (chosen > rejected)", "step", "share of pairs", has_data)
    return figure


def _sampled_rewards(runs: Sequence[RunHistory]) -> Figure:
    """GRPO: the mean reward of the step's completions (line) and of held-out samples (squares), left; the
    completions' mean length, right."""
    figure, (reward_axes, length_axes) = _new_figure(2)
    has_data = False
    for index, run in enumerate(runs):
        colour = _colour(index)
        steps, values = run.series("reward")
        _plot(reward_axes, steps, values, run.name, colour)
        eval_steps, eval_values = run.series("eval_reward", evaluation=True)
        reward_axes.plot(eval_steps, eval_values, "s", color=colour, label=f"{run.name}: held out")
        _plot(length_axes, *run.series("completion_length"), run.name, colour)
        has_data = has_data or bool(steps)
    _finish(reward_axes, "reward of sampled completions", "step", "reward", has_data)
    _finish(length_axes, "completion length", "step", "tokens", has_data)
    return figure


def make_figures(runs: Sequence[RunHistory]) -> dict[str, Figure]:
    """The report's figures by name (`FIGURE_NAMES`, and `rewards` for preference runs), every run overlaid
    in its own colour."""
    figures = {
        "loss": _steps_and_tokens(runs, "loss", "training loss"),
        "lr": _steps_and_tokens(runs, "lr", "learning rate"),
        "eval": _held_out(runs),
        "throughput": _throughput(runs),
    }
    if any(run.series("reward_margin")[0] for run in runs):
        figures[PREFERENCE_FIGURE] = _rewards(runs)
    elif any(run.series("reward")[0] for run in runs):
        figures[ONLINE_FIGURE] = _sampled_rewards(runs)
    return figures


def png_bytes(figure: Figure) -> bytes:
    """The figure rendered as PNG (Agg)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
