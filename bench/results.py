"""How a benchmark records its latest run in bench/RESULTS.md, the same way for every script.

Each script owns one section: a heading, then its latest block between two markers named after
the script. A rerun replaces that block and leaves the rest of the file as it was (the notes and
older runs written by hand, the other scripts' sections). Every block opens with the same lines
(`run_header`): the command as it was typed, then when and on what it ran.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, for a run's block (a busy machine skews a run)."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name, for a run's block."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_header(script: str, machine: str, *, note: str = "") -> list[str]:
    """The first lines of a run's block: the command (with `note` after it), then the date and
    the CPU count, followed by `machine` (what shared it, the load, the libraries)."""
    command = shlex.join([".venv/bin/python", f"bench/{script}", *sys.argv[1:]])
    now = datetime.datetime.now(datetime.UTC)
    return [
        f"Command: `{command}`{note}",
        "",
        f"Date: {now:%Y-%m-%d %H:%M} UTC. Machine: {os.cpu_count()} CPU cores "
        f"({platform.machine()}){machine}",
    ]


def write_results(script: str, heading: str, block: str, path: Path = RESULTS) -> None:
    """Put `block` between `script`'s markers in `path`, in place of the block there; the first
    time, under the section's title (`# heading (bench/script)`), or as a new section at the
    end when the file has no such title yet."""
    start = f"<!-- bench/{script}: latest run (written by the script) -->"
    end = f"<!-- bench/{script}: end of latest run -->"
    title = f"# {heading} (bench/{script})"
    # Read right before writing: a long run must not put back what others wrote meanwhile.
    text = path.read_text() if path.exists() else ""
    wrapped = f"{start}\n{block}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + wrapped + rest.split(end, 1)[1]
    elif title in text:
        head, rest = text.split(title, 1)
        text = f"{head}{title}\n\n{wrapped}\n{rest}"
    else:
        text = f"{text.rstrip()}\n\n{title}\n\n{wrapped}\n"
    path.write_text(text)
