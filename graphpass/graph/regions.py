"""Which forward nodes belong to which Megatron module class: norms, activations, attention...

Recompute selections are phrased in Megatron-Core's ``recompute_modules`` vocabulary; this module
turns each word into a set of joint-graph nodes, from module paths (``nn_module_stack``), module
classes and the graph's own structure (an activation is the elementwise chain between two GEMMs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

from ..paths import layer_of
from .nodes import is_backward, module_path, module_stack, op_name, producer
from .ops import ELEMENTWISE, LINEAR_GEMMS

QUANTIZE = "graphpass.quantize"


def forward_calls(joint: fx.GraphModule) -> list[fx.Node]:
    return [n for n in joint.graph.nodes if n.op == "call_function" and not is_backward(n)]


def is_gemm(node: fx.Node) -> bool:
    return op_name(node) in LINEAR_GEMMS


def is_attention(node: fx.Node) -> bool:
    name = op_name(node)
    return "scaled_dot_product" in name or "attention" in name


def is_expensive(node: fx.Node) -> bool:
    """GEMMs and attention: never recomputed unless the user selects their module."""
    made_by = op_name(producer(node))
    return is_gemm(node) or is_attention(node) or (
        op_name(node) == "getitem" and (made_by in LINEAR_GEMMS or "attention" in made_by
                                       or "scaled_dot_product" in made_by))


def _is_norm(stack: list[tuple[str, type]]) -> bool:
    return any(cls.__name__.endswith("Norm") or path.rsplit(".", 1)[-1].endswith("norm")
               for path, cls in stack)


def in_norm(node: fx.Node) -> bool:
    """Whether ``node`` belongs to a norm module (``*Norm`` class or ``*norm`` attribute)."""
    return _is_norm(module_stack(node))


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


# Inductor's one seed buffer for all random ops of a graph (its ``replace_random`` joint pass) is
# no module's own: torch 2.14 copies the first dropout's module path onto it, 2.13 none, so a
# selection would take it on one version only. Recomputing it would save the generator's whole
# state (5 KB on CPU) for the backward instead of the seeds' 8 bytes anyway.
_NO_MODULE_OPS = frozenset({"prims.inductor_seeds"})


def _is_dropout(node: fx.Node) -> bool:
    """An eager-RNG dropout, ``aten.native_dropout``, or its output (``getitem`` 0)."""
    name = op_name(node)
    return name == "aten.native_dropout" or (
        name == "getitem" and op_name(node.args[0]) == "aten.native_dropout" and node.args[1] == 0)


class Regions:
    """The Megatron module classes of the forward nodes of one joint graph."""

    def __init__(self, joint: fx.GraphModule) -> None:
        self.nodes = [n for n in forward_calls(joint) if op_name(n) not in _NO_MODULE_OPS]
        self._node_set = set(self.nodes)
        self.paths = {p for n in self.nodes for p, _ in module_stack(n)}
        self.attention_modules = {module_path(n) for n in self.nodes if is_attention(n)}
        self.moe_modules = {p for p in self.paths if p + ".experts" in self.paths}
        self._acts = self._activation_chains()

    def _activation_chains(self, through_dropout: bool = False) -> set[fx.Node]:
        """Elementwise chains from a GEMM output to a GEMM input (the MLP activation);
        ``through_dropout``: a dropout between the activation and the next GEMM (T5's MLP) is
        part of the chain too (eager-RNG graphs keep it one ``native_dropout``; Inductor's
        decomposition into elementwise ops is part of it anyway)."""
        def link(node: fx.Node) -> bool:
            return op_name(node) in ELEMENTWISE or through_dropout and _is_dropout(node)

        def chain(start: Iterable[fx.Node], step) -> set[fx.Node]:
            seen, todo = set(), list(start)
            while todo:
                node = todo.pop()
                for nxt in step(node):
                    if nxt not in seen and nxt.op == "call_function" and not is_backward(nxt) and (
                            link(nxt)):
                        seen.add(nxt)
                        todo.append(nxt)
            return seen

        # Upwards, a norm ends the chain: what reaches a GEMM only through a norm (the residual
        # stream) is not an activation.
        def inputs(n: fx.Node) -> list[fx.Node]:
            return [] if _is_norm(module_stack(n)) else list(n.all_input_nodes)

        gemms = [n for n in self.nodes if is_gemm(n)]
        down = chain(gemms, lambda n: n.users)
        up = chain(gemms, inputs)
        # Quantizes sit between an activation and the next GEMM; treat them as transparent.
        quant_inputs = [n.args[0] for n in self.nodes if op_name(n) == QUANTIZE]
        up |= chain(quant_inputs, inputs) | {q for q in quant_inputs if link(q)}
        return {n for n in down & up
                if not _under(module_path(n), self.attention_modules)
                and not _is_norm(module_stack(n))}

    def activation_inputs_region(self) -> set[fx.Node]:
        """The activation chains of every MLP and expert, dropouts inside them included: what
        reads an activation's input (``fp8_cache="act_input"``). The recompute words keep the
        chains without dropout (recomputing one needs its RNG state; passes/recompute.py)."""
        return self._activation_chains(through_dropout=True)

    def select(self, word: str) -> set[fx.Node]:
        """The forward nodes ``recompute=(word,)`` recomputes."""
        nodes = self.nodes
        if word == "layernorm":
            return {n for n in nodes if _is_norm(module_stack(n)) and not is_expensive(n)
                    and op_name(n) != QUANTIZE}
        if word in ("act", "moe_act"):
            experts = lambda n: ".experts" in module_path(n) + "."  # noqa: E731
            want_experts = word == "moe_act"
            return {n for n in self._acts if experts(n) == want_experts}
        if word == "core_attn":
            return {n for n in nodes if is_attention(n) or (
                op_name(n) == "getitem" and is_attention(n.args[0]))}
        if word == "mlp":
            owners = {module_path(n) for n in self._acts if not _under(module_path(n), self.moe_modules)}
            return {n for n in nodes if _under(module_path(n), owners)}
        if word == "moe":
            return {n for n in nodes if _under(module_path(n), self.moe_modules)}
        if word == "shared_experts":
            owners = {p for p in self.paths if p.rsplit(".", 1)[-1] == "shared_experts"}
            return {n for n in nodes if _under(module_path(n), owners)}
        if word == "mla_up_proj":
            up = {p for p in self.paths if p.rsplit(".", 1)[-1] in ("q_b_proj", "kv_b_proj")}
            seeds = {n for n in nodes if _under(module_path(n), up)}
            # and the rope/concat that turns the up-projections into attention inputs
            grown, todo = set(seeds), list(seeds)
            while todo:
                for user in todo.pop().users:
                    if user not in grown and user in self._node_set and not is_expensive(user) and (
                            _under(module_path(user), self.attention_modules)):
                        grown.add(user)
                        todo.append(user)
            return grown
        raise ValueError(f"unknown recompute selection {word!r}")

    def layers(self) -> list[str]:
        """Transformer layers in forward order (``layers.0``, ``layers.1``, ...)."""
        return list(dict.fromkeys(layer_of(module_path(n)) for n in self.nodes if layer_of(module_path(n))))
