import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from django.core.management.base import BaseCommand, CommandError

from engine import GROUP_SIZES, QUANTIZE_BITS, format_bytes
from inference.models import ModelEntry, ModelPull
from inference.services.pulls import (
    PullProgress,
    PullRequestError,
    pull_create,
    run_pull,
    runner_id,
)
from inference.services.pulls.run import MESSAGE_INTERRUPTED

BAR_WIDTH = 24
REDRAW_S = 0.2
# How often Ctrl-C is handed to the main thread again until it has raised KeyboardInterrupt.
CTRL_C_RETRY_S = 0.2


class Command(BaseCommand):
    help = (
        "Pull a model from the Hugging Face hub (HF_ENDPOINT; HF_TOKEN for gated repos) into "
        "$ORCHARD_HOME/models/NAME, converting it to MLX when it is not (and quantizing it "
        "with --quantize), and register it. An interrupted pull resumes where it stopped."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "source", metavar="ID[@REVISION]", help="org/name, e.g. Qwen/Qwen3-0.6B"
        )
        parser.add_argument("--revision", help="a branch, tag or commit (default main)")
        parser.add_argument(
            "--quantize", type=int, choices=QUANTIZE_BITS, help="quantize to 4 or 8 bits"
        )
        parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64)
        parser.add_argument(
            "--name", help="the registry name (default: the repo's name in lower case)"
        )
        parser.add_argument("--kind", choices=ModelEntry.Kind.values, default="chat")

    def handle(self, *args, **options):
        runner = runner_id()
        try:
            pull = pull_create(
                source=options["source"],
                revision=options["revision"],
                name=options["name"],
                kind=options["kind"],
                bits=options["quantize"],
                group_size=options["group_size"],
                origin=ModelPull.Origin.SHELL,
                runner=runner,
            )
        except PullRequestError as exc:
            raise CommandError(str(exc)) from None
        if pull.attempts > 1:
            self.stderr.write(f"Resuming pull #{pull.pk} ({pull}).")
        bar = ProgressBar(self.stderr)
        try:
            with ctrl_c_reaches_the_main_thread():
                pull = run_pull(pull, runner=runner, on_change=bar.show)
        except KeyboardInterrupt:
            raise CommandError(MESSAGE_INTERRUPTED) from None
        finally:
            bar.close()
        if pull.state != ModelPull.State.DONE:
            raise CommandError(pull.error or f"The pull ended {pull.state}.")
        entry = pull.model
        how = (
            f"{entry.quantization_bits}-bit, group {entry.quantization_group_size}"
            if entry.quantization_bits
            else "as published"
        )
        self.stdout.write(
            f"Registered {entry.name} ({entry.kind}, {how}): {pull.source}@{pull.commit[:12]} "
            f"in {entry.path} ({format_bytes(entry.size_on_disk_bytes or 0)})"
        )


@contextlib.contextmanager
def ctrl_c_reaches_the_main_thread() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the main thread even when it is blocked in a read.

    Python's C-level SIGINT handler only sets a flag, which the main thread checks between
    bytecodes and when a blocking call returns EINTR. A SIGINT that arrives after the main
    thread's last check but before it blocks in poll() (a window a loaded machine stretches)
    interrupts nothing, and KeyboardInterrupt waits for the read: on a stalled download, the
    hub's timeout. The C handler also writes the signal to the wakeup fd, whatever the timing,
    so a thread reading it sends SIGINT to the main thread again until KeyboardInterrupt has
    been raised. It is raised once: a second Ctrl-C does not break the pull's marking as
    interrupted."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield  # not the main thread, or SIGINT handled otherwise (ignored stays ignored)
        return
    raised, done = threading.Event(), threading.Event()
    main = threading.main_thread().ident

    def on_sigint(signum, frame):
        if not raised.is_set():
            raised.set()
            raise KeyboardInterrupt

    def watch(fd: int) -> None:
        while data := os.read(fd, 64):
            if signal.SIGINT in data:
                while not raised.wait(CTRL_C_RETRY_S) and not done.is_set():
                    signal.pthread_kill(main, signal.SIGINT)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    watcher = threading.Thread(target=watch, args=(read_fd,), name="pull-ctrl-c", daemon=True)
    watcher.start()
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # the watcher's read returns b"": it ends
        watcher.join()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(read_fd)


class ProgressBar:
    """One line per phase on the terminal, redrawn in place: the phase, a bar, bytes done of
    total, the rate and the time left. Without a terminal, a line per phase and its end."""

    def __init__(self, out) -> None:
        self.out = out  # the command's OutputWrapper
        self.tty = out.isatty()
        self.state: str | None = None
        self.drawn_at = 0.0
        self.last: PullProgress | None = None

    def show(self, progress: PullProgress) -> None:
        now = time.monotonic()
        if progress.state != self.state:
            self._end_line()
            self.state = progress.state
        elif now - self.drawn_at < REDRAW_S:
            self.last = progress
            return
        self.last, self.drawn_at = progress, now
        if self.tty:
            self.out.write("\r" + line(progress) + "\x1b[K", style_func=str, ending="")
            self.out.flush()

    def close(self) -> None:
        self._end_line()

    def _end_line(self) -> None:
        if self.last is None:
            return
        start, clear = ("\r", "\x1b[K") if self.tty else ("", "")
        self.out.write(start + line(self.last) + clear, style_func=str)
        self.out.flush()
        self.last = None


def line(progress: PullProgress) -> str:
    text = f"{progress.state:<12}"
    if not progress.total:
        return text + (f" {format_bytes(progress.done)}" if progress.done else "")
    share = min(1.0, progress.done / progress.total)
    filled = int(share * BAR_WIDTH)
    text += f" [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {share:6.1%}"
    text += f"  {format_bytes(progress.done)} / {format_bytes(progress.total)}"
    if progress.rate:
        left = (progress.total - progress.done) / progress.rate
        text += f"  {format_bytes(progress.rate)}/s  ETA {_duration(left)}"
    return text


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
