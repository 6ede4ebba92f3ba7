"""Node attributes: MXNet's strings parsed once into typed values, written back in MXNet's spelling.

MXNet stores every operator attribute as a string (``"kernel": "(3, 3)"``,
``"no_bias": "True"``, ``"eps": "1e-05"``).  :class:`Attrs` keeps the original
string of each attribute so that an untouched node is written back byte for
byte, and parses it on first access into a Python value:

=====================  ======================
MXNet string           Python value
=====================  ======================
``"True"``/``"false"`` ``True``/``False``
``"4"``                ``4``
``"1e-05"``            ``1e-05``
``"(3, 3)"``/``"[1]"`` ``(3, 3)``/``(1,)``
``"None"``             ``None``
anything else          the string itself
=====================  ======================

Setting an attribute formats the value the way MXNet itself prints it.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterator, Mapping, MutableMapping

_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan|infinity)$", re.I)
_MISSING = object()
_MAX_NESTING = 32


def parse_value(text: str) -> Any:
    """Parse one MXNet attribute string into a Python value (see module docs)."""
    s = text.strip()
    if s in ("True", "true"):
        return True
    if s in ("False", "false"):
        return False
    if s == "None":
        return None
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        return float(s)
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        if len(s) - len(s.lstrip("([ ")) > _MAX_NESTING:
            return text           # no MXNet attribute nests so deep: keep the string (and the stack)
        body = s[1:-1].strip().rstrip(",")
        if not body:
            return ()
        parts = [parse_value(p) for p in body.split(",")]
        return tuple(parts)
    return text


def format_value(value: Any) -> str:
    """Format a Python value as MXNet spells it in Symbol JSON."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "None"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == int(value) and abs(value) < 1e16:
            return str(int(value)) if value != 0 or math.copysign(1, value) > 0 else "-0"
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [format_value(v) for v in value]
        if len(items) == 1:
            return "(%s,)" % items[0]
        return "(" + ", ".join(items) + ")"
    return str(value)


class Attrs(MutableMapping):
    """A node's attributes: typed on read, MXNet-spelled on write, lossless when untouched."""

    __slots__ = ("_raw", "_parsed")

    def __init__(self, raw: Mapping[str, str] | None = None):
        self._raw: Dict[str, str] = dict(raw or {})
        self._parsed: Dict[str, Any] = {}

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "Attrs":
        a = cls()
        for k, v in values.items():
            a[k] = v
        return a

    def __getitem__(self, key: str) -> Any:
        v = self._parsed.get(key, _MISSING)
        if v is _MISSING:
            v = parse_value(self._raw[key])
            self._parsed[key] = v
        return v

    def __setitem__(self, key: str, value: Any) -> None:
        self._raw[key] = value if isinstance(value, str) else format_value(value)
        self._parsed.pop(key, None)

    def __delitem__(self, key: str) -> None:
        del self._raw[key]
        self._parsed.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def raw(self, key: str, default: str | None = None) -> str | None:
        """The attribute's string exactly as MXNet stores it."""
        return self._raw.get(key, default)

    def to_json(self) -> Dict[str, str]:
        return dict(self._raw)

    def copy(self) -> "Attrs":
        return Attrs(self._raw)

    def __repr__(self) -> str:
        return "Attrs(%r)" % self._raw
