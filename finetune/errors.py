"""User-facing errors: every mistake a user can make is a `FinetuneError` subclass.

The message says what is wrong, where (dotted key, file, line, record number) and how to fix it, on
one line, because the CLI prints it as-is and exits 2. Internal invariants use `assert` instead.

Example:
    raise DataError(f"{path}: record 17 has no field 'response'; set data.response_field or fix the file")
"""

from __future__ import annotations


class FinetuneError(Exception):
    """Base class for errors caused by user input; the CLI prints `error: <message>` and exits 2."""


class RecipeError(FinetuneError):
    """The recipe file or a command-line override is malformed or invalid."""


class DataError(FinetuneError):
    """A data source is missing, unreadable, empty or has records the chosen format cannot use."""


class ModelError(FinetuneError):
    """The base model cannot be loaded or does not fit the recipe (e.g. target modules match nothing)."""


class AdapterError(FinetuneError):
    """An adapter is missing, malformed, unsafe or does not fit the base it is applied to."""


class CheckpointError(FinetuneError):
    """A training checkpoint cannot be resumed from."""


class OutputError(FinetuneError):
    """An output (adapter, checkpoint, merged model) cannot be written: it exists, or the place is unwritable or full."""


class TrainingError(FinetuneError):
    """Training stopped on a problem in the run itself, e.g. a NaN or Inf loss or gradient."""


class ServeError(FinetuneError):
    """A request to `finetune serve` (or its settings) is invalid; carries the HTTP status and OpenAI error fields.

    Example:
        raise ServeError("model 'x' does not exist", status=404, code="model_not_found", param="model")
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code = status, error_type, param, code


class FinetuneWarning(UserWarning):
    """Something allowed but worth knowing about; the CLI prints it as one `warning: ...` line."""


class AdapterWarning(FinetuneWarning):
    """Adapter arithmetic that is allowed but worth knowing about (no fingerprint, kept copies, forced bases)."""


class RewardWarning(FinetuneWarning):
    """Reward functions that left completions without any reward (they train with advantage 0)."""


class ExportError(FinetuneError):
    """A model or adapter cannot be exported to the requested format (architecture, tokenizer, dtype)."""


class ReportError(FinetuneError):
    """A run directory cannot be reported on (no metrics.jsonl, unreadable records)."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of another library's error message, cut to `limit` characters: enough to say what went
    wrong inside one line of our own."""
    return (str(error).strip().splitlines() or [""])[0][:limit]
