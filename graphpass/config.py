"""The one frozen configuration object of graphpass, and its validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CODEGENS = ("inductor", "eager")


@dataclass(frozen=True)
class Config:
    """Options of the graphpass backend and partitioner.

    Every field is validated on construction; an invalid value raises a ValueError that names the
    valid values. ``Config.from_options(**kw)`` also rejects unknown option names.
    """

    codegen: str = "inductor"
    """Code generation after partitioning: ``"inductor"`` (default) or ``"eager"``."""

    report: bool = True
    """Build a saved-tensor report after each partition (``graphpass.last_report()``)."""

    def __post_init__(self) -> None:
        _choice("codegen", self.codegen, CODEGENS)
        _type("report", self.report, bool)

    @classmethod
    def from_options(cls, **options: Any) -> "Config":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(
                f"unknown graphpass option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(names)}"
            )
        return cls(**options)

    def replace(self, **options: Any) -> "Config":
        return Config.from_options(**{**self.as_dict(), **options})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _choice(name: str, value: Any, valid: tuple[Any, ...]) -> None:
    if value not in valid:
        raise ValueError(
            f"invalid graphpass option {name}={value!r}; valid values are: "
            + ", ".join(map(repr, valid))
        )


def _type(name: str, value: Any, typ: type) -> None:
    if not isinstance(value, typ):
        raise ValueError(
            f"invalid graphpass option {name}={value!r}; expected a {typ.__name__}"
        )


__all__ = ["Config"]
