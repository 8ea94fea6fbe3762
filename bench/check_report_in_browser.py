"""Open a run report in a real headless Chromium, offline, and check from the screenshot that the plots show.

Not a test: CI machines may have no Chromium (Debian/Ubuntu: `apt-get install chromium`). The browser runs
with every network request sent to a closed local port, so a page that needed the network would render
without its content. The screenshot is kept for a person to look at (and for the README's picture); the
script checks that each run's plot colour covers a visible area of it, which only happens when the
embedded PNGs decoded and displayed.

Example:
    python bench/check_report_in_browser.py runs/quickstart --screenshot /tmp/report.png
    python bench/check_report_in_browser.py runs/a runs/b --out /tmp/compare --screenshot docs/report.png --width 1100
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from finetune.report import write_report
from finetune.report.plots import RUN_COLOURS

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MIN_PIXELS_PER_RUN = 2000  # a plotted line in 7 panels covers tens of thousands of pixels; text alone none


def find_chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    sys.exit(f"no Chromium found (tried {', '.join(CHROMIUM_NAMES)}); apt-get install chromium")


def screenshot(page: Path, out: Path, width: int, height: int) -> None:
    """Render `page` in headless Chromium with the network unreachable, into `out` (PNG)."""
    with tempfile.TemporaryDirectory() as profile:
        command = [
            find_chromium(),
            "--headless",
            "--no-sandbox",  # running as root in a container
            "--disable-gpu",
            "--hide-scrollbars",
            "--proxy-server=127.0.0.1:9",  # the discard port, closed: any network request fails
            "--proxy-bypass-list=<-loopback>",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={out}",
            page.resolve().as_uri(),
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=120)


def coloured_pixels(path: Path, colour: str, tolerance: int = 40) -> int:
    """How many pixels of the screenshot are close to `colour` (#rrggbb)."""
    target = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)  # (height, width, 3)
    return int((np.abs(pixels - target) <= tolerance).all(axis=-1).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="where to write the report (default: as finetune report does)")
    parser.add_argument("--screenshot", type=Path, default=Path("report-screenshot.png"))
    parser.add_argument("--width", type=int, default=1180)
    parser.add_argument("--height", type=int, default=2600)
    args = parser.parse_args()

    files = write_report(args.run_dirs, args.out)
    screenshot(files.html, args.screenshot, args.width, args.height)
    with Image.open(args.screenshot) as image:
        print(f"{files.html} -> {args.screenshot} ({image.size[0]}x{image.size[1]})")
    failed = False
    for index, run_dir in enumerate(args.run_dirs):
        count = coloured_pixels(args.screenshot, RUN_COLOURS[index % len(RUN_COLOURS)])
        ok = count >= MIN_PIXELS_PER_RUN
        failed |= not ok
        print(f"{run_dir}: {count} pixels of its plot colour {'(ok)' if ok else '(TOO FEW: plots not displayed?)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
