"""Module paths (``layers.3.mlp.down_proj``) as the passes select and the report groups them."""

from __future__ import annotations

import re

OUTSIDE_LAYERS = "(outside layers)"

_LAYER = re.compile(r"(?:^|\.)(layers|h|blocks|layer)\.(\d+)(?=\.|$)")


def layer_of(path: str) -> str:
    """The transformer layer a module path belongs to (``layers.3``), or ``""``."""
    match = _LAYER.search(path)
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def natural_key(text: str) -> tuple[object, ...]:
    """Sort key that orders digit runs by value: ``layers.2`` before ``layers.10``."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text)))


def within(path: str, module: str) -> bool:
    """Whether ``path`` is ``module`` or a module inside it (``layers.0.fc1`` in ``layers.0``)."""
    return path == module or path.startswith(module + ".")


def nested(a: str, b: str) -> bool:
    """Whether one of two module paths is the other or inside it."""
    return within(a, b) or within(b, a)
