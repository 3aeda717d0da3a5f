"""Which forward nodes a recompute word or an FP8 cache level selects: norms, activations,
attention, MoE experts, shared experts, MLA up-projections.

Recompute selections are phrased in Megatron-Core's ``recompute_modules`` vocabulary; this module
turns each word into a set of joint-graph nodes from the graph's own structure, never from module
paths, so a block written in one ``forward`` selects what the same block written with submodules
selects (docs/memory/recompute.md#how-selections-are-recognised):

* a **norm** is its arithmetic: ``native_layer_norm``/``_fused_rms_norm``, or a reciprocal
  square root of a mean (of squares, or a variance) over its input, with the multiplications and
  additions that apply it and the norm's weights;
* **attention** is an attention op (SDPA, flash, ...) or attention written by hand, by its
  arithmetic: a scores GEMM of two activations, then scaling, masking, extra logits (sinks) and
  the row maximum subtracted, a softmax over one of the scores' dimensions, dropout, and a
  values GEMM that contracts that dimension against another activation;
* an **activation** is the elementwise chain from a GEMM's output to a GEMM's input that passes
  no norm and no attention (with fused projections only the chunks that feed the activation);
* **experts** are GEMMs over a group dimension (batched 3-D or grouped with offsets); a chain
  between them is ``moe_act``, a chain between dense GEMMs ``act``;
* an **MoE** runs from its router's input (a GEMM whose scores go to a ``topk``) to the node that
  combines the experts' outputs, plus a **shared expert** added to that combination;
* an **MLA up-projection** is a GEMM reading a norm of another GEMM's output (the compressed
  latent) whose output reaches attention, with the rope and concatenation on the way.

Module paths only name things in the report (and find the layers of ``full``).

One module because every selection is a method of one ``Regions`` over shared walks of the
joint graph (norms, chains, attention, MoEs: an MoE is found through its chains, ``mlp``
through ``act``'s), which ``tests/test_regions.py`` holds as one answer per arithmetic.
Attention written by hand (``_written_attention``, ``_carriers`` and the helpers after the
class, about 150 lines) is the part that could move to a module of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from .._compat import has_storage, size_hint
from ..paths import layer_of
from .nodes import is_backward, is_random, module_path, op_name, producer, tensor_val
from .ops import CASTS, ELEMENTWISE, GEMM_OPS, LIBRARY_GEMMS, LINEAR_GEMMS, VIEWS

QUANTIZE = "graphpass.quantize"

WORDS = ("layernorm", "act", "moe_act", "core_attn", "mlp", "moe", "shared_experts", "mla_up_proj")

# What each word looks for, for the warning when it selects nothing (backend.py).
LOOKS_FOR = {
    "layernorm": "a LayerNorm or RMSNorm (native_layer_norm, _fused_rms_norm, or rsqrt of a mean "
                 "of squares or a variance)",
    "act": "an elementwise chain between two dense GEMMs (an MLP activation)",
    "moe_act": "an elementwise chain between two grouped or batched expert GEMMs",
    "core_attn": "an attention op (scaled_dot_product_attention) or attention written by hand: "
                 "a GEMM of two activations, a softmax over its output (after scaling, masking "
                 "or extra logits), and a GEMM that contracts the softmax's dimension with "
                 "another activation",
    "mlp": "a dense MLP: GEMMs around an activation chain, outside an MoE",
    "moe": "an MoE: a router GEMM whose scores go to topk, and grouped or batched expert GEMMs",
    "shared_experts": "a shared expert: a branch added to an MoE's combined expert output",
    "mla_up_proj": "an MLA up-projection: a GEMM reading a norm of another GEMM's output, "
                   "feeding attention",
    "full": "transformer layers (module paths layers.N)",
}

_FUSED_NORMS = frozenset({"aten.native_layer_norm", "aten._fused_rms_norm", "aten.rms_norm",
                          "aten.layer_norm"})
_STATISTICS = frozenset({"aten.rsqrt", "aten.sqrt", "aten.reciprocal"})
_MEANS = frozenset({"aten.mean", "aten.var", "aten.var_mean"})
# From a norm's statistic back to its input: squares, centring, casts, the epsilon.
_NORM_UP = frozenset({"aten.pow", "aten.mul", "aten.sub", "aten.add", "aten.mean", "aten.var",
                      "aten.var_mean", "getitem", *CASTS})
# Applying the statistic: scale, shift, weights, casts.
_NORM_DOWN = frozenset({"aten.mul", "aten.add", "aten.sub", "aten.div", "getitem", *CASTS})
_SOFTMAX = frozenset({"aten._softmax", "aten.softmax", "aten._safe_softmax"})
_GROUPED = frozenset({"aten._grouped_mm", "aten._scaled_grouped_mm", "aten._scaled_grouped_mm_v2",
                      *LIBRARY_GEMMS})
_GEMMS = GEMM_OPS | LINEAR_GEMMS
# Through which a GEMM reads its operands (or a chain reaches a GEMM).
_OPERAND = frozenset({*VIEWS, *CASTS, QUANTIZE, "getitem", "aten.clone", "aten.contiguous"})


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


def _constants(joint: fx.GraphModule) -> set[fx.Node]:
    """Forward nodes computed from no graph input and no random draw (positions, masks from
    them), and Inductor's per-graph seeds with what draws from them: recomputed, each gives
    the same values."""
    out: set[fx.Node] = set()
    for node in forward_calls(joint):
        if op_name(node) in _NO_MODULE_OPS or (
                not is_random(node) and all(a in out for a in node.all_input_nodes)):
            out.add(node)
    return out


def _param_like(node: fx.Node) -> bool:
    """A graph input (parameter, buffer, primal) or a constant, possibly viewed or cast."""
    while node.op == "call_function" and op_name(node) in VIEWS | CASTS:
        node = node.args[0]
    return node.op in ("placeholder", "get_attr") or (node.op == "call_function" and not node.all_input_nodes)


def _closure(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]],
             keep: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """Nodes reached from ``start`` (not included) by ``step`` through nodes ``keep`` accepts."""
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen and keep(nxt):
                seen.add(nxt)
                todo.append(nxt)
    return seen


class Regions:
    """The norms, attention, activations and MoEs of the forward nodes of one joint graph."""

    def __init__(self, joint: fx.GraphModule) -> None:
        self.nodes = [n for n in forward_calls(joint) if op_name(n) not in _NO_MODULE_OPS]
        self._node_set = set(self.nodes)
        self._order = {n: i for i, n in enumerate(joint.graph.nodes)}
        self._constant = _constants(joint)
        self.norm_list = self._norms()
        self.norms: set[fx.Node] = set().union(*(r for _, r in self.norm_list))
        self.attention = self._attention()
        self.gemms = [n for n in self.nodes if op_name(n) in _GEMMS and n not in self.attention]
        self.expert_gemms = {g for g in self.gemms if _is_expert_gemm(g)}
        self._acts = self._activation_chains()
        self.moes = self._moes()

    # --- walking -------------------------------------------------------------------------------

    def _forward(self, node: fx.Node) -> bool:
        return node in self._node_set

    def _users(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u in self._node_set]

    def _descendants(self, start: Iterable[fx.Node]) -> set[fx.Node]:
        return _closure(start, self._users, lambda n: True)

    def _ancestors(self, start: Iterable[fx.Node]) -> set[fx.Node]:
        return _closure(start, lambda n: n.all_input_nodes, self._forward)

    # --- norms ---------------------------------------------------------------------------------

    def _norms(self) -> list[tuple[fx.Node, set[fx.Node]]]:
        """Each norm as (its input, its nodes)."""
        out = []
        for node in self.nodes:
            name = op_name(node)
            if name in _FUSED_NORMS:
                nodes = {node} | {u for u in self._users(node) if op_name(u) == "getitem"}
                out.append((node.args[0], nodes | self._weight_casts(node)))
            elif name in _STATISTICS:
                found = self._decomposed_norm(node)
                if found:
                    out.append(found)
        return out

    def _weight_casts(self, node: fx.Node) -> set[fx.Node]:
        """The casts and views of a norm's weights (graph inputs) that only the norm reads."""
        out = set()
        for a in node.all_input_nodes:
            while a in self._node_set and op_name(a) in VIEWS | CASTS and _param_like(a) and (
                    len(self._users(a)) == 1):
                out.add(a)
                a = a.args[0]
        return out

    def _decomposed_norm(self, stat: fx.Node) -> tuple[fx.Node, set[fx.Node]] | None:
        """``rsqrt(mean(x**2) + eps)`` (RMSNorm), ``rsqrt(var(x) + eps)`` or
        ``1 / sqrt(mean((x - mean(x))**2) + eps)`` (LayerNorm) and what applies it to ``x``."""
        node = stat.args[0]
        while op_name(node) in CASTS or (op_name(node) == "aten.add" and len(node.all_input_nodes) == 1):
            node = node.all_input_nodes[0]  # the epsilon (a scalar), casts
        if op_name(node) == "getitem" and op_name(node.args[0]) == "aten.var_mean":
            node = node.args[0]
        if op_name(node) not in _MEANS:
            return None
        x = node.args[0]
        if op_name(node) == "aten.mean":  # of squares
            if op_name(x) == "aten.pow" and x.args[1] == 2:
                x = x.args[0]
            elif op_name(x) == "aten.mul" and x.args[0] is x.args[1]:
                x = x.args[0]
            else:
                return None
        if op_name(x) == "aten.sub" and len(x.args) == 2 and isinstance(x.args[1], fx.Node) and (
                op_name(x.args[1]) == "aten.mean" and x.args[1].args[0] is x.args[0]):
            x = x.args[0]  # centred: (x - mean(x))
        while op_name(x) in CASTS:
            x = x.args[0]
        up = (self._descendants([x]) & self._ancestors([stat])) | {stat}
        if not up <= {n for n in up if op_name(n) in _NORM_UP | _STATISTICS}:
            return None
        region = set(up)
        allowed = region | {x}
        for n in sorted(self._descendants(up), key=self._order.__getitem__):
            if op_name(n) not in _NORM_DOWN or not any(a in region for a in n.all_input_nodes):
                continue
            if all(a in allowed or _param_like(a) for a in n.all_input_nodes):
                region.add(n)
                allowed.add(n)
        # ends: drop trailing nodes that do not lead to a use outside the norm (none do today)
        return x, region | set().union(*(self._weight_casts(n) for n in region))

    def norm_inputs(self) -> set[fx.Node]:
        return {x for x, _ in self.norm_list}

    # --- attention -----------------------------------------------------------------------------

    def _attention(self) -> set[fx.Node]:
        out = set()
        for node in self.nodes:
            if is_attention(node):
                out.add(node)
                out |= {u for u in self._users(node) if op_name(u) == "getitem"}
            else:
                dim = _softmax_dim(node)
                if dim is not None:
                    out |= self._written_attention(node, dim)
        return out

    def _written_attention(self, softmax: fx.Node, dim: int) -> set[fx.Node]:
        """Attention written by hand, found from its softmax over dimension ``dim``: a scores
        GEMM of two activations whose output carries ``dim`` (not as its batch dimension) to
        the softmax, through scaling, masking (``add``, ``where``, ``masked_fill``), soft-capping,
        extra logits concatenated (sinks), the row maximum subtracted and casts; from the
        softmax, through casts, dropout and the slice that drops the extra logits, a values GEMM
        that contracts ``dim`` against another activation. All of it, with the views and copies
        of the GEMMs' operands that only it reads, or nothing: a router's softmax goes to
        ``topk``, and a softmax over the queries or the heads is contracted by no GEMM."""
        scores = self._carriers(softmax, dim, up=True)
        outputs = self._carriers(softmax, dim, up=False)
        if not scores or not outputs:
            return set()
        region = (self._descendants(scores) & self._ancestors(outputs)) | scores | outputs
        # every output of a multi-output op in it (the row maximum's indices, the dropout
        # mask): torch's min-cut recomputes an op's outputs together or not at all
        region |= {u for n in region if isinstance(n.meta.get("val"), (tuple, list))
                   for u in self._users(n) if op_name(u) == "getitem"}
        # the copies the GEMMs make of their operands (repeat_kv's of K and V for every query
        # head, a cast up) with the views between them and the GEMM, where recomputing them
        # from what they copy saves fewer bytes than saving them (not so for a copy of a slice
        # of a larger tensor, whose storage the backward would keep whole)
        for operand in (a for g in scores | outputs for a in _multiplied(g)):
            chain, node = [], operand
            while (node not in region and node in self._node_set and op_name(node) in _PREPARE
                   and all(u in region or u in chain for u in self._users(node))):
                chain.append(node)
                node = node.args[0]
            copies = [k for k, n in enumerate(chain) if op_name(n) in _COPIES]
            upto, least = None, _nbytes(chain[copies[0]]) if copies else None
            for k in copies:  # from the GEMM up: the copy whose source is smallest, the highest
                source = _nbytes(chain[k].args[0], storage=True)
                if least is not None and source is not None and source <= least:
                    upto, least = k, source
            if upto is not None:
                region |= set(chain[:upto + 1])
        # what it reads that no input of the graph and no random draw computes, and nothing
        # else reads: a mask built from positions, a dropout mask drawn from Inductor's
        # per-graph seeds (recomputed from the seeds, as Inductor's own recompute does)
        todo = [a for n in region for a in n.all_input_nodes]
        while todo:
            n = todo.pop()
            if (n not in region and n in self._constant and n in self._node_set
                    and all(u in region for u in self._users(n))):
                region.add(n)
                todo.extend(n.all_input_nodes)
        return region

    def _carriers(self, softmax: fx.Node, dim: int, *, up: bool) -> set[fx.Node]:
        """Up: the scores GEMMs whose output dimension the softmax's ``dim`` is; down: the
        values GEMMs that contract it; followed through the ops that keep it a dimension of its
        own (``_dim_pairs``)."""
        found, seen, todo = set(), {(softmax, dim)}, [(softmax, dim)]
        while todo:
            node, d = todo.pop()
            for nxt in (node.all_input_nodes if up else self._users(node)):
                if nxt not in self._node_set:
                    continue
                if op_name(nxt) in _ATTENTION_GEMMS:
                    if up and _scores_gemm(nxt, [i for i, o in _dim_pairs(node, nxt) if o == d]):
                        found.add(nxt)
                    if not up and _values_gemm(nxt, node, d):
                        found.add(nxt)
                    continue
                pairs = _dim_pairs(node, nxt) if up else _dim_pairs(nxt, node)
                for carried in ([i for i, o in pairs if o == d] if up else [o for i, o in pairs if i == d]):
                    if (nxt, carried) not in seen:
                        seen.add((nxt, carried))
                        todo.append((nxt, carried))
        return found

    # --- activation chains ---------------------------------------------------------------------

    def _activation_chains(self, through_dropout: bool = False) -> set[fx.Node]:
        """Elementwise chains from a GEMM output to a GEMM input (the MLP activation), through
        no norm and no attention; ``through_dropout``: a dropout between the activation and the
        next GEMM (T5's MLP) is part of the chain too (eager-RNG graphs keep it one
        ``native_dropout``; Inductor's decomposition into elementwise ops is part of it anyway)."""
        def link(node: fx.Node) -> bool:
            return (node in self._node_set and node not in self.norms and node not in self.attention
                    and (op_name(node) in ELEMENTWISE or through_dropout and _is_dropout(node)))

        down = _closure(self.gemms, lambda n: n.users, link)
        up = _closure(self.gemms, lambda n: n.all_input_nodes, link)
        # Quantizes sit between an activation and the next GEMM; treat them as transparent.
        quant_inputs = [n.args[0] for n in self.nodes if op_name(n) == QUANTIZE]
        up |= _closure(quant_inputs, lambda n: n.all_input_nodes, link) | {
            q for q in quant_inputs if link(q)}
        return down & up

    def activation_inputs_region(self) -> set[fx.Node]:
        """The activation chains of every MLP and expert, dropouts inside them included: what
        reads an activation's input (``fp8_cache="act_input"``). The recompute words keep the
        chains without dropout (recomputing one needs its RNG state; passes/recompute.py)."""
        return self._activation_chains(through_dropout=True)

    def _chains(self) -> list[tuple[set[fx.Node], set[fx.Node], set[fx.Node]]]:
        """The activation chains as connected pieces: (chain, GEMMs feeding it, GEMMs it feeds)."""
        parent = {n: n for n in self._acts}

        def find(n):
            while parent[n] is not n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for n in self._acts:
            for a in n.all_input_nodes:
                if a in parent:
                    parent[find(a)] = find(n)
        pieces: dict[fx.Node, set[fx.Node]] = {}
        for n in self._acts:
            pieces.setdefault(find(n), set()).add(n)
        out = []
        gemms = set(self.gemms)
        for chain in pieces.values():
            feeding = {a for n in chain for a in n.all_input_nodes if a in gemms}
            fed = set()
            todo = [u for n in chain for u in self._users(n) if u not in chain]
            seen = set(todo)
            while todo:
                n = todo.pop()
                if n in gemms:
                    fed.add(n)
                elif op_name(n) in _OPERAND:
                    for u in self._users(n):
                        if u not in seen:
                            seen.add(u)
                            todo.append(u)
            out.append((chain, feeding, fed))
        return out

    def _linear(self, gemm: fx.Node) -> set[fx.Node]:
        """A GEMM and the views of its output (``_complete`` adds its operands' views, casts and
        quantizes)."""
        out = {gemm}
        users = self._users(gemm)
        while len(users) == 1 and op_name(users[0]) in VIEWS:
            out.add(users[0])
            users = self._users(users[0])
        return out

    def _complete(self, region: set[fx.Node]) -> set[fx.Node]:
        """``region`` with what prepares its GEMMs' operands for it alone: views, casts and
        quantizes whose forward readers are all in it (a weight's transpose, an input's 2-D
        view), the constants only it reads (token indices), and the quantizes and views only
        the backward reads (wgrad's columnwise copy, dgrad's weight transpose) of a tensor the
        region reads too."""
        region = set(region)
        constant = set()
        for n in self.nodes:
            if all(a in constant for a in n.all_input_nodes):
                constant.add(n)
        candidates = [n for n in self.nodes if n not in self.norms and (
            op_name(n) in _OPERAND or op_name(n) == QUANTIZE or n in constant)]

        def read_by_region(node: fx.Node) -> bool:
            return any(u is not node and u in region for u in node.users)
        changed = True
        while changed:
            changed = False
            for n in candidates:
                if n in region:
                    continue
                users = self._users(n)
                if op_name(n) == QUANTIZE:
                    outputs = [u for u in users if op_name(u) == "getitem"]
                    backward_only = all(not self._users(g) for g in outputs) and len(outputs) == len(users)
                    # a quantize of both usages (save_original="never", fp8_save_quantized_weight): the
                    # outputs the forward reads all in the region, the others read by the
                    # backward alone. Taken whole: torch's min-cut recomputes an op's outputs
                    # together or not at all, and cannot save the tuple itself.
                    both = len(outputs) == len(users) and any(u in region for u in outputs) and all(
                        u in region or not self._users(u) for u in outputs)
                    take = (users and all(u in region for u in users)) or both or (
                        backward_only and read_by_region(n.args[0]))
                    if take:
                        region |= {n, *outputs}
                        changed = True
                elif (users and all(u in region for u in users)) or (
                        not users and op_name(n) in VIEWS and read_by_region(n.args[0])):
                    region.add(n)
                    changed = True
        return region

    # --- MoE -----------------------------------------------------------------------------------

    def _moes(self) -> list[tuple[set[fx.Node], set[fx.Node]]]:
        """Each MoE as (its nodes, its shared experts' nodes)."""
        out = []
        for topk in (n for n in self.nodes if op_name(n) == "aten.topk"):
            routers = [g for g in self._ancestors([topk]) if g in set(self.gemms)
                       and g not in self.expert_gemms]
            if not routers:
                continue
            router = max(routers, key=self._order.__getitem__)
            x = _operand_base(router.args[0] if op_name(router) != "aten.addmm" else router.args[1],
                              stop=self.norms)
            below = self._descendants([x])
            routing = self._descendants([topk])
            weights = self._descendants([u for u in self._users(topk) if u.args[1] == 0])
            # the experts reading x: reached from it through no norm, attention or dense GEMM
            # (the next layer's experts are behind its norm)
            dense = set(self.gemms) - self.expert_gemms
            reached = _closure([x], self._users, lambda n: n not in self.norms
                               and n not in self.attention and n not in dense)
            experts = {g for g in self.expert_gemms & reached if self._descendants([g]) & routing}
            if not experts:
                continue
            # the combination: the first node that reads every expert's output and the weights
            joins = set.intersection(*(self._descendants([g]) | {g} for g in experts), weights)
            if not joins:
                continue
            combined = min(joins, key=self._order.__getitem__)
            # then on through what reads only it, the MoE's input and the routing (a sum over the
            # top k, a scatter back to the tokens, views), and a shared expert added to it; up to
            # the residual stream
            end, shared_out = combined, []
            while True:
                users = self._users(end)
                if len(users) != 1:
                    break
                others = [a for a in users[0].all_input_nodes if a is not end]
                if not all(a in below or _param_like(a) for a in others):
                    break
                shared_out += [a for a in others if a in below and a not in routing]
                end = users[0]
            region = ((below & self._ancestors([end])) | {end}) - {x}
            shared = set()
            for s in shared_out:
                shared |= ((below & self._ancestors([s])) | {s}) - self._ancestors([combined]) - {x}
            shared -= routing
            out.append((region, shared))
        return out

    # --- selections ----------------------------------------------------------------------------

    def select(self, word: str) -> set[fx.Node]:
        """The forward nodes ``recompute=(word,)`` recomputes."""
        if word == "layernorm":
            return {n for n in self.norms if not is_expensive(n) and op_name(n) != QUANTIZE}
        in_moe = set().union(*(r for r, _ in self.moes))
        if word in ("act", "moe_act"):
            want = word == "moe_act"
            return {n for chain, feeding, fed in self._chains()
                    if bool((feeding | fed) & self.expert_gemms) == want for n in chain}
        if word == "core_attn":
            return set(self.attention)
        if word == "mlp":
            out = set()
            for chain, feeding, fed in self._chains():
                if (feeding | fed) & self.expert_gemms or chain & in_moe:
                    continue
                out |= chain
                for g in feeding | fed:
                    out |= self._linear(g)
                    out |= self._between(g, chain)
            return self._complete(out)
        if word == "moe":
            return self._complete(in_moe)
        if word == "shared_experts":
            return self._complete(set().union(*(s for _, s in self.moes)))
        if word == "mla_up_proj":
            return self._mla_up_proj()
        raise ValueError(f"unknown recompute selection {word!r}")

    def _between(self, gemm: fx.Node, chain: set[fx.Node]) -> set[fx.Node]:
        """The views, splits and bias adds from a GEMM's output to the chain it feeds."""
        return {n for n in self._descendants([gemm]) & self._ancestors(chain)
                if op_name(n) in _OPERAND | {"aten.split", "aten.split_with_sizes", "aten.add"}}

    def _mla_up_proj(self) -> set[fx.Node]:
        attention = [n for n in self.attention if is_attention(n) or op_name(n) in _GEMMS]
        feeds_attention = self._ancestors(attention)
        norm_of = {}
        for x, region in self.norm_list:
            for n in region:
                norm_of[n] = x
        gemms = set(self.gemms)
        grown: set[fx.Node] = set()
        for g in self.gemms:
            if g in self.expert_gemms or g not in feeds_attention:
                continue
            a = _operand_base(g.args[1] if op_name(g) == "aten.addmm" else g.args[0], stop=self.norms)
            if a not in norm_of:
                continue
            source = _operand_base(norm_of[a], through_splits=True)
            if source not in gemms:
                continue  # a norm of the residual stream, not of a compressed latent
            seeds = self._linear(g)
            grown |= seeds
            todo = list(seeds)
            while todo:
                for user in self._users(todo.pop()):
                    if user not in grown and not is_expensive(user) and user in feeds_attention:
                        grown.add(user)
                        todo.append(user)
        return self._complete(grown)

    def layers(self) -> list[str]:
        """Transformer layers in forward order (``layers.0``, ``layers.1``, ...)."""
        return list(dict.fromkeys(layer_of(module_path(n)) for n in self.nodes if layer_of(module_path(n))))


def _operand_base(node: fx.Node, *, through_splits: bool = False,
                  stop: set[fx.Node] = frozenset()) -> fx.Node:
    """The tensor a GEMM operand reads, through views, casts, quantizes and their outputs, up to
    a node of ``stop`` (a norm's output cast: the norm's output)."""
    names = _OPERAND | ({"aten.split", "aten.split_with_sizes"} if through_splits else set())
    while (node.op == "call_function" and op_name(node) in names and node.all_input_nodes
           and node not in stop):
        node = node.args[0]
    return node


def _is_expert_gemm(node: fx.Node) -> bool:
    """A GEMM over a group dimension: grouped (offsets) or batched with a 3-D result."""
    if op_name(node) in _GROUPED:
        return True
    val = tensor_val(node)
    if val is not None and val.dim() == 3:
        return True
    if op_name(node) == "graphpass.fp8_gemm":  # grouped over tokens: with offsets
        offs = node.kwargs.get("offs", node.args[9] if len(node.args) > 9 else None)
        return offs is not None
    return False


# --- attention written by hand ----------------------------------------------------------------

# The GEMMs of attention's scores and values: batched (heads in the batch), plain, or with an
# additive bias (ALiBi as ``baddbmm``); their operands' positions.
_ATTENTION_GEMMS = {"aten.bmm": (0, 1), "aten.mm": (0, 1), "aten.baddbmm": (1, 2)}
# Ops that keep the softmax's dimension where it is, broadcasting their other operands (masks,
# biases, scales): scaling, masking, soft-capping, casts, dropout, the softmax and its
# decomposition, broadcasts.
_KEEP_DIM = frozenset({
    "aten.mul", "aten.add", "aten.sub", "aten.div", "aten.neg", "aten.exp", "aten.tanh",
    "aten.where", "aten.masked_fill", "aten.clamp", "aten.clamp_min", "aten.clamp_max",
    "aten.maximum", "aten.minimum", "aten.expand", "aten.clone", "aten.contiguous", "aten.alias",
    "aten.native_dropout", "aten.slice", "aten.cat", *CASTS, *_SOFTMAX,
})
# Ops that move it: reshapes (followed by its size and what lies inside it), permutes.
_RESHAPES = frozenset({"aten.view", "aten.reshape", "aten._unsafe_view", "aten.unsqueeze",
                       "aten.squeeze"})
# What a GEMM's operand goes through from Q, K or V: head views and transposes, and copies
# (repeat_kv's, a batched matmul's of its expanded operands, casts).
_COPIES = frozenset({*CASTS, "aten.clone", "aten.contiguous"})
_PREPARE = frozenset({*VIEWS, *_COPIES})


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    """The shape of a node's tensor (of its output, for a dropout)."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)) and op_name(node) == "aten.native_dropout":
        val = val[0]
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(size_hint(s, where=f"attention's dimensions at {node.name}") for s in val.shape)


def _nbytes(node: fx.Node, *, storage: bool = False) -> int | None:
    """A node's tensor's bytes, or its storage's (all of which a saved view of it keeps)."""
    val = tensor_val(node)
    if val is None or (storage and not has_storage(val)):
        return None
    nbytes = val.untyped_storage().nbytes() if storage else val.numel() * val.element_size()
    return size_hint(nbytes, where=f"attention's operand {node.name}")


def _dim_pairs(node: fx.Node, src: fx.Node) -> list[tuple[int, int]]:
    """(dimension of ``src``, dimension of ``node``'s output) for each dimension of its input
    ``src`` that ``node`` keeps whole: not reduced, merged with another or broadcast from 1."""
    name = op_name(node)
    if name == "getitem" and not _is_dropout(node):
        return []
    i, o = _shape(src), _shape(node)
    if i is None or o is None:
        return []
    if name == "getitem" or name in _KEEP_DIM:
        if (name == "aten.cat" and src not in node.args[0]) or (
                name == "aten.slice" and src is not node.args[0]):
            return []
        shift = len(o) - len(i)
        return [(k, k + shift) for k in range(len(i))
                if k + shift >= 0 and (i[k] == o[k + shift] or name in ("aten.cat", "aten.slice"))]
    if name in _RESHAPES:  # the same size with the same number of elements inside it
        return [(k, m) for k in range(len(i)) for m in range(len(o))
                if i[k] == o[m] and math.prod(i[k + 1:]) == math.prod(o[m + 1:])]
    if name == "aten.permute":
        return [(p % len(o), m) for m, p in enumerate(node.args[1])]
    if name in ("aten.transpose", "aten.t"):
        a, b = (node.args[1] % len(o), node.args[2] % len(o)) if name == "aten.transpose" else (0, 1)
        swap = {a: b, b: a}
        return [(k, swap.get(k, k)) for k in range(len(o))] if len(o) >= 2 else [(0, 0)] * len(o)
    if name == "aten.select":
        at = node.args[1] % len(i)
        return [(k, k - (k > at)) for k in range(len(i)) if k != at]
    return []


def _softmax_dim(node: fx.Node) -> int | None:
    """The dimension a softmax normalises: ``_softmax``, ``softmax``, ``_safe_softmax`` or
    ``exp(x) / sum(exp(x), dim, keepdim=True)`` (their decomposition); None for other ops."""
    name = op_name(node)
    if name in _SOFTMAX:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    elif (name == "aten.div" and len(node.args) == 2 and isinstance(node.args[1], fx.Node)
            and op_name(node.args[0]) == "aten.exp" and op_name(node.args[1]) == "aten.sum"
            and node.args[1].args[0] is node.args[0] and len(node.args[1].args) > 1
            and isinstance(node.args[1].args[1], (list, tuple)) and len(node.args[1].args[1]) == 1):
        dim = node.args[1].args[1][0]
    else:
        return None
    shape = _shape(node)
    return dim % len(shape) if shape and isinstance(dim, int) else None


def _multiplied(gemm: fx.Node) -> list[fx.Node]:
    """The two operands a GEMM multiplies (not the bias of ``baddbmm``)."""
    return [gemm.args[p] for p in _ATTENTION_GEMMS[op_name(gemm)]]


def _scores_gemm(gemm: fx.Node, dims: list[int]) -> bool:
    """A GEMM of two activations, one of whose output dimensions ``dims`` is not its batch."""
    batched = op_name(gemm) != "aten.mm"
    return (not any(_param_like(a) for a in _multiplied(gemm))
            and any(d >= (1 if batched else 0) for d in dims))


def _values_gemm(gemm: fx.Node, operand: fx.Node, dim: int) -> bool:
    """A GEMM of two activations that contracts dimension ``dim`` of its operand ``operand``:
    the last of the left operand, the second last of the right one."""
    a, b = _multiplied(gemm)
    if any(_param_like(x) for x in (a, b)):
        return False
    rank = len(_shape(operand) or ())
    return (operand is a and dim == rank - 1) or (operand is b and dim == rank - 2)
