"""Pulls against the local hub (tests/fixtures/hub.py): the settings pointing at it, a models
folder per test, and `manage.py pull` as a real process sharing the test database."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inference.models import ModelPull
from tests.fixtures.daphne import ROOT, server_env


@pytest.fixture
def models_dir(settings, tmp_path) -> Path:
    settings.ORCHARD_MODELS_DIR = tmp_path / "home" / "models"
    return settings.ORCHARD_MODELS_DIR


@pytest.fixture
def hub(local_hub, settings, models_dir, monkeypatch, tmp_path):
    """The local hub as HF_ENDPOINT, no HF_TOKEN, and a models folder of this test's own."""
    settings.HF_ENDPOINT = local_hub.url
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    return local_hub


def shell_env(hub, models_dir: Path) -> dict[str, str]:
    """A shell's environment for `manage.py pull`: this test's database and ORCHARD_HOME (the
    models folder's parent), the hub as HF_ENDPOINT."""
    env = server_env()
    env.pop("HF_TOKEN", None)
    env.update(ORCHARD_HOME=str(models_dir.parent), HF_ENDPOINT=hub.url, HF_TOKEN_PATH=os.devnull)
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack (`finish`)
    return env


def start_pull(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", "pull", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`process.communicate(timeout)`; a process still running then is aborted, and the
    failure shows where each of its threads was (its faulthandler's dump on stderr)."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # not even the abort ended it
            process.kill()
            _, err = process.communicate()
        raise AssertionError(
            f"the pull was still running after {timeout:g} s; its stacks:\n{err[-6000:]}"
        ) from None


def wait_for(check, timeout: float = 60.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def pull_row(**filters) -> ModelPull:
    return ModelPull.objects.get(**filters)
