"""Settings read from the environment: every SQLite database gets the settings that keep
concurrent writers from failing, however it was configured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
PRINT_DATABASE = (
    "import json, django; from django.conf import settings; django.setup(); "
    "print(json.dumps(settings.DATABASES['default'], default=str))"
)


def database_settings(tmp_path, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "-c", PRINT_DATABASE],
        cwd=ROOT,
        env={
            **base,
            "ORCHARD_HOME": str(tmp_path),
            "DJANGO_SETTINGS_MODULE": "config.settings",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("url", [None, "sqlite:///{home}/other.sqlite3"])
def test_every_sqlite_database_gets_wal_immediate_and_a_busy_timeout(tmp_path, url):
    env = {"DATABASE_URL": url.format(home=tmp_path)} if url else {}
    database = database_settings(tmp_path, **env)
    assert database["ENGINE"] == "django.db.backends.sqlite3"
    options = database["OPTIONS"]
    assert options["transaction_mode"] == "IMMEDIATE"
    assert options["timeout"] >= 30
    assert "journal_mode=WAL" in options["init_command"]
    expected = tmp_path / ("other.sqlite3" if url else "db.sqlite3")
    assert Path(database["NAME"]) == expected


def test_postgres_gets_no_sqlite_options(tmp_path):
    database = database_settings(tmp_path, DATABASE_URL="postgres://u@127.0.0.1:5432/x")
    assert "transaction_mode" not in database.get("OPTIONS", {})
    assert database["CONN_MAX_AGE"] == 0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_render_timeout_must_be_a_positive_number(tmp_path, value):
    base = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    result = subprocess.run(
        [sys.executable, "-c", PRINT_DATABASE],
        cwd=ROOT,
        env={
            **base,
            "ORCHARD_HOME": str(tmp_path),
            "DJANGO_SETTINGS_MODULE": "config.settings",
            "ORCHARD_RENDER_TIMEOUT_SECONDS": value,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "ORCHARD_RENDER_TIMEOUT_SECONDS" in result.stderr
