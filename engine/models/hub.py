"""A model's files from the Hugging Face hub (or the mirror at HF_ENDPOINT), through
huggingface_hub: which files a model needs, and downloads that survive an interruption.

Only what serving needs is fetched: config and generation config, tokenizer and chat-template
files, and the `model*.safetensors` weights with their index (what mlx-lm loads); never `.bin`,
`.pth`, `.gguf`, ONNX, `original/` or other duplicates. An embedding model also gets its
sentence-transformers files (`modules.json`, the pooling config).

Why not `snapshot_download`: huggingface_hub 2.4 downloads each file into a process-unique
temporary file and deletes it when the download fails (huggingface_hub PR #4228), so a pull that
was killed starts over. Here each file grows as `<name>.incomplete` in the pull's staging folder,
and a later pull of the same commit continues it with a `Range` request through
huggingface_hub's own `http_get` (its retries, and its resuming within one process, included);
a finished file is checked against the hub's sha256 before it takes its name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.utils import build_hf_headers

# The files a model needs, by name at the top of the repo (fnmatch patterns).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "tiktoken.model",
    "*.tiktoken",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
    "*.jinja",
    "additional_chat_templates/*.jinja",
    "model.safetensors.index.json",
    "model*.safetensors",
    # A vision-language model's processor (engine/models/vision.py).
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
EMBEDDING_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "*_Pooling/config.json",
)
WEIGHTS = "model*.safetensors"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
PARTIAL_SUFFIX = ".incomplete"
HASH_CHUNK = 8 * 1024 * 1024


class PullError(Exception):
    """A pull cannot go on; the message is the one sentence the admin and the shell show.
    `code`: repo_not_found, gated, revision_not_found, no_weights, unsupported,
    already_quantized, disk_full, network, hub_error, corrupt, busy, exists, convert_failed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PullStopped(Exception):
    """The pull was asked to stop (cancelled)."""


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None  # the LFS hash, where the hub gives one


@dataclass(frozen=True)
class HubPlan:
    """A repo at one commit and the files of it a model needs."""

    repo_id: str
    revision: str  # as asked ("main" when none was)
    commit: str
    files: tuple[HubFile, ...]
    hub_says_mlx: bool  # the hub lists it as an MLX repo (library "mlx", or the tag)
    endpoint: str

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.files if fnmatch.fnmatch(f.path, WEIGHTS))

    def file(self, path: str) -> HubFile | None:
        return next((f for f in self.files if f.path == path), None)


def parse_source(text: str) -> tuple[str, str | None]:
    """`org/name` or `org/name@revision` -> (repo id, revision or None); ValueError for
    anything else."""
    repo_id, _, revision = text.strip().partition("@")
    if not REPO_ID.match(repo_id):
        raise ValueError(
            f"{text.strip()!r} is not a hub model id: expected org/name, optionally "
            "followed by @revision (a branch, tag or commit)."
        )
    return repo_id, revision or None


def needed_files(paths: list[str], *, kind: str) -> list[str]:
    patterns = MODEL_FILES + (EMBEDDING_FILES if kind == "embedding" else ())
    return sorted(
        p for p in paths if _safe(p) and any(_matches(p, pattern) for pattern in patterns)
    )


def _safe(path: str) -> bool:
    # A name from the hub becomes a path on this disk: nothing that climbs out of the folder.
    parts = path.split("/")
    return not path.startswith("/") and "\\" not in path and ".." not in parts and "" not in parts


def _matches(path: str, pattern: str) -> bool:
    # fnmatch's `*` crosses `/`; a pattern matches at its own depth only.
    return path.count("/") == pattern.count("/") and fnmatch.fnmatch(path, pattern)


def hub_plan(
    repo_id: str, *, revision: str | None, kind: str, endpoint: str, token: str | None = None
) -> HubPlan:
    """Resolve `revision` (default main) to a commit and list the files to fetch with their
    sizes. Raises PullError (a missing repo or revision, a repo without safetensors weights,
    the hub unreachable)."""
    asked = revision or "main"
    api = HfApi(endpoint=endpoint, token=token)
    with translated_errors(repo_id, asked, endpoint):
        info = api.model_info(repo_id, revision=asked, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    paths = needed_files(list(siblings), kind=kind)
    files = tuple(
        HubFile(
            path=p,
            size=(siblings[p].lfs.size if siblings[p].lfs else siblings[p].size) or 0,
            sha256=siblings[p].lfs.sha256 if siblings[p].lfs else None,
        )
        for p in paths
    )
    if "config.json" not in siblings:
        raise PullError("unsupported", f"{repo_id} has no config.json: it is not a model repo.")
    if not any(fnmatch.fnmatch(f.path, WEIGHTS) for f in files):
        others = sorted({Path(p).suffix for p in siblings if Path(p).suffix in _OTHER_WEIGHTS})
        found = f" (it has {', '.join(others)} files)" if others else ""
        raise PullError(
            "no_weights",
            f"{repo_id} has no safetensors weights (model*.safetensors){found}; Orchard pulls "
            "safetensors checkpoints only.",
        )
    mlx = info.library_name == "mlx" or "mlx" in (info.tags or [])
    return HubPlan(repo_id, asked, info.sha, files, mlx, endpoint)


_OTHER_WEIGHTS = {".bin", ".pth", ".pt", ".gguf", ".onnx", ".h5", ".msgpack"}


def free_disk_bytes(path: str | Path) -> int:
    """The bytes free on the filesystem holding `path` (or its nearest existing parent)."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def bytes_on_disk(plan: HubPlan, folder: Path) -> int:
    """What is already downloaded of the plan's files in `folder`, partial files included."""
    return sum(_on_disk(folder / f.path, f.size) for f in plan.files)


@contextlib.contextmanager
def staging_lock(folder: Path, *, what: str) -> Iterator[None]:
    """Hold `folder`'s lock while downloading into it: two pulls of the same commit on one host
    would otherwise append to the same partial files."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PullError(
                "busy", f"{what} is being downloaded by another pull on this host right now."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def hub_fetch(
    plan: HubPlan,
    folder: Path,
    *,
    paths: list[str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    token: str | None = None,
) -> None:
    """Download the plan's files (or those in `paths`) into `folder`, continuing partial
    files. `on_bytes(n)` is told the plan's bytes on disk as they grow; `should_stop()` is
    asked as they do, and True stops the download (PullStopped), partial files kept."""
    wanted = [f for f in plan.files if paths is None or f.path in paths]
    on_disk = {f.path: _on_disk(folder / f.path, f.size) for f in plan.files}

    def report(path: str, done: int) -> None:
        on_disk[path] = done
        if on_bytes is not None:
            on_bytes(sum(on_disk.values()))
        if should_stop is not None and should_stop():
            raise PullStopped

    for file in wanted:
        if should_stop is not None and should_stop():
            raise PullStopped
        _fetch_file(
            plan, file, folder / file.path, lambda done, p=file.path: report(p, done), token
        )
        report(file.path, file.size)


def _on_disk(target: Path, size: int) -> int:
    partial = _partial(target)
    if target.is_file():
        return min(target.stat().st_size, size)
    return min(partial.stat().st_size, size) if partial.is_file() else 0


def _partial(target: Path) -> Path:
    return target.with_name(target.name + PARTIAL_SUFFIX)


def _fetch_file(
    plan: HubPlan, file: HubFile, target: Path, report: Callable[[int], None], token: str | None
) -> None:
    if target.is_file() and target.stat().st_size == file.size:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(target)
    url = hf_hub_url(plan.repo_id, file.path, revision=plan.commit, endpoint=plan.endpoint)
    with translated_errors(plan.repo_id, plan.revision, plan.endpoint):
        meta = get_hf_file_metadata(url, token=token, endpoint=plan.endpoint, retry_on_errors=True)
        headers = build_hf_headers(token=token)
        location = meta.location or url
        if urlsplit(location).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)  # a signed CDN address: the token stays home
        size = meta.size if meta.size is not None else file.size
        resume = partial.stat().st_size if partial.is_file() else 0
        if resume > size:
            resume = 0
        with open(partial, "r+b" if partial.exists() else "wb") as out:
            out.seek(resume)
            out.truncate()
            http_get(
                location,
                out,
                resume_size=resume,
                headers=headers,
                expected_size=size,
                displayed_filename=file.path,
                tqdm_class=_meter(report),
            )
    if file.sha256 is not None and _sha256(partial) != file.sha256:
        partial.unlink()
        raise PullError(
            "corrupt",
            f"{file.path} of {plan.repo_id} arrived corrupted (its sha256 differs from the "
            "hub's); pull it again.",
        )
    os.replace(partial, target)


def _meter(report: Callable[[int], None]) -> type:
    """A stand-in for the tqdm bar http_get drives: it tells `report` the file's bytes so far
    (a resumed file starts at its partial size), and raising in `report` stops the download."""

    class Meter:
        def __init__(self, *, initial: int = 0, **_: object) -> None:
            self.done = initial
            report(self.done)

        def __enter__(self) -> Meter:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: int | float | None = 1) -> None:
            self.done += int(n or 0)
            report(self.done)

    return Meter


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def translated_errors(repo_id: str, revision: str, endpoint: str) -> Iterator[None]:
    """huggingface_hub's and the network's errors as PullErrors with a sentence to show."""
    try:
        yield
    except GatedRepoError as exc:
        status = exc.response.status_code if exc.response is not None else 401
        if status == 401:
            raise PullError(
                "gated",
                f"{repo_id} is gated: accept its conditions at {endpoint}/{repo_id} and set "
                "HF_TOKEN to a token of that account.",
            ) from None
        raise PullError(
            "gated",
            f"{repo_id} is gated and the account of HF_TOKEN has no access to it: accept its "
            f"conditions at {endpoint}/{repo_id} with that account.",
        ) from None
    except RepositoryNotFoundError:
        raise PullError(
            "repo_not_found",
            f"There is no model {repo_id} on {endpoint} (check the id; a private repo also "
            "needs HF_TOKEN).",
        ) from None
    except RevisionNotFoundError:
        raise PullError(
            "revision_not_found",
            f"{repo_id} has no revision {revision!r} (a branch, tag or commit).",
        ) from None
    except RemoteEntryNotFoundError as exc:
        raise PullError("hub_error", f"{endpoint}: {_last_line(exc)}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise PullError(
            "hub_error", f"{endpoint} answered {status} for {repo_id}: {_last_line(exc)}"
        ) from None
    except (httpx2.TransportError, httpx2.InvalidURL) as exc:
        raise PullError(
            "network",
            f"Could not download {repo_id} from {endpoint} ({type(exc).__name__}: "
            f"{_last_line(exc) or 'no answer'}); check the network, or HF_ENDPOINT.",
        ) from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise PullError(
                "disk_full", f"The disk filled up while downloading {repo_id} ({exc.strerror})."
            ) from None
        if "Consistency check failed" in str(exc):
            raise PullError(
                "network",
                f"The download of {repo_id} from {endpoint} was cut short; pull it again to "
                "resume it.",
            ) from None
        raise


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else ""
