"""The rule language: ``pattern=style[:parts]``, a module-path pattern and how its parameters split."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .common import TensorParallelError

STYLES = ("column", "row", "vocab", "replicate")


@dataclass(frozen=True)
class Rule:
    """Parameters under modules matching ``pattern`` (fnmatch on the module path) are split by ``style``."""

    pattern: str
    style: str
    parts: int = 1

    def __str__(self) -> str:
        return f"{self.pattern}={self.style}" + (f":{self.parts}" if self.parts > 1 else "")


def parse_rules(text: str) -> list[Rule]:
    """``pattern=style[:parts];...`` (the pass option's text form)."""
    rules = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        pattern, sep, style = item.rpartition("=")
        style, _, parts = style.partition(":")
        if not sep or not pattern or style not in STYLES:
            raise TensorParallelError(f"tensor_parallel rule {item!r}: expected pattern=style[:parts] "
                                      f"with style one of {', '.join(STYLES)}")
        if parts and (not parts.isdigit() or int(parts) < 1):
            raise TensorParallelError(f"tensor_parallel rule {item!r}: parts must be an integer >= 1")
        rules.append(Rule(pattern.strip(), style, int(parts or 1)))
    return rules


def format_rules(rules: Iterable[Rule]) -> str:
    return ";".join(map(str, rules))
