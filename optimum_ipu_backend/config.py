"""How option values are read: one parser for each kind of value every option source uses.

Provider options, ``ipu_config.json``, environment variables and command-line ``NAME=VALUE`` arguments
all go through these functions, so a value means the same wherever it is given and a bad one gets the
same kind of error (a ``ConfigurationError`` naming where it came from and what is accepted).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from optimum_ipu_backend.errors import ConfigurationError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag_or_none(value: Any) -> bool | None:
    """``True``/``False`` for a boolean or one of 1/0, true/false, yes/no, on/off; None otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return None


def positive_int_or_none(value: Any) -> int | None:
    """A positive integer given as an int, a whole float or decimal digits; None otherwise (booleans
    are not numbers here: ``True`` is a flag someone put in the wrong place)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
        return number if number > 0 else None
    return None


def _number_or_none(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if abs(number) < float("inf") else None


def positive_float_or_none(value: Any) -> float | None:
    """A positive finite number (int, float or its text); None otherwise."""
    number = _number_or_none(value)
    return number if number is not None and number > 0 else None


def non_negative_float_or_none(value: Any) -> float | None:
    """A finite number >= 0 (int, float or its text); None otherwise."""
    number = _number_or_none(value)
    return number if number is not None and number >= 0 else None


def parse_assignment(text: str, what: str, example: str) -> tuple[str, str]:
    """``"NAME=VALUE"`` -> ``("NAME", "VALUE")`` with both sides stripped; ``what`` names the argument
    (``--dim``) and ``example`` shows a good one in the error."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ConfigurationError(f"{what} {text!r} must look like NAME=VALUE, e.g. {example}")
    return name.strip(), value.strip()


def parse_assignments(items: Iterable[str], what: str, example: str) -> dict[str, str]:
    """Each of ``items`` through ``parse_assignment``; a name given twice keeps its last value."""
    return dict(parse_assignment(text, what, example) for text in items)
