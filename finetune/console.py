"""What reaches the console from the command line: our own lines only, unless `--verbose`.

The libraries under us talk on import and on every load: bitsandbytes logs that an optional CPU kernel
package is missing (peft imports bitsandbytes even when nothing is quantized), transformers draws a
"Loading weights" progress bar and prints advisory warnings, datasets and huggingface_hub draw their
own bars. In a log or an error report these lines bury ours. The CLI calls `configure_console` before
any of those libraries is imported (their progress-bar switches are read at import time), and passes
everything through with `--verbose`. The Python API leaves the libraries as they are. Our own colour goes to a
terminal only, and not there either when NO_COLOR is set (`colour_wanted`).

Example:
    configure_console(verbose=False)   # first thing in `finetune.cli.main`
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TextIO

_QUIET_ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bar follows this switch too
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_CHATTY_LOGGERS = ("bitsandbytes", "transformers", "peft", "accelerate", "datasets", "huggingface_hub", "torch")
_CHATTY_MODULES = r"(bitsandbytes|transformers|peft|accelerate|datasets|huggingface_hub|torch)(\.|$)"


def colour_wanted(stream: TextIO) -> bool:
    """Whether to colour what goes to `stream`: a terminal, and no NO_COLOR set (https://no-color.org: present and
    not empty). `finetune data preview` then marks trained tokens with `[[...]]`, as it does in a pipe."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def configure_console(*, verbose: bool) -> None:
    """Silence the libraries' own console output (unless `verbose`); set before they are imported."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:
        return
    for name, value in _QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=_CHATTY_MODULES)
