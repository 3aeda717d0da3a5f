"""The one frozen configuration object of graphpass: ``Config``, which holds the options grouped
by what they configure (``FP8``, ``Recompute``, ``Offload``, ``ActivationCache``, ``MemoryPlan``),
each a frozen dataclass that validates its own fields and knows which of them are in effect.

``Config(**flat keywords)`` (``fp8="tensorwise"``, ``recompute=("layernorm",)``: the names of
``SHORTHAND``, which the CLI, ``GRAPHPASS_OPTIONS`` and the named backends use too) builds the
groups; a group can be passed in its keyword's place (``Config(fp8=FP8("rowwise"))``).

One module because it is one vocabulary of options: the groups' messages name their fields by
the keywords of ``SHORTHAND``, which needs the groups' classes, and ``Config`` builds every group
from that table; it is also the one place outside ``fp8.recipes`` where a recipe name may be
compared (the user's ``fp8=`` string against the providers that run it,
``tests/test_recipe_identity.py``). Most of its length is the options' docstrings, which the
CLI's ``--help`` reads.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from .fp8 import recipes

# The fields that take one of a fixed set of values are typed with these; their valid values (and
# the CLI's flags) are read from the types: CHOICES below.
Codegen = Literal["inductor", "eager"]
FP8Recipe = Literal[None, "tensorwise", "blockwise", "mxfp8", "rowwise"]
# Transformer Engine's FP8 formats for fp8="tensorwise": HYBRID (E4M3 inputs and weights, E5M2
# gradients: TE's default) or E4M3 in every role (TE's Format.E4M3).
FP8Format = Literal["hybrid", "e4m3"]
Kernels = Literal["auto", "te", "scaled_mm", "reference"]
SaveOriginal = Literal["auto", "always", "never"]
Memory = Literal[None, "auto", "default"]
RecomputeMethod = Literal["uniform", "block"]
# Megatron-Core's recompute_modules vocabulary, plus "act" for dense MLP activations and "full".
RecomputeModule = Literal["layernorm", "act", "moe_act", "core_attn", "mlp", "moe", "shared_experts",
                          "mla_up_proj", "full"]
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)
# Which saved activations the FP8 activation cache stores in FP8 between forward and backward.
FP8Cache = Literal[None, "act_input", "attn", "layer_input", "all"]
# How: E4M3 with one fp32 scale per 1x128 block (``_pow2``: scales rounded down to powers of
# two, as DeepSeek-V3), or one scale per tensor in E4M3 or E5M2 (torch's own pass's format).
FP8CacheFormat = Literal["e4m3_1x128_pow2", "e4m3_1x128", "e4m3_tensor", "e5m2_tensor"]
# How FP8 GEMMs accumulate: Transformer Engine's and torchao's split (fast forward, precise
# gradients), or one mode for every GEMM.
FP8Accumulate = Literal["te", "fast", "precise"]
# Which linears stay bf16 because FP8 would be slower: judged on an H100's roofline, or never.
FP8CostModel = Literal["h100", "off"]
# Whether lowered weights are quantized once per optimizer step and held between steps: never,
# every weight, or those the memory budget's planner chooses within ``memory_budget``.
FP8WeightCache = Literal[False, True, "auto"]

_ANY_RECIPE = "fp8='tensorwise' (or another recipe)"


def _choice(name: str, value: Any, valid: tuple[Any, ...]) -> None:
    if value not in valid:
        raise ValueError(
            f"invalid graphpass option {name}={value!r}; valid values are: "
            + ", ".join(map(repr, valid))
        )


def _patterns(group: Any, field: str, name: str) -> None:
    """A tuple of strings (a list is accepted and frozen into a tuple)."""
    value = getattr(group, field)
    if isinstance(value, str):
        raise ValueError(f"invalid graphpass option {name}={value!r}; expected a tuple of strings: "
                         f"write {name}=({value!r},)")
    if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"invalid graphpass option {name}={value!r}; expected a tuple of strings")
    object.__setattr__(group, field, tuple(value))


def _type(name: str, value: Any, typ: type | tuple[type, ...]) -> None:
    if typ is int and isinstance(value, bool):  # True is an int to Python, not a count
        raise ValueError(f"invalid graphpass option {name}={value!r}; expected an int")
    if not isinstance(value, typ):
        raise ValueError(
            f"invalid graphpass option {name}={value!r}; expected "
            + " or ".join("None" if t is type(None) else f"a {t.__name__}"
                          for t in (typ if isinstance(typ, tuple) else (typ,))))


@functools.lru_cache(maxsize=None)
def _literals(cls: type) -> dict[str, tuple[Any, ...]]:
    """The valid values of each field of ``cls`` typed with a Literal."""
    hints = get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if get_origin(hints[f.name]) is Literal}


@dataclass(frozen=True)
class Unused:
    """An option set to a value that has no effect under the others: the config runs as without
    it, and the report says so in a note."""

    option: str
    """Its name as a keyword of ``Config`` (``kernels``, ``offload_min_bytes``)."""
    value: Any
    needs: str
    """What would put it in effect (``"offload=True"``)."""

    def __str__(self) -> str:
        return f"{self.option}={self.value!r} has no effect without {self.needs}"


G = TypeVar("G", bound="_Group")


class _Group:
    """What every option group shares: messages that name its fields by their ``Config``
    keyword (``SHORTHAND``), and which of its fields are in effect."""

    def _unused(self) -> list[tuple[str, str]]:
        """(field, what would put it in effect) for each field the others leave without effect."""
        return []

    def _ignored(self) -> list[tuple[str, str]]:
        """``_unused`` where the field is set to other than its default."""
        fields = self.__dataclass_fields__  # type: ignore[attr-defined]
        return [(name, needs) for name, needs in self._unused()
                if getattr(self, name) != fields[name].default]

    def unused(self) -> tuple[Unused, ...]:
        """The options set to a non-default value that have no effect under the others."""
        return tuple(Unused(self._keyword(name), getattr(self, name), needs)
                     for name, needs in self._ignored())

    def in_effect(self: G) -> G:
        """This group with each option that has no effect back at its default."""
        fields = self.__dataclass_fields__  # type: ignore[attr-defined]
        ignored = {name: fields[name].default for name, _ in self._ignored()}
        return dataclasses.replace(self, **ignored) if ignored else self  # type: ignore[type-var]

    def _keyword(self, name: str) -> str:
        """The Config keyword of field ``name``: what messages call it."""
        return next((_KEYWORDS[c, name] for c in type(self).__mro__ if (c, name) in _KEYWORDS),
                    name)

    def _choices(self) -> None:
        for name, valid in _literals(type(self)).items():
            _choice(self._keyword(name), getattr(self, name), valid)

    def _bools(self, *names: str, optional: bool = False) -> None:
        for name in names:
            if not (optional and getattr(self, name) is None):
                _type(self._keyword(name), getattr(self, name), bool)

    def _counts(self, *names: str) -> None:
        """Ints of 0 or more."""
        for name in names:
            _type(self._keyword(name), getattr(self, name), int)
            if getattr(self, name) < 0:
                raise ValueError(f"invalid graphpass option {self._keyword(name)}="
                                 f"{getattr(self, name)}; expected a count of 0 or more")

    def _patterns(self, *names: str) -> None:
        for name in names:
            _patterns(self, name, self._keyword(name))


@dataclass(frozen=True)
class FP8(_Group):
    """FP8 training of linear layers: the recipe and how it runs (``Config(fp8=...)``, or the
    ``fp8_*``, ``kernels`` and ``fuse_quantize`` keywords). ``FP8()``, the
    default, is FP8 off; its other options then have no effect."""


    recipe: FP8Recipe = None
    """FP8 recipe for linear layers: ``None`` (off), ``"tensorwise"``, ``"blockwise"``, ``"mxfp8"``,
    ``"rowwise"`` (E4M3 everywhere, one fp32 scale per row of each GEMM operand: the recipe of
    ``torch._scaled_mm``'s and ``torch._scaled_grouped_mm``'s rowwise kernels, torchao's
    ``rowwise``).
    Turn it on to train the linears in FP8; docs/hardware.md says which recipe each GPU runs
    natively, and docs/fp8.md#recipes how they differ."""

    pow2_scales: bool | None = None
    """Scales rounded down to powers of two, so scaling and unscaling are exact: with
    ``fp8="rowwise"`` (off by default; torchao's ``round_scales_to_power_of_2``) or
    ``fp8="blockwise"`` (on by default, Transformer Engine's ``Float8BlockScaling``; ``False``
    gives the plain ``fp8_max / amax`` scales of DeepSeek-V3's recipe). ``None``: the recipe's
    default. Set it to match another implementation's bits (torchao's
    rowwise with ``round_scales_to_power_of_2``, DeepSeek-V3's plain scales); leave it ``None``
    otherwise."""

    format: FP8Format = "hybrid"
    """With ``fp8="tensorwise"``: Transformer Engine's FP8 format. ``"hybrid"`` (TE's
    ``Format.HYBRID``, its default): E4M3 inputs and weights, E5M2 gradients. ``"e4m3"`` (TE's
    ``Format.E4M3``): gradients E4M3 too, each with its own tensorwise scale; then the expert
    GEMMs' dgrad and wgrad run as one ``torch._scaled_grouped_mm`` each, as their forward does
    (the grouped kernel takes E4M3 operands only). The other recipes are E4M3 in every role
    already. Leave it at ``"hybrid"`` unless matching a Transformer Engine run that
    uses ``Format.E4M3``."""

    kernels: Kernels = "auto"
    """FP8 kernel provider: ``"auto"``, ``"te"`` (Transformer Engine's kernels), ``"scaled_mm"``
    (``torch._scaled_mm`` and ``torch._scaled_grouped_mm``) or ``"reference"`` (pure torch,
    exact, any device). ``"auto"`` picks the first provider that runs the recipe on the device
    (docs/fp8.md#kernel-providers). Leave it at ``"auto"``; name a provider to compare against
    it, or ``"reference"`` to check numerics on a CPU."""

    exclude: tuple[str, ...] = ("output", "lm_head", "*.gate", "*.router")
    """Module-path patterns (fnmatch) of linears kept in high precision: the output head and MoE
    routers by default, as Megatron and torchtitan do. Add the paths of
    linears whose precision matters more than their speed, or whose GEMMs are too small to
    gain."""

    fuse_quantize: bool = True
    """With ``codegen="inductor"`` and ``fp8="tensorwise"``, ``"rowwise"`` or ``"blockwise"``:
    after the partition, inline each quantize's recipe so Inductor fuses its amax, scale and
    cast with the neighbouring ops, gradients' quantizes included (mxfp8's stay one op, with a
    report note). It reads the bf16-rounded value eager
    reads (bit-identical to the opaque op on the CPU); the contract is each dequantized value
    within one FP8 ulp of the opaque op's (docs/fp8.md#exactness). ``False`` keeps each quantize
    one opaque op, for debugging. Leave it on."""

    sequence_all_gather: bool = True
    """With ``fp8="tensorwise"`` under sequence parallelism: quantize each rank's shard before the
    all-gather of a column-parallel input (and of a row-parallel output gradient in the
    backward), with the amax reduced (max) over the group, and all-gather the FP8 bytes, as
    Transformer Engine does: half the bytes of a bf16 all-gather, the same FP8 bits. ``False``
    all-gathers the high-precision tensor and quantizes it after. (``fp8_all_gather`` is its
    deprecated name.)
    Leave it on; ``False`` to compare with a high-precision all-gather."""

    weight_all_gather: bool = True
    """With ``fp8="tensorwise"``, FSDP's all-gathers of the weights graphpass lowers move FP8:
    each shard quantized with the whole weight's amax (one all-reduce for all of them), half
    the bytes of a bf16 all-gather, the same FP8 bits as quantizing the gathered weight. With
    ``fp8="blockwise"``, where each shard is whole 128x128 tiles (even shards of a multiple of
    128 rows): each shard quantized alone, its FP8 bytes and tile scales gathered; other shards,
    and rowwise and mxfp8 weights, gather bf16 with a note
    (docs/distributed.md#fp8-weight-all-gathers-per-recipe). Under FSDP2 (``fully_shard``), for
    the weights ``graphpass.fsdp_fp8_weights(model, config)`` wraps before ``fully_shard``
    (docs/distributed.md#fsdp2-weights-all-gathered-in-fp8); under torchtitan's SimpleFSDP, in
    the graph. ``False``: the weights are all-gathered in the parameter dtype and quantized
    after."""

    accumulate: FP8Accumulate = "te"
    """How the FP8 GEMMs accumulate: ``"te"`` (fast accumulation for the forward GEMM, split,
    i.e. precise, accumulation for dgrad and wgrad, as Transformer Engine's recipes and torchao's
    float8 set it), ``"fast"`` or ``"precise"`` for every GEMM. ``torch._scaled_mm``'s
    ``use_fast_accum`` and TE's ``use_split_accumulator``; the reference provider accumulates in
    fp32 whatever the mode (it models the precise one). Leave it at ``"te"``;
    ``"precise"`` everywhere when checking whether fast accumulation explains a difference from
    a bf16 run."""

    cost_model: FP8CostModel = "h100"
    """``"h100"``: a linear whose FP8 GEMMs plus quantizes an H100's roofline estimates slower than
    its bf16 GEMMs (a small N or K, such as grouped-query k/v projections; MoE experts with few
    tokens each, whose GEMMs read their weights) stays in high precision, with a ``not lowered:
    ...: faster in bf16 (...)`` note (``graphpass/fp8/cost.py``) that also says where
    quantizing the weight once per optimizer step (``weight_cache`` with gradient accumulation)
    would make FP8 the faster; the H100 is the target on every device, a CPU included.
    ``"off"`` lowers every eligible linear. Leave it at ``"h100"`` for step
    time; ``"off"`` to run every linear in FP8 as Transformer Engine's modules do (to compare
    with TE, or where the FP8 copies' smaller bytes matter more than speed)."""

    min_gemm_flops: int = 0
    """Linears whose forward GEMM has fewer FLOPs (2*M*N*K) stay in high precision.
    Use it to keep small linears in high precision by size alone, without the cost model's
    judgement."""

    save_original: SaveOriginal = "auto"
    """For the quantized copy of a linear's input that wgrad needs (the columnwise X):
    ``"never"`` saves the FP8 copy, quantized in the forward as TE does by default;
    ``"always"`` saves the original and re-quantizes in the backward (TE's
    ``save_original_input``); ``"auto"`` lets the partitioner pick whichever saves fewer bytes
    (the original wins when it is saved anyway or its producer is recomputed). A weight's copy is
    always re-quantized from the resident parameter. Leave it at ``"auto"``; ``"never"``
    or ``"always"`` reproduce Transformer Engine's default or its ``save_original_input``.
    (``save_original`` is its deprecated name.)"""

    save_original_modules: tuple[str, ...] = ()
    """Module-path patterns of linears that always save their original input, whatever
    ``save_original`` says for the others (Megatron's per-module ``save_original_input``). Use it to
    reproduce a Megatron configuration that sets ``save_original_input`` on some modules.
    (``save_original_modules`` is its deprecated name.)"""

    weight_once: bool = False
    """Quantize each lowered weight once per step: its fprop and dgrad FP8 copies from one read
    of the weight in the forward, dgrad's copy saved for the backward (1 byte per weight element
    plus its scales, held until the backward reads it: Transformer Engine's default). Off, the
    backward re-quantizes dgrad's copy from the resident parameter: no memory, one more read of
    the weight. A memory decision: gradients are bit-identical either way. Turn it on to
    read each weight once per step, as Transformer Engine does, where memory allows it; leave it
    off where memory is what limits the step. (``fp8_weight_once`` is its deprecated name.)"""

    weight_cache: FP8WeightCache = False
    """Quantize each lowered weight once per optimizer step: with gradient accumulation, the
    first micro-batch after the weight changed quantizes both of its FP8 copies and the others
    reuse them (keyed on the parameter's version counter: an optimizer step, ``load_state_dict``
    or an in-place edit invalidates them; writes through ``p.data`` do not, see
    ``graphpass.clear_weight_cache``). The copies are held between steps, 1 byte per element and
    copy (as much as the bf16 weight for a weight with dgrad), listed in the report and counted
    in the step peak. ``True``: every weight that is a parameter; ``"auto"``: the weights the
    memory planner chooses where the predicted peak stays within ``memory_budget``, the most
    quantize work per cached byte first (without a budget, none, with a note). A memory
    decision: gradients are bit-identical either way
    (docs/memory/weight-cache.md#fp8_weight_cache). Use it with gradient
    accumulation, where every micro-batch would quantize the same weights again; ``"auto"``
    with ``memory_budget`` caches only what fits."""

    def __post_init__(self) -> None:
        if self.recipe == "delayed":
            raise ValueError(
                "invalid graphpass option fp8='delayed': DelayedScaling keeps amax history as "
                "state across steps, which torch.compile cannot trace (Transformer Engine refuses "
                "it under compile too); use fp8='tensorwise' (current scaling), 'rowwise', "
                "'blockwise' or 'mxfp8'"
            )
        self._choices()
        # Contradictions: a provider asked to run a recipe it does not have.
        if self.kernels == "te" and self.recipe == "rowwise":
            raise ValueError(
                "invalid graphpass options kernels='te' with fp8='rowwise': Transformer Engine has "
                "no rowwise (per-row current) scaling recipe; use kernels='scaled_mm' "
                "(torch._scaled_mm / torch._scaled_grouped_mm rowwise), 'auto' or 'reference'"
            )
        runs = {"te": (None, "tensorwise"),
                "scaled_mm": (None, "tensorwise", "rowwise", "blockwise")}
        if self.recipe not in runs.get(self.kernels, (self.recipe,)):
            raise ValueError(
                f"invalid graphpass options kernels={self.kernels!r} with fp8={self.recipe!r}: "
                f"that provider runs fp8={' or '.join(map(repr, runs[self.kernels][1:]))} only; use "
                f"kernels='reference' (or 'auto') for fp8={self.recipe!r}"
            )
        self._bools("fuse_quantize", "sequence_all_gather", "weight_all_gather", "weight_once")
        self._bools("pow2_scales", optional=True)
        if not (isinstance(self.weight_cache, bool) or self.weight_cache == "auto"):
            raise ValueError(f"invalid graphpass option fp8_weight_cache={self.weight_cache!r}; "
                             "valid values are: False, True, 'auto'")
        self._patterns("exclude", "save_original_modules")
        self._counts("min_gemm_flops")

    def _unused(self) -> list[tuple[str, str]]:
        # fp8_exclude, save_original, fuse_quantize and the fp8 all-gathers need no note: sweeps over
        # fp8 (None included) set them for every point, as the CLI's policies do.
        out = [] if self.recipe is not None else [
            (name, _ANY_RECIPE) for name in ("save_original_modules", "weight_once", "weight_cache",
                                             "min_gemm_flops", "accumulate", "cost_model",
                                             "kernels")]
        if not recipes.takes_option(self.recipe, "fp8_pow2_scales"):
            out.append(("pow2_scales", "fp8='rowwise' or fp8='blockwise' (mxfp8's E8M0 scales are "
                                       "powers of two by construction, tensorwise's are not "
                                       "rounded)"))
        if not recipes.takes_option(self.recipe, "fp8_format"):
            out.append(("format", "fp8='tensorwise' (the other recipes are E4M3 in every role "
                                  "already)"))
        return out

    @property
    def scaling(self) -> recipes.Recipe | None:
        """The recipe these options name (None: FP8 off): ``recipe`` with its variant of
        ``format``, ``pow2_scales`` and ``accumulate`` where the recipe takes them
        (``recipes.from_options``)."""
        on = self.in_effect()
        return recipes.from_options(on.recipe, on.format, on.pow2_scales, on.accumulate)


@dataclass(frozen=True)
class Recompute(_Group):
    """Output-discarding recompute of selected modules (``Config(recompute=...)``, or the
    ``recompute_*`` keywords)."""


    modules: tuple[RecomputeModule, ...] = ()
    """Output-discarding recompute, in Megatron's words: ``layernorm``, ``act``, ``moe_act``,
    ``core_attn``, ``mlp``, ``moe``, ``shared_experts``, ``mla_up_proj``, or ``full`` layers.
    Use it to trade compute for activation memory by kind of module, as Megatron-Core's
    ``recompute_modules`` does: ``layernorm`` and ``act`` recompute cheap ops, ``core_attn``,
    ``mlp``, ``moe`` and ``full`` recompute GEMMs or attention. Without it the memory planner
    (``memory_planner``) still recomputes cheap ops where that saves bytes."""

    method: RecomputeMethod = "uniform"
    """For ``recompute=("full",)``: ``"uniform"`` checkpoints every chunk of
    ``recompute_num_layers`` layers; ``"block"`` the first ``recompute_num_layers`` layers. Use ``"block"``
    when only some layers need to be checkpointed to fit."""

    num_layers: int = 1
    """Layers per checkpointed chunk (``uniform``) or checkpointed layers (``block``).
    Larger chunks save fewer boundary tensors and recompute a whole chunk at once in the
    backward."""

    include: tuple[str, ...] = ("*",)
    """Module-path patterns narrowing where ``recompute`` applies (e.g. ``("layers.[0-3].*",)``). Use it
    to recompute in some layers only."""

    def __post_init__(self) -> None:
        self._choices()
        self._patterns("modules", "include")
        for item in self.modules:
            _choice("recompute", item, RECOMPUTE_MODULES)
        _type("recompute_num_layers", self.num_layers, int)
        if self.num_layers < 1:
            raise ValueError(f"invalid graphpass option recompute_num_layers="
                             f"{self.num_layers}; expected a positive layer count")

    def _unused(self) -> list[tuple[str, str]]:
        out = []
        if "full" not in self.modules:
            out += [("method", "recompute=('full',)"), ("num_layers", "recompute=('full',)")]
        if not self.modules:
            out.append(("include", "a recompute selection such as recompute=('core_attn',)"))
        return out


@dataclass(frozen=True)
class Offload(_Group):
    """Offloading saved activations to CPU with torch's activation offloading
    (``Config(offload=...)``, or the ``offload_*`` keywords). ``Offload()``, the default, is off;
    ``Offload(True, min_bytes=...)`` on."""


    enabled: bool = False
    """Offload eligible saved activations to CPU with torch's activation offloading.
    Use it when saved activations do not fit on the device and the copies to and from host
    memory can overlap compute; recompute (``recompute``) is the other way to free them."""

    stream: bool | None = None
    """With ``offload``, on CUDA: copy on a separate stream and prefetch reloads (torch's
    separate-stream mode); ``False``, or on CPU, the copies run synchronously on the default
    stream. ``None`` (unset) means on whenever ``offload`` is. Leave it unset;
    ``False`` to debug with synchronous copies."""

    min_bytes: int = 1 << 20
    """Saved tensors smaller than this are never offloaded. Raise it to offload
    only large tensors, whose copies are worth their launch."""

    hidden_only: bool = False
    """With ``offload``: offload only the saved tensors whose copies an H100's roofline hides
    under compute on torch's separate stream, largest and longest-lived first; the others stay
    on the device, ``offload: no (copy not hidden: ...)``
    (docs/memory/offload.md#offload_hidden_only). Turn it on to offload only what
    costs no step time by that estimate."""

    exclude: tuple[str, ...] = ()
    """Module-path or op patterns (``"layers.0.*"``, ``"aten.mm"``) never offloaded (opt-out). Use it to
    keep the tensors the backward reads first on the device."""

    def __post_init__(self) -> None:
        self._bools("enabled", "hidden_only")
        self._bools("stream", optional=True)
        self._counts("min_bytes")
        self._patterns("exclude")

    def _unused(self) -> list[tuple[str, str]]:
        if self.enabled:
            return []
        return [(name, "offload=True") for name in ("stream", "min_bytes", "hidden_only",
                                                     "exclude")]


@dataclass(frozen=True)
class ActivationCache(_Group):
    """The FP8 activation cache: saved activations stored in FP8 between forward and backward
    (``Config(fp8_activation_cache=...)``, or the ``fp8_activation_cache_*`` keywords)."""


    level: FP8Cache = None
    """Lossy, opt-in: store saved activations in FP8 between forward and backward (after the
    exact passes, of what they still save). ``"act_input"``: inputs of activation functions
    (SwiGLU's gate and up, GELU's input); ``"attn"``: attention's saved inputs and output;
    ``"layer_input"``: residual-stream tensors saved for norms; ``"all"``: every saved floating
    activation. The backward reads the dequantized value; the forward the exact one. Use it when
    the exact options (``recompute``, ``offload``, ``memory_budget``) do not free enough memory,
    and compare the loss with a run without it. (``fp8_cache`` is its deprecated name.)"""

    format: FP8CacheFormat = "e4m3_1x128_pow2"
    """The FP8 activation cache's format: ``"e4m3_1x128_pow2"`` (one power-of-two scale per
    1x128 block along the last dimension, stored as an E8M0 byte: DeepSeek-V3's activations),
    ``"e4m3_1x128"`` (the same with fp32 scales), ``"e4m3_tensor"`` or ``"e5m2_tensor"`` (one
    scale per tensor). Leave the default; a per-tensor format keeps fewer scales and
    loses more precision on tensors with outliers. (``fp8_cache_format`` is its deprecated
    name.)"""

    min_bytes: int = 1 << 16
    """Saved activations smaller than this stay in their dtype under ``fp8_activation_cache``.
    Raise it to keep more tensors exact. (``fp8_cache_min_bytes`` is its deprecated name.)"""

    def __post_init__(self) -> None:
        self._choices()
        self._counts("min_bytes")

    def _unused(self) -> list[tuple[str, str]]:
        if self.level is not None:
            return []
        return [(name, "fp8_activation_cache='act_input' (or another level)") for name in ("format",
                                                                                 "min_bytes")]


@dataclass(frozen=True)
class MemoryPlan(_Group):
    """How the partitioner chooses what to save (``Config(memory_planner=...)``,
    ``planner_recompute_budget``, ``memory_budget``)."""


    policy: Memory = None
    """``"auto"``: the planner minimises saved bytes, recomputing any non-GEMM, non-attention op
    within ``planner_recompute_budget``; ``"default"``: torch's min-cut heuristics. ``None`` means
    ``"auto"`` when FP8 is on and ``"default"`` otherwise. Leave it unset;
    ``"default"`` to compare with torch's own partitioner. (``memory`` is its deprecated
    name.)"""

    recompute_budget: float | None = 0.01
    """Most recompute the planner (``memory_planner="auto"``) may add, as a fraction of the
    step's FLOPs (None: no limit). Raise it to let the planner trade more compute for memory,
    ``0`` to keep it from recomputing. (``recompute_budget`` is its deprecated name.)"""

    budget: int | float | None = None
    """The most the step's predicted peak may be: bytes (an int), or a fraction of the device's
    memory (a float in (0, 1]; an H100's memory when no CUDA device is present). The planner
    recomputes or offloads saved tensors until it fits, at the least added time by a roofline
    estimate, exactly (gradients unchanged); a ValueError when no plan fits. ``None``: no
    budget (docs/memory/memory-budget.md#memory_budget). Set it when a step must fit a
    device: a fraction below 1 leaves room for what the step's graph does not hold (the
    allocator's fragmentation, other programs)."""

    def __post_init__(self) -> None:
        self._choices()
        if self.recompute_budget is not None and not (
                isinstance(self.recompute_budget, (int, float))
                and not isinstance(self.recompute_budget, bool)
                and 0 <= self.recompute_budget < float("inf")):
            raise ValueError(f"invalid graphpass option planner_recompute_budget="
                             f"{self.recompute_budget!r}; expected a fraction of step FLOPs such "
                             "as 0.01, or None for no limit")
        budget = self.budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or (isinstance(budget, int) and budget <= 0)
                                   or (isinstance(budget, float) and not 0 < budget <= 1)):
            raise ValueError(f"invalid graphpass option memory_budget={budget!r}; expected bytes "
                             "(an int > 0) or a fraction of the device's memory (a float in "
                             "(0, 1], such as 0.9)")


# Each keyword of Config: the attribute of the group that holds it (None: Config's own field) and
# its field there. The CLI's flags, GRAPHPASS_OPTIONS, the named backends and ``as_dict`` use
# these names, in this order.
SHORTHAND: dict[str, tuple[str | None, str]] = {
    "codegen": (None, "codegen"),
    "report": (None, "report"),
    "fp8": ("float8", "recipe"),
    "fp8_pow2_scales": ("float8", "pow2_scales"),
    "fp8_format": ("float8", "format"),
    "kernels": ("float8", "kernels"),
    "fp8_exclude": ("float8", "exclude"),
    "fuse_quantize": ("float8", "fuse_quantize"),
    "order_backward": (None, "order_backward"),
    "fp8_sequence_all_gather": ("float8", "sequence_all_gather"),
    "fp8_weight_all_gather": ("float8", "weight_all_gather"),
    "fp8_accumulate": ("float8", "accumulate"),
    "fp8_cost_model": ("float8", "cost_model"),
    "fp8_min_gemm_flops": ("float8", "min_gemm_flops"),
    "fp8_save_original_input": ("float8", "save_original"),
    "fp8_save_original_input_modules": ("float8", "save_original_modules"),
    "fp8_save_quantized_weight": ("float8", "weight_once"),
    "fp8_weight_cache": ("float8", "weight_cache"),
    "recompute": ("recomputation", "modules"),
    "recompute_method": ("recomputation", "method"),
    "recompute_num_layers": ("recomputation", "num_layers"),
    "recompute_include": ("recomputation", "include"),
    "memory_planner": ("memory_plan", "policy"),
    "planner_recompute_budget": ("memory_plan", "recompute_budget"),
    "memory_budget": ("memory_plan", "budget"),
    "offload": ("offloading", "enabled"),
    "offload_stream": ("offloading", "stream"),
    "offload_min_bytes": ("offloading", "min_bytes"),
    "offload_hidden_only": ("offloading", "hidden_only"),
    "offload_exclude": ("offloading", "exclude"),
    "fp8_activation_cache": ("activation_cache", "level"),
    "fp8_activation_cache_format": ("activation_cache", "format"),
    "fp8_activation_cache_min_bytes": ("activation_cache", "min_bytes"),
}

# Deprecated keywords: each old name and the keyword it now is. ``Config``, ``replace``,
# ``from_options`` (hence ``GRAPHPASS_OPTIONS`` and the named backends) accept the old name with
# a FutureWarning, once per name and process; ``config.<old name>`` reads the new keyword.
DEPRECATED: dict[str, str] = {
    "fp8_all_gather": "fp8_sequence_all_gather",
    # Names that read as something else: the FP8 weight copy saved for the backward (not a cache
    # held between steps, fp8_weight_cache); the activation cache (not a weight cache); the
    # planner's choice and its recompute budget (not the memory budget, nor the recompute_*
    # selections); the linear's original input saved for wgrad.
    "fp8_weight_once": "fp8_save_quantized_weight",
    "fp8_cache": "fp8_activation_cache",
    "fp8_cache_format": "fp8_activation_cache_format",
    "fp8_cache_min_bytes": "fp8_activation_cache_min_bytes",
    "memory": "memory_planner",
    "recompute_budget": "planner_recompute_budget",
    "save_original": "fp8_save_original_input",
    "save_original_modules": "fp8_save_original_input_modules",
}
_warned: set[str] = set()


def _renamed(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with each deprecated keyword under its new name (warned once per name)."""
    if not any(name in DEPRECATED for name in options):
        return options
    out = {}
    for name, value in options.items():
        new = DEPRECATED.get(name)
        if new is None:
            out[name] = value
            continue
        if new in options:
            raise ValueError(f"graphpass options {name} and {new} given together: {name} is the "
                             f"deprecated name of {new}; give {new} only")
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"graphpass option {name} is deprecated; use {new}", FutureWarning,
                          stacklevel=4)
        out[new] = value
    return out


# Each group of Config: its attribute, its class, and the keyword that takes it whole as well as
# its main option's value (``fp8="tensorwise"`` or ``fp8=FP8("tensorwise", ...)``).
GROUPS: dict[str, tuple[type[_Group], str]] = {
    "float8": (FP8, "fp8"),
    "recomputation": (Recompute, "recompute"),
    "offloading": (Offload, "offload"),
    "activation_cache": (ActivationCache, "fp8_activation_cache"),
    "memory_plan": (MemoryPlan, "memory_planner"),
}
# Each group field's keyword, for the groups' messages.
_KEYWORDS: dict[tuple[type, str], str] = {
    (GROUPS[attr][0], field): name for name, (attr, field) in SHORTHAND.items() if attr}


@dataclass(frozen=True, init=False)
class Config:
    """Options of the graphpass backend and partitioner, grouped: ``float8`` (``FP8``),
    ``recomputation`` (``Recompute``), ``offloading`` (``Offload``), ``activation_cache``
    (``ActivationCache``) and ``memory_plan`` (``MemoryPlan``), beside ``codegen``, ``report``
    and ``order_backward``.

    ``Config(**options)`` takes the keywords of ``SHORTHAND`` (``fp8="tensorwise"``,
    ``kernels="scaled_mm"``, ``recompute=("layernorm",)``), a group in its keyword's place
    (``fp8=FP8("rowwise", kernels="scaled_mm")``), or both (the keywords then change the group).
    Each group validates its own fields on construction: an invalid value, or a contradiction
    (``kernels="te"`` with ``fp8="rowwise"``), raises a ValueError that names the valid values. An
    option that has no effect under the others (``kernels="reference"`` with FP8 off) is kept as
    written but not applied, and the report says so in a note (``unused()``).
    An unknown option name raises a ValueError that lists the valid ones.

    Each keyword of a group reads back as an attribute (``config.fp8``, ``config.kernels``): the
    value in effect; ``codegen``, ``report`` and ``order_backward`` are Config's own fields, as
    written. ``as_dict()`` and ``changed()`` give every option as written.
    """

    codegen: Codegen = "inductor"
    """Code generation after partitioning: ``"inductor"`` (default) or ``"eager"`` (the
    partitioned graphs run op by op). Train with ``"inductor"``; ``"eager"`` to debug a graph,
    or to plan and report where compiling kernels is not wanted: it partitions the same joint
    graph."""

    report: bool = True
    """Build a saved-tensor report after each partition (``graphpass.last_report()``). Turn it
    off where nothing reads the report, to save its cost at compile time."""

    order_backward: bool = False
    """With ``codegen="inductor"``, the backward ordered for memory
    (docs/memory/order-backward.md#order_backward). On a GPU, each FP8 GEMM's operand copies
    are made after the GEMM before it in the graph's order (control dependencies Inductor's
    scheduler keeps) and each gradient is quantized from a buffer of its own, which lowers the
    backward's peak for more bytes moved by its kernels (the step-peak model follows that
    order). On the CPU, each group of reductions Inductor's C++ code runs as one kernel (a
    layer's norm weight gradients) moves beside the last buffer they read, so the weight-gradient
    quantizes and GEMMs between them run beside their data gradients (a report note says what
    moved). Either way only the order of kernels changes: gradients are bit-identical with and
    without it. Off by default. Turn it on when the backward holds the step's peak and memory
    matters more than step time; docs/numbers.md has its measurements."""

    float8: FP8 = FP8()
    """FP8 training of linear layers."""

    recomputation: Recompute = Recompute()
    """Output-discarding recompute of selected modules."""

    offloading: Offload = Offload()
    """Offloading saved activations to CPU."""

    activation_cache: ActivationCache = ActivationCache()
    """The FP8 activation cache (lossy, opt-in)."""

    memory_plan: MemoryPlan = MemoryPlan()
    """The partitioner's memory policy and budgets."""

    def __init__(self, **options: Any) -> None:
        _build(self, {f.name: f.default for f in dataclasses.fields(Config)}, options)

    def __repr__(self) -> str:
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self.changed().items()) + ")"

    @property
    def memory_policy(self) -> str:
        return self.memory_planner or ("auto" if self.fp8 else "default")

    @property
    def recipe(self) -> recipes.Recipe | None:
        """The FP8 recipe the options name (None: FP8 off): ``fp8`` with its variant of
        ``fp8_format``, ``fp8_pow2_scales`` and ``fp8_accumulate`` (``recipes.from_options``)."""
        return self.float8.scaling

    @property
    def fp8_recipe(self) -> str | None:
        """The recipe key the FP8 graph ops carry (``Recipe.key``): ``fp8``, ``"rowwise_pow2"``
        for ``fp8="rowwise"`` with ``fp8_pow2_scales=True``, ``"blockwise_nopow2"`` for
        ``fp8="blockwise"`` with ``fp8_pow2_scales=False``, ``"tensorwise_e4m3"`` for
        ``fp8="tensorwise"`` with ``fp8_format="e4m3"``, and a word for an ``fp8_accumulate``
        other than ``"te"`` (``"tensorwise_fast"``)."""
        recipe = self.recipe
        return None if recipe is None else recipe.key

    @property
    def offload_on_stream(self) -> bool:
        return self.offload and self.offload_stream is not False

    def unused(self) -> tuple[Unused, ...]:
        """The options set to a value that has no effect under the others: each runs as its
        default would, and the report notes it (``unused: ...``)."""
        own = (Unused("order_backward", self.order_backward,
                      "codegen='inductor' (graphs run as they are under codegen='eager')"),
               ) if self.order_backward and self.codegen != "inductor" else ()
        return own + tuple(u for attr in GROUPS for u in getattr(self, attr).unused())

    @classmethod
    def from_options(cls, **options: Any) -> "Config":
        _known(options)
        return cls(**options)

    def replace(self, **options: Any) -> "Config":
        """This config with some options changed: keywords (``replace(kernels="te")`` keeps the
        rest of the FP8 group) or groups."""
        _known(options)
        config = object.__new__(Config)
        _build(config, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, options)
        return config

    def changed(self) -> dict[str, Any]:
        """The options, as written, that differ from their defaults."""
        return {k: v for k, v in self.as_dict().items() if v != DEFAULTS[k]}

    def as_dict(self) -> dict[str, Any]:
        """Every option by its keyword, as written."""
        return {name: getattr(self if attr is None else getattr(self, attr), field)
                for name, (attr, field) in SHORTHAND.items()}


def _build(config: Config, values: dict[str, Any], options: dict[str, Any]) -> None:
    """Set ``config``'s fields: ``values`` (the groups and Config's own fields) changed by
    ``options`` (keywords of ``SHORTHAND`` or ``DEPRECATED``, or groups by keyword or
    attribute)."""
    _known(options)
    options = _renamed(options)
    values = dict(values)
    for name, (attr, _) in SHORTHAND.items():
        if attr is None and name in options:
            values[name] = options[name]
    for attr, (cls, keyword) in GROUPS.items():
        group = options.get(attr, values[attr])
        if isinstance(options.get(keyword), _Group):
            group = options[keyword]
        if not isinstance(group, cls):
            name = keyword if isinstance(options.get(keyword), _Group) else attr
            raise ValueError(f"invalid graphpass option {name}={group!r}; expected a "
                             f"graphpass.{cls.__name__}")
        changes = {field: options[name] for name, (a, field) in SHORTHAND.items()
                   if a == attr and name in options and not isinstance(options[name], _Group)}
        values[attr] = dataclasses.replace(group, **changes) if changes else group
    for name, value in values.items():
        object.__setattr__(config, name, value)
    # What the keywords read back: each group with its unused options at their defaults.
    object.__setattr__(config, "_in_effect", {attr: values[attr].in_effect() for attr in GROUPS})
    _choice("codegen", config.codegen, CHOICES["codegen"])
    _type("report", config.report, bool)
    _type("order_backward", config.order_backward, bool)


def _known(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(SHORTHAND) - set(GROUPS) - set(DEPRECATED))
    if unknown:
        raise ValueError(
            f"unknown graphpass option(s) {', '.join(map(repr, unknown))}; "
            f"valid options are: {', '.join(SHORTHAND)}"
        )


def _keyword_property(name: str, attr: str, field: str) -> property:
    def read(config: Config) -> Any:
        return getattr(config._in_effect[attr], field)  # type: ignore[attr-defined]

    read.__name__ = name
    read.__doc__ = f"``{attr}.{field}`` in effect (its default where it has no effect)."
    return property(read)


for _name, (_attr, _field) in SHORTHAND.items():
    if _attr is not None:
        setattr(Config, _name, _keyword_property(_name, _attr, _field))
for _name, _new in DEPRECATED.items():
    setattr(Config, _name, _keyword_property(_name, *SHORTHAND[_new]))


def option_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """Each keyword of Config with the dataclass that holds it and its field there (for the CLI's
    flags: its type, default and docstring)."""
    owners = {None: Config, **{attr: cls for attr, (cls, _) in GROUPS.items()}}
    return [(name, owners[attr], owners[attr].__dataclass_fields__[field])  # type: ignore[index]
            for name, (attr, field) in SHORTHAND.items()]


# Every keyword's default.
DEFAULTS: dict[str, Any] = {name: f.default for name, _, f in option_fields()}
# Valid values of the keywords that take one of a fixed set; the CLI builds its flags from this.
CHOICES: dict[str, tuple[Any, ...]] = {
    name: _literals(owner)[f.name] for name, owner, f in option_fields()
    if f.name in _literals(owner)}
# Tuple keywords whose items come from a fixed set.
ITEM_CHOICES: dict[str, tuple[str, ...]] = {"recompute": RECOMPUTE_MODULES}


def given(config: Any) -> Config:
    """A ``config=`` argument: a Config, or None for the defaults."""
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise ValueError(f"config={config!r} is not a graphpass.Config; write "
                         "config=graphpass.Config(fp8='tensorwise', ...) (or leave it out)")
    return config


__all__ = ["ActivationCache", "Config", "FP8", "MemoryPlan", "Offload", "Recompute", "Unused"]
