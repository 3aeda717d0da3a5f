"""``graphpass fit --search``: the option sets under which a training job fits, fastest first.

The options searched (FP8 recipe, recompute words, offload, the FP8 weight cache, the
micro-batch size at the same tokens per optimizer step) change what the compiled decoder layers
save and how long they take; the rest of the step (parameters, gradients, optimizer state,
FSDP2's buffers, embedding, logits and loss) stays as it is. So the search:

1. plans one decoder layer of each distinct kind (``graphpass.plan``'s trace and partition under
   fake tensors, on this rank's tensor-parallel shard) once per option set and micro-batch size,
   cached: its saved activations on the device, its step peak, and its time by the roofline of
   ``graph/roofline.py`` (an H100), summed over the partitioned forward's and backward's ops
   (each op ``max(FLOPs / peak, bytes / bandwidth)`` at its operands' dtype, views free, run op by
   op: Inductor's fusion is not modelled, nor communication);
2. estimates the whole step once per micro-batch size under the options given
   (``graphpass.estimate``, through ``Problem.estimate``: ``graphpass fit`` counts the job as
   given at every layer and other micro-batch sizes at one and two layers of the kind the model
   repeats, each phase's peak extended linearly to its layer count, :func:`scaled`);
3. predicts each option set's peak from that estimate: the forward's, loss's and backward's
   peaks move by every layer's change of saved activations plus one layer's change of
   transients, the zero_grad's and optimizer step's do not;
4. walks the recompute words from none to ``full`` per recipe and micro-batch size, stopping at
   the first that fits (more recompute only adds time), offload tried only where no offload does
   not fit; then counts the fastest few that fit with ``graphpass.estimate`` itself.

Each result says which of its numbers are counted and which predicted.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from .. import _compat
from ..backend import Partitioner, eager_compile, input_sources
from ..config import Config
from ..fp8.recipes import Scaling
from ..graph.flops import node_flops
from ..graph.roofline import H100
from ..plan import _fake_like, _to_fake
from ..report import Report
from ..report.totals import format_bytes
from .result import JobEstimate, Phase

RECIPES: tuple[str | None, ...] = (None, *(s.value for s in (Scaling.TENSORWISE, Scaling.ROWWISE,
                                                            Scaling.BLOCKWISE)))
# Phases whose peak holds the decoder layers' saved activations.
ACTIVE = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)


@dataclass(frozen=True)
class Options:
    """One option set of the search: backend options and the micro-batching."""

    fp8: str | None
    recompute: tuple[str, ...]
    offload: bool
    weight_cache: bool
    micro_batch: int
    micro_batches: int

    @classmethod
    def as_given(cls, given: dict[str, Any], micro_batch: int, micro_batches: int) -> "Options":
        """The options given on the command line, as an option set."""
        return cls(given.get("fp8"), tuple(given.get("recompute", ())),
                   bool(given.get("offload", False)), bool(given.get("fp8_weight_cache", False)),
                   micro_batch, micro_batches)

    def backend_options(self, given: dict[str, Any]) -> dict[str, Any]:
        """The options given on the command line with this set's in place of theirs."""
        options = {k: v for k, v in given.items()
                   if k not in ("fp8", "recompute", "offload", "fp8_weight_cache")}
        if self.fp8 is not None:
            options["fp8"] = self.fp8
        if self.recompute:
            options["recompute"] = self.recompute
        if self.offload:
            options["offload"] = True
        if self.weight_cache:
            options["fp8_weight_cache"] = True
        return options

    def backend_call(self, given: dict[str, Any]) -> str:
        """``graphpass.backend(...)`` with this set's options, ready to paste."""
        options = self.backend_options(given)
        options.pop("codegen", None) if options.get("codegen") == "inductor" else None
        return "graphpass.backend(" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"

    def label(self) -> str:
        parts = [f"fp8={self.fp8 or 'none'}",
                 f"recompute={','.join(self.recompute) if self.recompute else 'none'}"]
        if self.offload:
            parts.append("offload")
        if self.weight_cache:
            parts.append("fp8_weight_cache")
        parts.append(f"micro-batch {self.micro_batch} x {self.micro_batches}")
        return " ".join(parts)


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer planned under one option set."""

    activation_bytes: int
    """Saved activations kept on the device (parameters and offloaded tensors apart)."""
    peak_bytes: int
    """The layer's predicted step peak (``report.meta["step_peak"]``)."""
    seconds: float
    """Forward and backward by the roofline, op by op."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Candidate:
    options: Options
    peak_bytes: int
    fits: bool
    layer_seconds: float
    """Every decoder layer's forward and backward, all micro-batches, by the roofline."""
    counted: bool
    """The peak is ``graphpass.estimate``'s for these options, not predicted from the layers."""
    predicted_bytes: int | None = None
    """Where counted: the peak the layers predicted (how far the prediction was off)."""


@dataclass
class SearchResult:
    candidates: list[Candidate]
    """Option sets that fit, fastest first."""
    rejected: list[Candidate]
    """Option sets tried that do not fit."""
    skipped: int
    """Option sets not tried: each adds recompute (or offload) to one that fits."""
    device_bytes: int
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


# -- one layer ------------------------------------------------------------------------------------

class _Capturing(Partitioner):
    """graphpass's partitioner, keeping the partitioned graphs for the roofline."""

    def __init__(self, config: Config) -> None:
        super().__init__(config, "graphpass fit --search")
        self.graphs: list[tuple[fx.GraphModule, fx.GraphModule]] = []

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw = super().__call__(gm, joint_inputs, **kwargs)
        self.graphs.append((fw, bw))
        return fw, bw


def roofline_seconds(graphs: Sequence[fx.GraphModule]) -> float:
    """The graphs' ops one after another, each ``max(FLOPs / peak, bytes / bandwidth)`` on an
    H100 at its first operand's dtype; views and ops on no tensor take no time."""
    total = 0.0
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or getattr(node.target, "is_view", False):
                continue
            tensors = [a.meta.get("val") for a in node.all_input_nodes]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            out = node.meta.get("val")
            outs = [t for t in (out if isinstance(out, (list, tuple)) else [out])
                    if isinstance(t, torch.Tensor)]
            nbytes = sum(_compat.size_hint(t.numel() * t.element_size(), where="a roofline")
                         for t in (*tensors, *outs))
            dtype = tensors[0].dtype if tensors else None
            total += H100.compute(node_flops(node), nbytes, dtype)
    return total


class _Flat(nn.Module):
    """A decoder layer called with its tensors flat (``plan`` fakes only top-level inputs): its
    positional tensors, then per keyword a tensor, a tuple of tensors or a constant."""

    def __init__(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        # under the path a model gives its layers (``layers.0``), which ``full`` recompute and
        # the report's per-layer rows read
        self.layers = nn.ModuleList([block])
        if not all(isinstance(a, torch.Tensor) for a in args):
            raise ValueError("a decoder layer's positional inputs must be tensors")
        self.inputs: list[torch.Tensor] = list(args)
        self._positional = len(args)
        self._keywords: list[tuple[str, int]] = []  # (name, -1 constant / 0 tensor / n tuple)
        self._constants: dict[str, Any] = {}
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                self._keywords.append((name, 0))
                self.inputs.append(value)
            elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
                self._keywords.append((name, len(value)))
                self.inputs.extend(value)
            else:
                self._keywords.append((name, -1))
                self._constants[name] = value

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        i = self._positional
        for name, n in self._keywords:
            if n < 0:
                kwargs[name] = self._constants[name]
            elif n == 0:
                kwargs[name] = tensors[i]
                i += 1
            else:
                kwargs[name] = tuple(tensors[i:i + n])
                i += n
        out = self.layers[0](*tensors[:self._positional], **kwargs)
        return out[0] if isinstance(out, tuple) else out


def plan_layer(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               config: Config) -> LayerCost:
    """One decoder layer under ``config``, traced and partitioned under fake tensors as
    ``graphpass.plan`` does, with its partitioned graphs' roofline time."""
    flat = _Flat(block, args, kwargs)
    tensors, flat.inputs = flat.inputs, []
    mode = _compat.fake_tensor_mode()
    with mode:
        fake = _to_fake(flat)
        inputs = [_fake_like(t) for t in tensors]
    partitioner = _Capturing(config)

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        with input_sources(gm):
            return eager_compile(gm, example_inputs, partitioner, runs=False)

    compiled = torch.compile(fake, backend=backend, dynamic=False)
    with mode, _compat.unlimited_recompiles():
        try:
            compiled(*inputs)
        except Exception as e:
            error = _compat.backend_value_error(e)
            if error is None:
                raise
            raise error from None
    if not partitioner.reports:
        raise ValueError("the decoder layer compiled to no training graph (nothing requires grad)")
    report = Report.merge(partitioner.reports)
    peak = report.meta.get("step_peak", {}).get("bytes", report.activation_bytes)
    seconds = roofline_seconds([g for pair in partitioner.graphs for g in pair])
    warnings = tuple(n for n in report.notes if "nothing in this graph matched" in n)
    return LayerCost(report.activation_bytes, int(peak), seconds, warnings)


# -- the search ------------------------------------------------------------------------------------

@dataclass
class Problem:
    """What the search needs from the job: how to plan its layers and estimate its step."""

    layer_kinds: Callable[[int], list[tuple[int, nn.Module, tuple[Any, ...], dict[str, Any]]]]
    """``micro_batch`` -> ``(count, layer, args, kwargs)`` per kind of decoder layer: how many of
    it the model has, one of it (this rank's shard) and its inputs."""
    estimate: Callable[[Options], JobEstimate]
    """The step's estimate under an option set."""
    given: dict[str, Any]
    """The graphpass options given on the command line."""
    micro_batch: int
    micro_batches: int
    recompute_words: Sequence[tuple[str, ...]]
    """The recompute ladder, none first, ``("full",)`` last."""
    recipes: Sequence[str | None] = RECIPES
    verify: int = 2
    """How many of the fastest that fit to count with ``graphpass.estimate``."""
    known: dict[Options, JobEstimate] = field(default_factory=dict)
    """Estimates made already (the job as given)."""
    progress: Callable[[str], None] = lambda text: None


def micro_batch_sizes(micro_batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """``(size, count)`` at the same sequences per optimizer step: the given size and the powers
    of two below it that divide the step's sequences."""
    sequences = micro_batch * micro_batches
    sizes = {micro_batch}
    size = 1
    while size < micro_batch:
        if sequences % size == 0:
            sizes.add(size)
        size *= 2
    return [(s, sequences // s) for s in sorted(sizes, reverse=True)]


def search(problem: Problem, device_bytes: int) -> SearchResult:
    """The option sets that fit ``device_bytes``, fastest first (module docstring). Options
    given on the command line (``fp8``, ``recompute``, ``offload``, ``fp8_weight_cache``) are
    held; the search varies the others."""
    start = time.perf_counter()
    result = SearchResult([], [], 0, device_bytes)
    costs: dict[tuple[Options, int], LayerCost] = {}
    counted: dict[Options, JobEstimate] = dict(problem.known)
    given = problem.given
    recipes = [given["fp8"]] if "fp8" in given else list(problem.recipes)
    ladder = ([tuple(given["recompute"])] if "recompute" in given
              else [tuple(w) for w in problem.recompute_words])
    offloads = [bool(given["offload"])] if "offload" in given else [False, True]
    caches = [bool(given["fp8_weight_cache"])] if "fp8_weight_cache" in given else [False, True]

    def layer_costs(options: Options) -> list[tuple[int, LayerCost]]:
        kinds = problem.layer_kinds(options.micro_batch)
        out = []
        for index, (count, block, args, kwargs) in enumerate(kinds):
            key = (dataclasses.replace(options, micro_batches=1), index)
            if key not in costs:
                problem.progress(f"planning layer kind {index + 1}/{len(kinds)}: {options.label()}")
                config = Config.from_options(**{**options.backend_options(given), "codegen": "eager"})
                costs[key] = plan_layer(block, args, kwargs, config)
                result.notes.extend(f"{options.label()}: {n}" for n in costs[key].notes
                                    if f"{options.label()}: {n}" not in result.notes)
            out.append((count, costs[key]))
        return out

    for micro_batch, micro_batches in micro_batch_sizes(problem.micro_batch, problem.micro_batches):
        base = Options.as_given(given, micro_batch, micro_batches)
        if base not in counted:
            problem.progress(f"estimating the step: {base.label()}")
            counted[base] = problem.estimate(base)
        baseline = (counted[base], layer_costs(base))

        def tried(options: Options) -> Candidate:
            cand = _predict(options, baseline, layer_costs(options), device_bytes)
            if options in counted:
                peak = counted[options].peak_bytes
                cand = dataclasses.replace(cand, peak_bytes=peak, fits=peak <= device_bytes,
                                           counted=True, predicted_bytes=cand.peak_bytes)
            (result.candidates if cand.fits else result.rejected).append(cand)
            return cand

        for recipe in recipes:
            for step, words in enumerate(ladder):
                fitted = None
                for offload in offloads:
                    cand = tried(Options(recipe, words, offload, caches[0], micro_batch, micro_batches))
                    if cand.fits:
                        fitted = cand
                        break
                if fitted is None:
                    continue
                if recipe is not None and micro_batches > 1 and len(caches) > 1:
                    tried(dataclasses.replace(fitted.options, weight_cache=True))
                result.skipped += len(offloads) * (len(ladder) - step - 1)
                break
    result.candidates.sort(key=lambda c: (c.layer_seconds, c.peak_bytes))
    _verify(problem, result, counted)
    result.seconds = time.perf_counter() - start
    return result


def _predict(options: Options, baseline: tuple[JobEstimate, list[tuple[int, LayerCost]]],
             layers: list[tuple[int, LayerCost]], device_bytes: int) -> Candidate:
    """The peak under ``options`` from the baseline's estimate and the layers' changes."""
    est, base_layers = baseline
    saved = sum(n * (c.activation_bytes - b.activation_bytes)
                for (n, c), (_, b) in zip(layers, base_layers))
    transient = max(((c.peak_bytes - c.activation_bytes) - (b.peak_bytes - b.activation_bytes)
                     for (_, c), (_, b) in zip(layers, base_layers)), default=0)
    peaks = [p.bytes + (saved + transient if p.phase in ACTIVE else 0) for p in est.phases]
    peak = max(peaks) if peaks else est.peak_bytes
    seconds = options.micro_batches * sum(n * c.seconds for n, c in layers)
    return Candidate(options, peak, peak <= device_bytes, seconds, counted=False)


def _verify(problem: Problem, result: SearchResult, known: dict[Options, JobEstimate]) -> None:
    """Count the fastest fits with ``graphpass.estimate`` (those counted already apart); one that
    does not fit after all moves to the rejected and the next is counted, ``verify`` in all."""
    counted = 0
    i = 0
    while i < len(result.candidates) and counted < problem.verify:
        cand = result.candidates[i]
        if cand.counted:
            i += 1
            continue
        problem.progress(f"counting: {cand.options.label()}")
        est = known[cand.options] = problem.estimate(cand.options)
        counted += 1
        fits = est.peak_bytes <= result.device_bytes
        cand = dataclasses.replace(cand, peak_bytes=est.peak_bytes, fits=fits, counted=True,
                                   predicted_bytes=cand.peak_bytes)
        if fits:
            result.candidates[i] = cand
            i += 1
        else:
            result.candidates.pop(i)
            result.rejected.append(cand)


def recompute_ladder(model_type: str, moe: bool) -> list[tuple[str, ...]]:
    """The recompute words tried, least first: none, norms and activations, attention too, then
    whole layers."""
    act = "moe_act" if moe else "act"
    attn: tuple[str, ...] = ("core_attn", "mla_up_proj") if model_type == "deepseek_v3" else ("core_attn",)
    return [(), ("layernorm", act), ("layernorm", act, *attn), ("full",)]


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def format_result(result: SearchResult, given: dict[str, Any], top: int = 10) -> str:
    """The ranked table, what was predicted and what counted, and the best as a backend call."""
    lines = [f"options that fit in {format_bytes(result.device_bytes)}, fastest first "
             f"(layer time: every decoder layer's forward and backward by an H100 roofline):"]
    for i, c in enumerate(result.candidates[:top], 1):
        how = "counted" if c.counted else "predicted"
        lines.append(f"  {i:>2}. {c.options.label():<58} peak {format_bytes(c.peak_bytes):>10} "
                     f"({how})  layers {_seconds(c.layer_seconds):>10}")
    off = [c for c in result.candidates + result.rejected
           if c.counted and c.predicted_bytes is not None and c.predicted_bytes != c.peak_bytes]
    for c in off:
        lines.append(f"  counted {c.options.label()}: {format_bytes(c.peak_bytes)}, predicted "
                     f"{format_bytes(c.predicted_bytes)} ({c.predicted_bytes / c.peak_bytes - 1:+.1%})")
    if len(result.candidates) > top:
        lines.append(f"  ... {len(result.candidates) - top} more")
    if not result.candidates:
        lines.append("  none: no option set tried fits")
    lines.append(f"tried {len(result.candidates) + len(result.rejected)} option sets "
                 f"({len(result.rejected)} do not fit); not tried: {result.skipped}, each more "
                 "recompute (or offload) than one that fits, which only adds time; "
                 f"{result.seconds:.0f} s")
    lines.append("predicted: each option set's peak from the step estimated under the given "
                 "options plus every layer's change of saved activations and one layer's change "
                 "of transients (one layer of each kind planned under fake tensors); counted: "
                 "graphpass.estimate run under those options")
    lines.extend(f"note: {n}" for n in result.notes)
    best = result.best()
    if best is not None:
        lines.append("")
        lines.append(f"best: {best.options.label()}")
        lines.append(f"  {best.options.backend_call(given)}")
        if best.options.micro_batch * best.options.micro_batches and (
                best.options.micro_batches > 1 or best.options.micro_batch > 1):
            lines.append(f"  with micro-batches of {best.options.micro_batch} sequences, "
                         f"{best.options.micro_batches} per optimizer step")
    return "\n".join(lines)


# -- few layers, scaled ------------------------------------------------------------------------------

def scaling_layers(config: Any) -> tuple[int, int] | None:
    """Two layer counts whose estimates extend linearly to the whole model: the model's first
    layers of another kind (DeepSeek-V3's dense ``first_k_dense_replace``) plus one and two of
    the kind it repeats; None where its layers do not repeat one kind after a prefix."""
    prefix = int(getattr(config, "first_k_dense_replace", 0) or 0)
    if getattr(config, "mlp_only_layers", None) or int(getattr(config, "decoder_sparse_step", 1) or 1) > 1:
        return None
    layers = config.num_hidden_layers
    a, b = prefix + 1, prefix + 2
    return (a, b) if b < layers else None


def scaled(small: tuple[int, JobEstimate], large: tuple[int, JobEstimate], layers: int) -> JobEstimate:
    """The estimate at ``layers`` layers, each phase's peak and each part at the peak extended
    linearly from the estimates at two layer counts."""
    (a, ea), (b, eb) = small, large

    def at(x: float, y: float) -> int:
        return int(round(x + (y - x) * (layers - a) / (b - a)))

    phases = []
    for p in eb.phases:
        q = ea.phase_peak(p.phase)
        phases.append(dataclasses.replace(p, bytes=at(q.bytes, p.bytes) if q else p.bytes))
    peak = max(phases, key=lambda p: p.bytes)
    breakdown = {part: at(ea.breakdown.get(part, 0), n) for part, n in eb.breakdown.items()}
    notes = [f"estimated: counted at {a} and {b} decoder layers, each phase's peak extended "
             f"linearly to {layers}"]
    if ea.phase is not eb.phase or sum(breakdown.values()) != peak.bytes:
        notes.append("the breakdown at the peak is extended part by part; its parts need not sum "
                     "to the peak where the peak moves between phases")
    return dataclasses.replace(eb, peak_bytes=peak.bytes, phase=peak.phase, module=peak.module,
                               micro_batch=peak.micro_batch, phases=tuple(phases),
                               breakdown=breakdown, notes=(*notes, *eb.notes))
