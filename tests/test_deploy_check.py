"""Production settings pass `manage.py check --deploy` (warnings count as failures) once the
required variables are set, and refuse to start without them."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

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


def test_production_settings_require_a_secret_key(tmp_path):
    result = _check(tmp_path, DJANGO_ALLOWED_HOSTS="orchard.example.com")
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY" in result.stderr


def test_production_settings_require_allowed_hosts(tmp_path):
    result = _check(tmp_path, DJANGO_SECRET_KEY=secrets.token_urlsafe(64))
    assert result.returncode != 0
    assert "DJANGO_ALLOWED_HOSTS" in result.stderr
