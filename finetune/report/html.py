"""The report page: one self-contained HTML file (inline CSS, plots as base64 data URIs, no script, no network).

A table describes each run (one column per run): base and its fingerprint, data, LoRA, recipe, held-out
perplexity before and after, wall time; the plots follow. Everything from the run is escaped.

Example:
    html = render_page([read_run(Path("runs/quickstart"))], {"loss": png, "lr": png, ...})
    Path("report.html").write_text(html)
"""

from __future__ import annotations

import base64
import html
import statistics
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone

from finetune.report.runs import RunHistory, perplexity_change

_MISSING = "—"

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: #1d2330;
       margin: 0 auto; max-width: 1120px; padding: 24px; background: #fafbfc; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 10px; }
.sub { color: #5b6473; margin-bottom: 18px; }
table { border-collapse: collapse; background: #fff; box-shadow: 0 1px 2px rgba(0,0,0,.08); width: 100%; }
th, td { text-align: left; vertical-align: top; padding: 6px 10px; border-bottom: 1px solid #e6e8eb; }
th { background: #f1f3f5; white-space: nowrap; font-weight: 600; }
td { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; word-break: break-word; }
tr:last-child td, tr:last-child th { border-bottom: 0; }
figure { margin: 0 0 18px; background: #fff; box-shadow: 0 1px 2px rgba(0,0,0,.08); padding: 8px; }
figure img { max-width: 100%; display: block; }
figcaption { color: #5b6473; font-size: 12.5px; padding: 4px 6px 0; }
"""

PLOT_CAPTIONS = {
    "loss": "Training loss against optimizer steps and against tokens seen.",
    "lr": "Learning rate against optimizer steps and against tokens seen.",
    "eval": "Held-out loss and perplexity at each evaluation; dashed: the base model before training.",
    "throughput": "Training throughput (tokens per second) at each logged step.",
    "rewards": "Implicit rewards of the chosen and rejected completions and their margin (left); the share of pairs "
    "whose chosen completion has the higher reward (right; squares: held out).",
    "sampled_rewards": "Mean reward of each step's sampled completions (left; squares: held-out prompts sampled at "
    "each evaluation) and their mean length in tokens (right).",
}


def _short(fingerprint: str) -> str:
    return fingerprint[:23] + "…" if len(fingerprint) > 24 else fingerprint


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def _held_out(run: RunHistory, key: str, digits: int) -> str:
    if key in ("eval_loss", "eval_ppl") and run.scores_own_samples:
        return "not held-out (GRPO scores its own samples: see the sampled reward)"
    base, after = run.base_metric(key), run.metrics.get(key)
    if after is None:
        return _MISSING
    text = f"{base:.{digits}f} → {after:.{digits}f}" if base is not None else f"{after:.{digits}f}"
    if base is not None and run.starts_from_adapter:
        text = f"starting adapter {text}"
    if key == "eval_ppl" and base is not None:
        text += f" ({perplexity_change(base, after)})"
    return text


def _recipe_section(run: RunHistory, section: str) -> dict:
    recipe = run.manifest.recipe if run.manifest is not None else None
    return (recipe or {}).get(section, {})


def _lora(run: RunHistory) -> str:
    lora = _recipe_section(run, "lora")
    if not lora:
        return _MISSING
    targets = lora["target_modules"] if isinstance(lora["target_modules"], str) else ", ".join(lora["target_modules"])
    extras = [name for name in ("use_rslora", "use_dora") if lora.get(name)]
    init = [] if lora.get("init", "default") == "default" else [f"init {lora['init']}"]
    return ", ".join(
        [f"r={lora['r']}", f"alpha={lora['alpha']:g}", f"dropout={lora['dropout']:g}", targets] + extras + init
    )


def _training(run: RunHistory) -> str:
    train = _recipe_section(run, "train")
    if not train:
        return _MISSING
    length = f"{train['max_steps']} steps" if train.get("max_steps") else f"{train['epochs']:g} epochs"
    return (
        f"{length}, micro-batch {train['micro_batch_size']} × {train['grad_accum_steps']} accumulated, "
        f"lr {train['lr']:g} {train['schedule']} (warmup {train['warmup_steps'] or train['warmup_ratio']}), "
        f"{train['optimizer']}, {train['precision']}, seed {train['seed']}"
    )


def _data(run: RunHistory) -> str:
    if run.manifest is None or run.manifest.data is None:
        return _MISSING
    data, section = run.manifest.data, _recipe_section(run, "data")
    parts = [", ".join(data.sources)]
    if section:
        parts.append(f"{section['format']}, max_seq_len {section['max_seq_len']}, packing {section['packing']}")
    stats = [f"{key}={value:,}" if isinstance(value, int) else f"{key}={value}" for key, value in data.stats.items()]
    parts.append(", ".join(stats))
    parts.append(_short(data.fingerprint))
    return "; ".join(parts)


def _throughput(run: RunHistory) -> str:
    _, values = run.series("tokens_per_s")
    return f"{statistics.median(values):,.0f} tokens/s (median of {len(values)} logged steps)" if values else _MISSING


def _last(run: RunHistory, key: str, fmt: str) -> str:
    _, values = run.series(key)
    return format(values[-1], fmt) if values else _MISSING


def _base(run: RunHistory) -> str:
    if run.manifest is None:
        return _MISSING
    base = run.manifest.base
    where = "" if base.path == base.id else f" ({base.path})"
    quantization = "" if base.quantization == "none" else f", {base.quantization}"
    return f"{base.id}{where}, {base.dtype or 'dtype as stored'}{quantization}"


ROWS: tuple[tuple[str, Callable[[RunHistory], str]], ...] = (
    ("adapter", lambda run: run.adapter_dir or "not written yet (run unfinished?)"),
    ("run directory", lambda run: str(run.run_dir)),
    ("base", _base),
    ("base fingerprint", lambda run: _short(run.manifest.base.fingerprint) if run.manifest else _MISSING),
    ("data", _data),
    ("LoRA", _lora),
    ("training", _training),
    ("held-out perplexity (base → adapter)", lambda run: _held_out(run, "eval_ppl", 3)),
    ("held-out loss (base → adapter)", lambda run: _held_out(run, "eval_loss", 4)),
    ("held-out reward accuracy (start → adapter)", lambda run: _held_out(run, "eval_reward_accuracy", 3)),
    ("held-out reward margin (start → adapter)", lambda run: _held_out(run, "eval_reward_margin", 3)),
    ("held-out sampled reward (start → adapter)", lambda run: _held_out(run, "eval_reward", 3)),
    ("last training loss", lambda run: _last(run, "loss", ".4f")),
    ("steps, tokens", lambda run: f"{_last(run, 'step', 'd')} steps, {_last(run, 'tokens_seen', ',.0f')} tokens"),
    (
        "wall time",
        lambda run: format_seconds(run.metrics["wall_seconds"]) if "wall_seconds" in run.metrics else _MISSING,
    ),
    ("throughput", _throughput),
    ("created", lambda run: run.manifest.created if run.manifest else _MISSING),
    (
        "versions",
        lambda run: ", ".join(f"{k} {v}" for k, v in run.manifest.versions.items()) if run.manifest else _MISSING,
    ),
)
"""The run table, row by row: a label and how to describe one run in that row."""
_WHEN_RECORDED = (
    "held-out reward accuracy (start → adapter)",
    "held-out reward margin (start → adapter)",
    "held-out sampled reward (start → adapter)",
)
"""Rows left out of a table whose runs all lack them (the preference metrics of SFT runs)."""


def run_table(runs: Sequence[RunHistory]) -> str:
    """The table of runs as HTML: one row per `ROWS` entry, one column per run."""
    head = "".join(f"<th>{html.escape(run.name)}</th>" for run in runs)
    body = []
    for label, describe in ROWS:
        described = [describe(run) for run in runs]
        if label in _WHEN_RECORDED and all(text == _MISSING for text in described):
            continue
        cells = "".join(f"<td>{html.escape(text)}</td>" for text in described)
        body.append(f"<tr><th>{html.escape(label)}</th>{cells}</tr>")
    return f"<table><thead><tr><th></th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_page(runs: Sequence[RunHistory], images: Mapping[str, bytes], *, version: str = "") -> str:
    """The whole page: title, run table, and each PNG of `images` embedded as a data URI."""
    names = ", ".join(run.name for run in runs)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    figures = []
    for name, png in images.items():
        encoded = base64.b64encode(png).decode("ascii")
        caption = html.escape(PLOT_CAPTIONS.get(name, name))
        figures.append(
            f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>finetune report: {html.escape(names)}</title><style>{_CSS}</style></head><body>"
        f"<h1>finetune report: {html.escape(names)}</h1>"
        f'<div class="sub">{len(runs)} run(s); generated {created} by finetune {html.escape(version)}</div>'
        f"<h2>Runs</h2>{run_table(runs)}<h2>Curves</h2>{''.join(figures)}</body></html>\n"
    )
