"""The one reader of the environment. Settings modules ask here; nothing else reads os.environ."""

import ipaddress
import math
import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str | None = None, *, required: bool = False) -> str | None:
    value = os.environ.get(name)
    if value in (None, ""):
        if required:
            raise ImproperlyConfigured(f"Set the {name} environment variable.")
        return default
    return value


def env_bool(name: str, default: bool = False) -> bool:
    value = env_str(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), not {value!r}.")


def env_int(name: str, default: int) -> int:
    value = env_str(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, not {value!r}.") from None


def env_float(name: str, default: float, *, positive: bool = False) -> float:
    value = env_str(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, not {value!r}.") from None
    if not math.isfinite(number) or (positive and number <= 0):
        kind = "a positive number" if positive else "a finite number"
        raise ImproperlyConfigured(f"{name} must be {kind}, not {value!r}.")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = env_str(name)
    return default if value is None else [item.strip() for item in value.split(",") if item.strip()]


def env_percent(name: str, value: str) -> int:
    """One percentage (1 to 100) of the list `name` holds."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= 100:
        raise ImproperlyConfigured(
            f"{name} must be percentages from 1 to 100 (e.g. 50,80,100), not {value!r}."
        )
    return number


def ip_networks(name: str, values: list[str]) -> list[str]:
    """`values` (read from `name`) as IP networks in their normal form: "10.0.0.0/8", an address
    a network of one ("127.0.0.1/32"). Anything else raises ImproperlyConfigured."""
    try:
        return [str(ipaddress.ip_network(value, strict=False)) for value in values]
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"{name} must be comma-separated IP addresses or networks (CIDR): {exc}"
        ) from None


def orchard_home() -> Path:
    home = Path(env_str("ORCHARD_HOME", str(BASE_DIR / "var")))
    return home if home.is_absolute() else (BASE_DIR / home)


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def env_share_or_bytes(name: str, default: float) -> tuple[float | None, int | None]:
    """A share of something (a number in (0, 1]) or a size in bytes ("48GiB", "512M",
    "50000000000"): (share, None) or (None, bytes)."""
    value = env_str(name)
    if value is None:
        return default, None
    text = value.strip().lower().replace(" ", "")
    for suffix in ("ib", "b"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    unit = text[-1:] if text[-1:] in _SIZE_UNITS and text[-1:] else ""
    try:
        number = float(text[: len(text) - len(unit)])
    except ValueError:
        number = math.nan
    if math.isfinite(number) and number > 0:
        if not unit and number <= 1:
            return number, None
        if unit or number.is_integer():
            return None, int(number * _SIZE_UNITS[unit])
    raise ImproperlyConfigured(
        f"{name} must be a share of the device's memory (0.7) or a size (48GiB, 512M, or bytes), "
        f"not {value!r}."
    )


def env_bytes(name: str, default: int) -> int:
    """A size in bytes ("4GiB", "512M", "1000000"), or 0."""
    value = env_str(name)
    if value is None:
        return default
    if value.strip() == "0":
        return 0
    try:
        _, size = env_share_or_bytes(name, 0.0)
    except ImproperlyConfigured:
        size = None
    if size is None:
        raise ImproperlyConfigured(
            f"{name} must be a size (4GiB, 512M, or bytes) or 0, not {value!r}."
        )
    return size
