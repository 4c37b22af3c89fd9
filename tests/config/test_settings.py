"""Settings read from the environment: every SQLite database gets the settings that keep
concurrent writers from failing, however it was configured.

Each test runs a fresh copy of config/settings.py under its own environment (runpy, in this
process: the settings are what the module computes from the environment at import, and a
subprocess per case only added an interpreter start); the suite's own settings are untouched."""

import runpy
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

SETTINGS = Path(__file__).resolve().parent.parent.parent / "config" / "settings.py"


def settings_module(monkeypatch, tmp_path, **env) -> dict:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(SETTINGS))


def database_settings(monkeypatch, tmp_path, **env) -> dict:
    return settings_module(monkeypatch, tmp_path, **env)["DATABASES"]["default"]


@pytest.mark.parametrize("url", [None, "sqlite:///{home}/other.sqlite3"])
def test_every_sqlite_database_gets_wal_immediate_and_a_busy_timeout(monkeypatch, tmp_path, url):
    env = {"DATABASE_URL": url.format(home=tmp_path)} if url else {}
    database = database_settings(monkeypatch, tmp_path, **env)
    assert database["ENGINE"] == "django.db.backends.sqlite3"
    options = database["OPTIONS"]
    assert options["transaction_mode"] == "IMMEDIATE"
    assert options["timeout"] >= 30
    assert "journal_mode=WAL" in options["init_command"]
    expected = tmp_path / ("other.sqlite3" if url else "db.sqlite3")
    assert Path(database["NAME"]) == expected


def test_postgres_gets_no_sqlite_options(monkeypatch, tmp_path):
    database = database_settings(
        monkeypatch, tmp_path, DATABASE_URL="postgres://u@127.0.0.1:5432/x"
    )
    assert "transaction_mode" not in database.get("OPTIONS", {})
    assert database["CONN_MAX_AGE"] == 0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_render_timeout_must_be_a_positive_number(monkeypatch, tmp_path, value):
    with pytest.raises(ImproperlyConfigured, match="ORCHARD_RENDER_TIMEOUT_SECONDS"):
        settings_module(monkeypatch, tmp_path, ORCHARD_RENDER_TIMEOUT_SECONDS=value)


def test_trusted_proxies_are_networks_in_their_normal_form(monkeypatch, tmp_path):
    assert settings_module(monkeypatch, tmp_path)["ORCHARD_TRUSTED_PROXIES"] == []
    proxies = " 127.0.0.1, 10.1.2.3/8 ,fd00::/8"
    found = settings_module(monkeypatch, tmp_path, ORCHARD_TRUSTED_PROXIES=proxies)
    assert found["ORCHARD_TRUSTED_PROXIES"] == ["127.0.0.1/32", "10.0.0.0/8", "fd00::/8"]


@pytest.mark.parametrize("value", ["nginx", "10.0.0.0/33", "127.0.0.1;10.0.0.1"])
def test_a_trusted_proxy_must_be_an_address_or_a_network(monkeypatch, tmp_path, value):
    with pytest.raises(ImproperlyConfigured, match="ORCHARD_TRUSTED_PROXIES"):
        settings_module(monkeypatch, tmp_path, ORCHARD_TRUSTED_PROXIES=value)


def test_the_response_storage_quota_is_bytes_and_not_negative(monkeypatch, tmp_path):
    found = settings_module(monkeypatch, tmp_path)
    assert found["ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM"] == 256 * 1024 * 1024
    found = settings_module(monkeypatch, tmp_path, ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM="1000")
    assert found["ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM"] == 1000
    with pytest.raises(ImproperlyConfigured, match="ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM"):
        settings_module(monkeypatch, tmp_path, ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM="-1")


def test_the_body_caps_are_positive_and_django_never_refuses_below_them(monkeypatch, tmp_path):
    found = settings_module(monkeypatch, tmp_path)
    caps = (found["ORCHARD_MAX_BODY_BYTES"], found["ORCHARD_MAX_EMBEDDINGS_BODY_BYTES"])
    assert caps == (4 * 1024 * 1024, 8 * 1024 * 1024)
    assert found["DATA_UPLOAD_MAX_MEMORY_SIZE"] == 8 * 1024 * 1024
    found = settings_module(monkeypatch, tmp_path, ORCHARD_MAX_BODY_BYTES="20000000")
    assert found["DATA_UPLOAD_MAX_MEMORY_SIZE"] == 20_000_000
    monkeypatch.delenv("ORCHARD_MAX_BODY_BYTES")
    for name in ("ORCHARD_MAX_BODY_BYTES", "ORCHARD_MAX_EMBEDDINGS_BODY_BYTES"):
        with pytest.raises(ImproperlyConfigured, match="must be at least 1"):
            settings_module(monkeypatch, tmp_path, **{name: "0"})
        monkeypatch.delenv(name)


def test_the_prefix_cache_disk_tier_is_a_size_under_orchard_home(monkeypatch, tmp_path):
    monkeypatch.delenv("ORCHARD_PREFIX_DISK_BYTES", raising=False)  # the suite turns it off
    found = settings_module(monkeypatch, tmp_path)
    assert found["ORCHARD_PREFIX_DISK_BYTES"] == 4 << 30
    assert found["ORCHARD_PREFIX_DISK_DIR"] == tmp_path / "prefix-cache"
    for value, size in (("512M", 512 << 20), ("2GiB", 2 << 30), ("1000000", 10**6), ("0", 0)):
        found = settings_module(monkeypatch, tmp_path, ORCHARD_PREFIX_DISK_BYTES=value)
        assert found["ORCHARD_PREFIX_DISK_BYTES"] == size
    for value in ("0.5", "lots", "-1GiB"):
        with pytest.raises(ImproperlyConfigured, match="ORCHARD_PREFIX_DISK_BYTES must be a size"):
            settings_module(monkeypatch, tmp_path, ORCHARD_PREFIX_DISK_BYTES=value)


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan", "half"])
def test_the_flex_yield_share_is_above_0_and_at_most_1(monkeypatch, tmp_path, value):
    assert settings_module(monkeypatch, tmp_path)["ORCHARD_FLEX_YIELD_SHARE"] == 0.25
    found = settings_module(monkeypatch, tmp_path, ORCHARD_FLEX_YIELD_SHARE="1")
    assert found["ORCHARD_FLEX_YIELD_SHARE"] == 1.0
    with pytest.raises(ImproperlyConfigured, match="ORCHARD_FLEX_YIELD_SHARE"):
        settings_module(monkeypatch, tmp_path, ORCHARD_FLEX_YIELD_SHARE=value)
