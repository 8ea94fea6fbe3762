"""Reward functions for GRPO: loaded from the recipe's `FILE:FUNCTION` entries or built in, called as trl calls
them, and checked so that a broken one stops the run with one line naming it and the record.

A reward function written for trl's GRPOTrainer works unchanged: it is called with keyword arguments
`prompts`, `completions` (strings, or `[{"role": "assistant", "content": ...}]` for chat prompts),
`completion_ids`, every other column of the records (one list entry per completion), `trainer_state`
(`global_step`, `max_steps`, `epoch`), `log_extra` and `log_metric`, and returns one float (or None: no
reward from this function) per completion. The code is imported from the file the recipe names (relative
to the working directory), never fetched.

Built-ins, for what everyone writes (arguments in parentheses, as Python literals or bare words; a quoted
string is taken as written, as a raw string, so `regex(pattern="\\bfoo\\b")` means word boundaries):
- `exact_match(column=answer)`: 1.0 when the completion, stripped, equals the column's value, else 0.0;
- `number_match(column=answer)`: 1.0 when the completion's last number equals the last number of the column's
  value (GSM8K's `#### 72`), else 0.0;
- `regex(pattern="^<think>.*</think>")`: 1.0 when the pattern matches the completion (re.search, DOTALL);
- `length(target=64)`: −|characters − target| / target, highest (0) at the target length.

Example:
    rewards = load_reward_functions(["rewards.py:correct", "length(target=64)"])
    scores = score(rewards, prompts, completions, completion_ids, columns, state)   # (n, functions)
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.errors import FinetuneError, first_line


class RewardError(FinetuneError):
    """A reward function could not be loaded, raised, or returned something other than one number per
    completion."""


@dataclass(frozen=True)
class RewardFunction:
    name: str
    """As the recipe wrote it: `rewards.py:correct` or `length(target=64)`; metrics are named after it."""
    function: Callable[..., Any]


@dataclass(frozen=True)
class TrainerState:
    """The part of trl's `TrainerState` reward functions read to shape rewards by progress."""

    global_step: int
    max_steps: int
    epoch: float


def load_reward_functions(entries: Sequence[str]) -> list[RewardFunction]:
    """The recipe's `train.reward_functions`, each loaded once (RewardError naming the entry otherwise)."""
    return [RewardFunction(entry, _load(entry)) for entry in entries]


def _load(entry: str) -> Callable[..., Any]:
    builtin = re.fullmatch(r"(\w+)(?:\((.*)\))?", entry.strip(), flags=re.DOTALL)
    if builtin is not None and builtin.group(1) in BUILTINS:
        return _builtin(entry, builtin.group(1), _arguments(entry, builtin.group(2) or ""))
    path_text, sep, function_name = entry.rpartition(":")
    if not sep or not path_text.endswith(".py"):
        raise RewardError(
            f"train.reward_functions: {entry!r} is neither `path/to/file.py:function` nor a built-in "
            f"({', '.join(sorted(BUILTINS))})"
        )
    path = Path(path_text)
    if not path.is_file():
        raise RewardError(f"train.reward_functions: {entry!r}: no file {path} (paths are relative to {Path.cwd()})")
    module = _import_file(path)
    function = getattr(module, function_name, None)
    if not callable(function):
        defined = [name for name, value in vars(module).items() if inspect.isfunction(value)]
        raise RewardError(
            f"train.reward_functions: {path} defines no function {function_name!r} (functions: "
            f"{', '.join(defined) or 'none'})"
        )
    return function


def _import_file(path: Path) -> Any:
    """The module of a reward file, imported once per version of the file: the CLI checks the recipe's rewards
    before the model loads, and the objective takes the same functions, without running the file twice."""
    stat = path.stat()
    module_name = f"finetune_reward_{abs(hash(str(path.resolve())))}_{stat.st_mtime_ns}_{stat.st_size}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder = str(path.resolve().parent)  # `import helpers` beside the file works, as when it runs as a script
    if folder not in sys.path:
        sys.path.append(folder)  # after everything installed: a file there named like a package shadows nothing
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the file find their module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a file that calls sys.exit() would end the run without a word
        del sys.modules[module_name]
        raise RewardError(
            f"train.reward_functions: importing {path} raised {type(exc).__name__}: {first_line(exc)}"
        ) from None
    return module


def _arguments(entry: str, text: str) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    for part in filter(None, (piece.strip() for piece in _split_arguments(text))):
        key, sep, value = part.partition("=")
        if not sep:
            raise RewardError(f"train.reward_functions: {entry!r}: write arguments as key=value, got {part!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            # a quoted string is taken as written, as a raw string: a regex's \b, \d and \s stay what they are
            # (a Python literal would make \b a backspace, and its invalid escapes are deprecated)
            arguments[key.strip()] = value[1:-1]
            continue
        try:
            arguments[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            arguments[key.strip()] = value  # a bare word: exact_match(column=answer)
    return arguments


def _split_arguments(text: str) -> list[str]:
    """Split at commas outside quotes (a regex may hold commas)."""
    parts, current, quote = [], "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == ",":
            parts.append(current)
            current = ""
            continue
        current += char
    return [*parts, current]


def _text(completion: Any) -> str:
    """A completion's text: itself, or the content of its assistant message (chat prompts)."""
    if isinstance(completion, list):
        return "".join(str(message.get("content") or "") for message in completion)
    return str(completion)


def _builtin(entry: str, name: str, arguments: dict[str, Any]) -> Callable[..., Any]:
    """A built-in reward with the recipe's arguments: a wrong name or value is the recipe's to fix, in one line."""
    factory = BUILTINS[name]
    accepted = list(inspect.signature(factory).parameters)
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise RewardError(
            f"train.reward_functions: {entry!r}: {name} takes no argument {', '.join(unknown)}; it takes "
            f"{', '.join(accepted)}"
        )
    try:
        return factory(**arguments)
    except (TypeError, ValueError, re.error) as exc:
        raise RewardError(f"train.reward_functions: {entry!r}: {first_line(exc)}; fix the argument") from None


def exact_match(column: str = "answer") -> Callable[..., list[float]]:
    def reward(completions: list[Any], **columns: Any) -> list[float]:
        if column not in columns:
            raise KeyError(f"exact_match: the records have no column {column!r}")
        return [float(_text(c).strip() == str(v).strip()) for c, v in zip(completions, columns[column])]

    return reward


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def number_match(column: str = "answer") -> Callable[..., list[float]]:
    def reward(completions: list[Any], **columns: Any) -> list[float]:
        if column not in columns:
            raise KeyError(f"number_match: the records have no column {column!r}")
        answers = [_last_number(str(value)) for value in columns[column]]
        return [
            float(answer is not None and _last_number(_text(c)) == answer) for c, answer in zip(completions, answers)
        ]

    return reward


def regex(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern, flags=re.DOTALL)

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [float(compiled.search(_text(c)) is not None) for c in completions]

    return reward


def length(target: int = 64) -> Callable[..., list[float]]:
    if not isinstance(target, int) or target < 1:
        raise ValueError(f"length's target must be a whole number of characters, at least 1 (got {target!r})")

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [-abs(len(_text(c)) - target) / target for c in completions]

    return reward


BUILTINS: dict[str, Callable[..., Callable[..., list[float]]]] = {
    "exact_match": exact_match,
    "number_match": number_match,
    "regex": regex,
    "length": length,
}


def score(
    functions: Sequence[RewardFunction],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    state: TrainerState,
    records: Sequence[str],
) -> torch.Tensor:
    """(n, functions) float32 rewards, NaN where a function returned None. `records` says where each
    completion's prompt came from, for errors.

    Raises:
        RewardError: a function raised, returned a number of values other than n, or a value that is not a
            number (or None).
    """
    scores = torch.empty(len(completions), len(functions), dtype=torch.float32)
    for index, reward in enumerate(functions):
        try:
            values = reward.function(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                trainer_state=state,
                log_extra=_ignore,
                log_metric=_ignore,
                **columns,
            )
            if inspect.isawaitable(values):  # an `async def` function, as trl awaits them
                values = _await(values)
        except (Exception, SystemExit) as exc:  # the user's code, sys.exit() included: theirs to fix, named as such
            raise RewardError(
                f"reward function {reward.name} raised {type(exc).__name__}: {first_line(exc)} (on a batch of "
                f"prompts starting at {records[0]}); fix the function"
            ) from None
        if hasattr(values, "tolist") and getattr(values, "ndim", None) == 1:  # a numpy array, as trl accepts
            values = values.tolist()
        # a 0-d tensor (one number for the whole batch) cannot be iterated: it is told as a wrong return, as a
        # 0-d numpy array is, not left to raise a traceback
        iterable = isinstance(values, (list, tuple)) or (isinstance(values, torch.Tensor) and values.ndim > 0)
        values = list(values) if iterable else values
        if not isinstance(values, list) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, list) else f"a {type(values).__name__}"
            raise RewardError(
                f"reward function {reward.name} returned {got} for {len(completions)} completions (prompts from "
                f"{records[0]}); return a list with one float (or None) per completion"
            )
        for row, value in enumerate(values):
            scores[row, index] = _number(reward.name, value, records[row])
    return scores


def _await(awaitable: Any) -> Any:
    """The result of an async reward function's coroutine, run to its end on an event loop of its own (in a
    thread of its own where this thread already runs a loop, as a notebook does)."""

    async def result() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(result())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, result()).result()


def _number(name: str, value: Any, record: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or math.isinf(float(value)):
        raise RewardError(
            f"reward function {name} returned {value!r} for a completion of {record}; return a finite float "
            "per completion (None or NaN: not scored, as trl reads them)"
        )
    if abs(float(value)) > FLOAT32_MAX:  # rewards are float32 tensors: this one would be inf there
        raise RewardError(
            f"reward function {name} returned {value!r} for a completion of {record}, beyond float32's range "
            f"(±{FLOAT32_MAX:.3g}); scale the rewards down"
        )
    return float(value)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """trl's `log_extra` / `log_metric` hooks, accepted and not recorded."""
