"""The recipe's one identity: ``recipes.Recipe``, carried by the graph ops as one key string that
one parser reads (``recipes.get_recipe``); every recipe comparison goes through it."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.fp8 import blockwise_gemm, recipes


class _Experts(nn.Module):
    """bmm experts, 4 x (128 tokens, 256 in, 128 out): every dimension a multiple of 128."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 256, 128) * 0.05)

    def forward(self, x):
        return torch.bmm(x, self.weight)


def _grouped_note(monkeypatch, **options) -> list[str]:
    # the blockwise GEMM is planned as if on Hopper: plan() runs no GEMM
    monkeypatch.setattr(blockwise_gemm, "unsupported", lambda device: None)
    x = torch.randn(4, 128, 256, requires_grad=True)
    report = graphpass.plan(_Experts(), x, config=graphpass.Config(
        kernels="scaled_mm", **options))
    return [n for n in report.notes if n.startswith("grouped gemms")]


BLOCKWISE_NOTE = ("grouped gemms: <root>: forward, dgrad and wgrad one blockwise torch scaled_mm "
                  "per expert: torch has no grouped blockwise FP8 GEMM")


def test_blockwise_without_pow2_scales_notes_the_blockwise_expert_gemms(monkeypatch):
    """``fp8="blockwise", fp8_pow2_scales=False`` is blockwise scaling: its expert linears' note
    says what blockwise runs (one blockwise GEMM per expert), as under the default scales, not
    tensorwise's E5M2 gradients (which blockwise, E4M3 in every role, does not have)."""
    assert _grouped_note(monkeypatch, fp8="blockwise") == [BLOCKWISE_NOTE]
    assert _grouped_note(monkeypatch, fp8="blockwise", fp8_pow2_scales=False) == [BLOCKWISE_NOTE]


# --- the parser ------------------------------------------------------------------------------


def test_every_recipe_round_trips_through_its_key():
    """Each recipe a key names parses back from its key, and each key is printed from its
    recipe: every name, format, scale setting and accumulation (36 recipes), the seven keys the
    graph ops carried before accumulation joined the key among them."""
    keys = recipes._BY_KEY
    assert len(keys) == 36
    for key, recipe in keys.items():
        assert recipe.key == key and recipes.get_recipe(key) is recipe
        assert recipes.get_recipe(recipe.key) == recipe
    for key, recipe in {"tensorwise": recipes.TENSORWISE,
                        "tensorwise_e4m3": recipes.TENSORWISE_E4M3,
                        "blockwise": recipes.BLOCKWISE,
                        "blockwise_nopow2": recipes.BLOCKWISE_NOPOW2,
                        "mxfp8": recipes.MXFP8, "rowwise": recipes.ROWWISE,
                        "rowwise_pow2": recipes.ROWWISE_POW2}.items():
        assert recipes.get_recipe(key) == recipe and recipe.key == key
    fast = recipes.get_recipe("rowwise_pow2_fast")
    assert (fast.name, fast.fp8_format, fast.power_2_scales, fast.accumulate) == (
        "rowwise", "E4M3", True, "fast")
    assert fast.quantization_key == "rowwise_pow2" and fast.label == "rowwise"
    assert fast.accumulation == {"fprop": "fast", "dgrad": "fast", "wgrad": "fast"}
    assert recipes.TENSORWISE.accumulation == {"fprop": "fast", "dgrad": "precise",
                                               "wgrad": "precise"}


def test_keys_that_name_no_recipe_are_refused():
    """A word repeated, out of order, saying the default, or naming no recipe (mxfp8 without
    power-of-two scales, rowwise in HYBRID) is no key; a recipe with an amax epsilon has none."""
    for key in ("nvfp4", "tensorwise_hybrid", "tensorwise_fast_e4m3", "rowwise_te",
                "rowwise_pow2_pow2", "mxfp8_nopow2", "rowwise_hybrid", "blockwise_pow2", ""):
        with pytest.raises(ValueError, match="unknown recipe.*'tensorwise', 'blockwise'"):
            recipes.get_recipe(key)
    with pytest.raises(ValueError, match="torch.compile"):
        recipes.get_recipe("delayed")
    with pytest.raises(ValueError, match="amax_epsilon"):
        dataclasses.replace(recipes.TENSORWISE, amax_epsilon=1e-6).key


@pytest.mark.parametrize("options, key", [
    ({"fp8": "tensorwise"}, "tensorwise"),
    ({"fp8": "tensorwise", "fp8_format": "e4m3"}, "tensorwise_e4m3"),
    ({"fp8": "blockwise"}, "blockwise"),
    ({"fp8": "blockwise", "fp8_pow2_scales": True}, "blockwise"),
    ({"fp8": "blockwise", "fp8_pow2_scales": False}, "blockwise_nopow2"),
    ({"fp8": "mxfp8"}, "mxfp8"),
    ({"fp8": "rowwise"}, "rowwise"),
    ({"fp8": "rowwise", "fp8_pow2_scales": False}, "rowwise"),
    ({"fp8": "rowwise", "fp8_pow2_scales": True}, "rowwise_pow2"),
    ({"fp8": "rowwise", "fp8_pow2_scales": True, "fp8_accumulate": "precise"},
     "rowwise_pow2_precise"),
    ({"fp8": "tensorwise", "fp8_format": "e4m3", "fp8_accumulate": "fast"},
     "tensorwise_e4m3_fast"),
    ({}, None),
])
def test_config_derives_its_recipe_by_one_function(options, key):
    """``Config`` keeps the user's strings; ``Config.recipe`` is ``recipes.from_options`` of
    them, and ``fp8_recipe`` its key."""
    config = graphpass.Config(**options)
    assert config.fp8_recipe == key
    assert config.recipe == (None if key is None else recipes.get_recipe(key))
    assert config.recipe == recipes.from_options(
        config.fp8, config.fp8_format, config.fp8_pow2_scales, config.fp8_accumulate)


def test_config_asks_the_recipe_which_options_it_takes():
    """``fp8_pow2_scales`` and ``fp8_format`` take effect exactly where the recipe has the
    variant they select; elsewhere they are unused, with Config's own note."""
    for name in recipes.RECIPE_NAMES:
        for option, value in (("fp8_pow2_scales", True), ("fp8_format", "e4m3")):
            if recipes.takes_option(name, option):
                assert graphpass.Config(fp8=name, **{option: value}).recipe is not None
            else:
                ignored = graphpass.Config(fp8=name, **{option: value})
                assert [u.option for u in ignored.unused()] == [option]
                assert ignored.recipe == graphpass.Config(fp8=name).recipe
    assert [n for n in recipes.RECIPE_NAMES if recipes.takes_option(n, "fp8_pow2_scales")] == [
        "blockwise", "rowwise"]
    assert [n for n in recipes.RECIPE_NAMES if recipes.takes_option(n, "fp8_format")] == [
        "tensorwise"]


# --- no recipe name compared outside the recipe module -------------------------------------

ROOT = Path(graphpass.__file__).parent
# A recipe name or key: a name of RECIPE_NAMES, alone or with the words of a variant.
_RECIPE = re.compile(r"(%s)(_[a-z0-9]+)*" % "|".join(recipes.RECIPE_NAMES))
# The other vocabulary that says "rowwise": a quantize's usage (which copies it makes).
_USAGES = {"rowwise", "columnwise", "both"}
# config.py validates the user's option strings (which provider runs which fp8=...): there and
# only there a recipe name may be compared, inside these functions.
_ALLOWED = {"fp8/recipes.py": None, "config.py": {"__post_init__"}}


def _recipe_literals(node: ast.AST) -> set[str]:
    """The recipe names among the string constants of ``node`` itself, or of the items of the
    tuple, list, set or dict keys it is."""
    items = [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = node.elts
    elif isinstance(node, ast.Dict):
        items = [k for k in node.keys if k is not None]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)
            and _RECIPE.fullmatch(i.value)}


def _is_usage(literals: set[str], node: ast.AST, other: ast.AST | None) -> bool:
    """A usage, not a recipe: a literal among usages only ("rowwise" beside "columnwise" or
    "both"), or compared with something named for usages."""
    if not literals <= _USAGES:
        return False
    every = {i.value for i in getattr(node, "elts", getattr(node, "keys", [])) or []
             if isinstance(i, ast.Constant)}
    return bool(every & (_USAGES - {"rowwise"})) or (
        other is not None and "usage" in ast.unparse(other))


def recipe_comparisons(source: str, allowed_functions: set[str] | None = None) -> list[str]:
    """Each place in ``source`` that compares a recipe name (``==``, ``!=``, ``in``, ``is``) or
    keeps a table of them (a module or class constant, dict keys) to compare against, outside
    ``allowed_functions``: ``"line: code"``."""
    found = []
    tree = ast.parse(source)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}

    def allowed(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    allowed_functions and node.name in allowed_functions):
                return True
        return False

    for node in ast.walk(tree):
        hits = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for i, side in enumerate(sides):
                literals = _recipe_literals(side)
                other = sides[1 - i] if len(sides) == 2 else None
                if literals and not _is_usage(literals, side, other):
                    hits.append(node)
        elif isinstance(node, ast.Dict):
            literals = _recipe_literals(node)
            if literals and not _is_usage(literals, node, None):
                hits.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and (
                isinstance(parents.get(node), (ast.Module, ast.ClassDef))):
            literals = _recipe_literals(node.value)
            if literals and not _is_usage(literals, node.value, None):
                hits.append(node)
        found += [(hit.lineno, hit.col_offset, ast.get_source_segment(source, hit))
                  for hit in hits if not allowed(hit)]
    return [f"{line}: {code}" for line, _, code in sorted(found)]


def test_no_recipe_name_is_compared_outside_the_recipe_module():
    """Every question about a recipe is asked of a ``Recipe`` (``recipes.get_recipe`` of a graph
    op's key, ``Config.recipe``): no module but ``fp8/recipes.py`` compares a recipe name or
    key, or keeps a table of them, and config.py only where it validates the user's options.
    The usages ``"rowwise"``, ``"columnwise"`` and ``"both"`` are another vocabulary."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _ALLOWED and _ALLOWED[rel] is None:
            continue
        found += [f"graphpass/{rel}:{hit}" for hit in recipe_comparisons(
            path.read_text(encoding="utf-8"), _ALLOWED.get(rel))]
    assert not found, "\n".join(found)


def test_the_comparison_finder_sees_each_form():
    """The finder itself: a compared name, a key, a tuple of names, a table keyed by names, a
    constant alias; usages and other strings are not recipes."""
    source = '''
RECIPE = "blockwise"
INLINED = ("tensorwise", "rowwise")
USAGES = ("rowwise", "columnwise", "both")
def f(recipe, usage, by_usage, config):
    a = recipe == "mxfp8"
    b = recipe in ("rowwise_pow2", "tensorwise_e4m3")
    c = {"tensorwise": 16, "blockwise": 128}[recipe]
    d = usage == "rowwise"
    e = usage in ("rowwise", "both")
    g = "rowwise" in by_usage
    h = recipe == "delayed"
    i = config.fp8 != "tensorwise"
    print("tensorwise")
'''
    found = [line.split(": ", 1)[1] for line in recipe_comparisons(source)]
    assert found == ['RECIPE = "blockwise"', 'INLINED = ("tensorwise", "rowwise")',
                     'recipe == "mxfp8"', 'recipe in ("rowwise_pow2", "tensorwise_e4m3")',
                     '{"tensorwise": 16, "blockwise": 128}', 'config.fp8 != "tensorwise"']
    assert recipe_comparisons(source, {"f"}) == [
        '2: RECIPE = "blockwise"', '3: INLINED = ("tensorwise", "rowwise")']


def test_grouped_quantize_scales_are_a_typed_value():
    """``ops.group_scales``: how a token-grouped quantize's scales meet the groups, per recipe,
    role and copy, one kind each (and the block length where blocks run along the tokens)."""
    from graphpass.fp8.ops import GroupScales, TokenScales, group_scales

    row, group, column, block = (TokenScales.PER_ROW, TokenScales.PER_GROUP,
                                 TokenScales.PER_GROUP_COLUMN, TokenScales.PER_BLOCK)
    expected = {
        ("tensorwise", False): GroupScales(group), ("tensorwise", True): GroupScales(group),
        ("tensorwise_e4m3", True): GroupScales(group),
        ("rowwise", False): GroupScales(row), ("rowwise_pow2", True): GroupScales(column),
        ("blockwise", False): GroupScales(row), ("blockwise_nopow2", True): GroupScales(block, 128),
        ("mxfp8", False): GroupScales(row), ("mxfp8", True): GroupScales(block, 32),
    }
    for (key, columnwise), scales in expected.items():
        for role in ("input", "grad"):
            assert group_scales(key, role, columnwise) == scales
            assert group_scales(recipes.get_recipe(key), role, columnwise) == scales


def test_every_provider_implements_the_protocol():
    """The providers state ``Provider``'s optional GEMMs by inheriting its defaults (one GEMM
    per job, group or expert) or overriding them; nothing asks whether a provider has one."""
    from graphpass.fp8 import jobs, providers, te

    for cls in (providers.Reference, providers.ScaledMM, te.TransformerEngine):
        assert jobs.Provider in cls.__mro__
        for method in ("supports", "gemm", "gemm_many", "grouped_gemm", "batched_gemm"):
            assert callable(getattr(cls, method))
    assert providers.ScaledMM.grouped_gemm is not jobs.Provider.grouped_gemm
    assert te.TransformerEngine.gemm_many is not jobs.Provider.gemm_many
    assert providers.Reference.grouped_gemm is jobs.Provider.grouped_gemm
    assert not hasattr(providers, "choose") and not hasattr(recipes, "recipe_key")
    for path in (ROOT / "fp8").glob("*.py"):
        assert "hasattr(provider" not in path.read_text(encoding="utf-8"), path
