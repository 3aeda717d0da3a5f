"""Command-line flags generated from ``Config``'s keywords (the fields of its option groups, by
their ``config.SHORTHAND`` names), so new fields need no CLI change.

Each keyword becomes ``--field-name`` with a syntax chosen by its type (see :func:`config_flags`);
the same syntax serves ``key=value`` policy items (:func:`parse_policy`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from typing import Any, Callable, Sequence

from .config import CHOICES, DEPRECATED, ITEM_CHOICES, Config, option_fields


@dataclasses.dataclass(frozen=True)
class ConfigFlag:
    """One ``Config`` field as a command-line flag and as a ``key=value`` policy item."""

    name: str
    convert: Callable[[str], Any]
    metavar: str | None
    is_bool: bool
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def config_flags(
    config_cls: type = Config,
    choices: dict[str, tuple[Any, ...]] = CHOICES,
    item_choices: dict[str, tuple[str, ...]] = ITEM_CHOICES,
) -> list[ConfigFlag]:
    """A flag per keyword of ``Config`` (``config.option_fields``; for another dataclass, per
    field), so fields added to ``Config``'s groups appear without touching the CLI.

    Choice fields take one of ``choices[name]`` (``None`` written ``none``), bools are
    ``--x/--no-x``, ``tuple[str, ...]`` fields are comma-separated (items checked against
    ``item_choices[name]``), ints, floats and strings are taken as such, and ``X | None`` also
    takes ``none``. Any other field type is a TypeError here rather than a silently missing flag.
    """
    fields = (option_fields() if config_cls is Config
              else [(f.name, config_cls, f) for f in dataclasses.fields(config_cls)])
    flags = []
    for name, owner, f in fields:
        hint = typing.get_type_hints(owner)[f.name]
        if name in choices:
            convert, metavar = _choice(choices[name]), "{" + ",".join(map(show, choices[name])) + "}"
        elif name in item_choices:
            convert, metavar = _items(item_choices[name]), "{" + ",".join(item_choices[name]) + "},..."
        else:
            known = _typed(hint)
            if known is None:
                raise TypeError(
                    f"{owner.__name__}.{f.name} has type {hint!r}, which the CLI cannot "
                    "express as a flag: give it CHOICES or a bool/int/float/str/tuple[str, ...] type "
                    "(or one of those | None)")
            convert, metavar = known
        help_text = f"{_field_docs(owner).get(f.name, '')} (default: {_default(f)})".strip()
        flags.append(ConfigFlag(name, convert, metavar, hint is bool, help_text.replace("%", "%%")))
    return flags


def _typed(hint: Any) -> tuple[Callable[[str], Any], str | None] | None:
    """Converter and metavar for a field type, or None when the CLI has no syntax for it."""
    if hint is bool:
        return _bool, "true|false"
    if hint in (int, float):
        return _number(hint), hint.__name__.upper()
    if hint is str:
        return str, None
    if hint == tuple[str, ...]:
        return _csv, "A,B,..."
    args = typing.get_args(hint)
    if set(args) == {int, float, type(None)}:  # bytes, or a fraction (memory_budget)
        return (lambda text: None if text == "none" else (
            _number(float)(text) if any(c in text for c in ".eE") else _number(int)(text))), \
            "INT|FLOAT|none"
    if len(args) == 2 and type(None) in args:  # X | None
        inner = _typed(next(a for a in args if a is not type(None)))
        if inner is not None:
            convert, metavar = inner
            return (lambda text: None if text == "none" else convert(text)), f"{metavar or 'VALUE'}|none"
    return None


def show(value: Any) -> str:
    """A config value as it is written on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return "empty" if value == () else show(value)


def add_config_flags(parser: argparse.ArgumentParser, flags: Sequence[ConfigFlag]) -> None:
    group = parser.add_argument_group("graphpass options (keywords of graphpass.Config)")
    for fl in flags:
        # SUPPRESS: only flags the user gave reach Config, so its defaults stay the defaults.
        if fl.is_bool:
            group.add_argument(fl.flag, dest=f"cfg_{fl.name}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=fl.help)
        else:
            group.add_argument(fl.flag, dest=f"cfg_{fl.name}", type=_argtype(fl), metavar=fl.metavar,
                               default=argparse.SUPPRESS, help=fl.help)
    # A deprecated keyword's flag (``config.DEPRECATED``), left out of --help: its value reaches
    # Config under the old name, which warns once and gives it to the new keyword.
    by_name = {fl.name: fl for fl in flags}
    for old, new in DEPRECATED.items():
        fl = by_name.get(new)
        if fl is None:
            continue
        flag = "--" + old.replace("_", "-")
        if fl.is_bool:
            group.add_argument(flag, dest=f"cfg_{old}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, dest=f"cfg_{old}", type=_argtype(fl), metavar=fl.metavar,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def parse_policy(spec: str, flags: Sequence[ConfigFlag]) -> dict[str, Any]:
    """``"fp8=tensorwise fp8_exclude=output,lm_head"`` -> options, with the flags' value syntax.

    Raises ValueError naming the bad item.
    """
    by_name = {fl.name: fl for fl in flags}
    options = {}
    for item in spec.split():
        key, eq, value = item.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if not eq or not key:
            raise ValueError("expected space-separated key=value items such as "
                             "'fp8=tensorwise kernels=reference'")
        flag = by_name.get(DEPRECATED.get(key, key))  # an old name: Config warns and renames it
        if flag is None:
            raise ValueError(f"unknown option {key!r}; valid options: {', '.join(by_name)}")
        try:
            options[key] = flag.convert(value)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    return options


def _choice(valid: tuple[Any, ...]) -> Callable[[str], Any]:
    by_text = {show(v): v for v in valid}

    def convert(text: str) -> Any:
        if text not in by_text:
            raise ValueError(f"{text!r} is not one of {', '.join(by_text)}")
        return by_text[text]

    return convert


def _bool(text: str) -> bool:
    value = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}.get(text.lower())
    if value is None:
        raise ValueError(f"expected true or false, got {text!r}")
    return value


def _number(typ: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return typ(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"expected {'an integer' if typ is int else 'a number'}, got {text!r}") from None

    return convert


def _items(valid: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def convert(text: str) -> tuple[str, ...]:
        items = _csv(text)
        wrong = [item for item in items if item not in valid]
        if wrong:
            raise ValueError(f"{', '.join(map(repr, wrong))} not among {', '.join(valid)}")
        return items

    return convert


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _argtype(fl: ConfigFlag) -> Callable[[str], Any]:
    # argparse shows only ArgumentTypeError messages; a ValueError would become "invalid value".
    def parse(text: str) -> Any:
        try:
            return fl.convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = fl.name
    return parse


@functools.lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string after each field), for ``--help``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen app): flags without help text
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field_node, doc in zip(body, body[1:]):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            docs[field_node.target.id] = " ".join(doc.value.value.replace("``", "").split())
    return docs
