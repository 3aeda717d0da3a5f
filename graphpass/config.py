"""The one frozen configuration object of graphpass, and its validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CODEGENS = ("inductor", "eager")
FP8_RECIPES = (None, "tensorwise", "blockwise", "mxfp8")
KERNELS = ("auto", "te", "scaled_mm", "reference")

# Valid values of the fields that take one of a fixed set; the CLI builds its flags from this.
CHOICES: dict[str, tuple[Any, ...]] = {"codegen": CODEGENS, "fp8": FP8_RECIPES, "kernels": KERNELS}


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

    fp8: str | None = None
    """FP8 recipe for linear layers: ``None`` (off), ``"tensorwise"``, ``"blockwise"``, ``"mxfp8"``."""

    kernels: str = "auto"
    """FP8 kernel provider: ``"auto"``, ``"te"``, ``"scaled_mm"`` or ``"reference"``."""

    fp8_exclude: tuple[str, ...] = ("output", "lm_head", "*.gate", "*.router")
    """Module-path patterns (fnmatch) of linears kept in high precision: the output head and MoE
    routers by default, as Megatron and torchtitan do."""

    fp8_min_gemm_flops: int = 0
    """Linears whose forward GEMM has fewer FLOPs (2*M*N*K) stay in high precision."""

    def __post_init__(self) -> None:
        if self.fp8 == "delayed":
            raise ValueError(
                "invalid graphpass option fp8='delayed': DelayedScaling keeps amax history as "
                "state across steps, which torch.compile cannot trace (Transformer Engine refuses "
                "it under compile too); use fp8='tensorwise' (current scaling), 'blockwise' or "
                "'mxfp8'"
            )
        for name, valid in CHOICES.items():
            _choice(name, getattr(self, name), valid)
        if self.kernels in ("scaled_mm", "te") and self.fp8 not in (None, "tensorwise"):
            raise ValueError(
                f"invalid graphpass options kernels={self.kernels!r} with fp8={self.fp8!r}: that "
                "provider runs fp8='tensorwise' only; use kernels='reference' (or 'auto') for "
                f"fp8={self.fp8!r}"
            )
        _type("report", self.report, bool)
        if isinstance(self.fp8_exclude, str) or not all(isinstance(p, str) for p in self.fp8_exclude):
            raise ValueError(
                f"invalid graphpass option fp8_exclude={self.fp8_exclude!r}; expected a tuple of "
                "module-path patterns such as ('output', '*.gate')"
            )
        object.__setattr__(self, "fp8_exclude", tuple(self.fp8_exclude))
        _type("fp8_min_gemm_flops", self.fp8_min_gemm_flops, int)

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
