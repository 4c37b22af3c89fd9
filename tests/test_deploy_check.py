"""Production settings pass `manage.py check --deploy` (warnings count as failures) once the
required variables are set, and refuse to start without them.

The check runs in its own process (Django is configured once per process, and the suite's is
not the production one); the refusals are the settings module's own, so they run a fresh copy
of it here (runpy)."""

import os
import runpy
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

ROOT = Path(__file__).resolve().parent.parent


def _check(tmp_path, **env) -> subprocess.CompletedProcess:
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("DJANGO_") and key != "DATABASE_URL"
    }
    return subprocess.run(
        [
            sys.executable,
            "manage.py",
            "check",
            "--deploy",
            "--fail-level",
            "WARNING",
            "--settings=config.settings_production",
        ],
        cwd=ROOT,
        env={**base, "ORCHARD_HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_production_settings_pass_check_deploy(tmp_path):
    result = _check(
        tmp_path,
        DJANGO_SECRET_KEY=secrets.token_urlsafe(64),
        DJANGO_ALLOWED_HOSTS="orchard.example.com",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def _production_settings(monkeypatch, tmp_path, **env) -> dict:
    for name in ("DJANGO_SECRET_KEY", "DJANGO_ALLOWED_HOSTS", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(ROOT / "config" / "settings_production.py"))


def test_production_settings_require_a_secret_key(monkeypatch, tmp_path):
    with pytest.raises(ImproperlyConfigured, match="DJANGO_SECRET_KEY"):
        _production_settings(monkeypatch, tmp_path, DJANGO_ALLOWED_HOSTS="orchard.example.com")


def test_production_settings_require_allowed_hosts(monkeypatch, tmp_path):
    with pytest.raises(ImproperlyConfigured, match="DJANGO_ALLOWED_HOSTS"):
        _production_settings(monkeypatch, tmp_path, DJANGO_SECRET_KEY=secrets.token_urlsafe(64))
    hosts = _production_settings(
        monkeypatch,
        tmp_path,
        DJANGO_SECRET_KEY=secrets.token_urlsafe(64),
        DJANGO_ALLOWED_HOSTS="orchard.example.com, api.example.com",
    )["ALLOWED_HOSTS"]
    assert hosts == ["orchard.example.com", "api.example.com"]
