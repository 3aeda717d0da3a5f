"""The one frozen configuration object of graphpass, and its validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

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

@dataclass(frozen=True)
class Config:
    """Options of the graphpass backend and partitioner.

    Every field is validated on construction; an invalid value raises a ValueError that names the
    valid values. ``Config.from_options(**kw)`` also rejects unknown option names.
    """

    codegen: Codegen = "inductor"
    """Code generation after partitioning: ``"inductor"`` (default) or ``"eager"``."""

    report: bool = True
    """Build a saved-tensor report after each partition (``graphpass.last_report()``)."""

    fp8: FP8Recipe = None
    """FP8 recipe for linear layers: ``None`` (off), ``"tensorwise"``, ``"blockwise"``, ``"mxfp8"``,
    ``"rowwise"`` (E4M3 everywhere, one fp32 scale per row of each GEMM operand: the recipe of
    ``torch._scaled_mm``'s and ``torch._scaled_grouped_mm``'s rowwise kernels, torchao's
    ``rowwise``)."""

    fp8_pow2_scales: bool | None = None
    """Scales rounded down to powers of two, so scaling and unscaling are exact: with
    ``fp8="rowwise"`` (off by default; torchao's ``round_scales_to_power_of_2``) or
    ``fp8="blockwise"`` (on by default, Transformer Engine's ``Float8BlockScaling``; ``False``
    gives the plain ``fp8_max / amax`` scales of DeepSeek-V3's recipe). ``None``: the recipe's
    default."""

    fp8_format: FP8Format = "hybrid"
    """With ``fp8="tensorwise"``: Transformer Engine's FP8 format. ``"hybrid"`` (TE's
    ``Format.HYBRID``, its default): E4M3 inputs and weights, E5M2 gradients. ``"e4m3"`` (TE's
    ``Format.E4M3``): gradients E4M3 too, each with its own tensorwise scale; then the expert
    GEMMs' dgrad and wgrad run as one ``torch._scaled_grouped_mm`` each, as their forward does
    (the grouped kernel takes E4M3 operands only). The other recipes are E4M3 in every role
    already."""

    kernels: Kernels = "auto"
    """FP8 kernel provider: ``"auto"``, ``"te"``, ``"scaled_mm"`` or ``"reference"``."""

    fp8_exclude: tuple[str, ...] = ("output", "lm_head", "*.gate", "*.router")
    """Module-path patterns (fnmatch) of linears kept in high precision: the output head and MoE
    routers by default, as Megatron and torchtitan do."""

    fuse_quantize: bool = True
    """With ``codegen="inductor"`` and ``fp8="tensorwise"``, ``"rowwise"`` or ``"blockwise"``:
    after the partition, inline each quantize's recipe so Inductor fuses its amax, scale and
    cast with the neighbouring ops, gradients' quantizes included (mxfp8's stay one op, with a
    report note). It reads the bf16-rounded value eager
    reads (bit-identical to the opaque op on the CPU); the contract is each dequantized value
    within one FP8 ulp of the opaque op's (docs/fp8.md#exactness). ``False`` keeps each quantize
    one opaque op, for debugging."""

    order_backward: bool = False
    """With ``codegen="inductor"``: after the partition, each group of reductions Inductor's C++
    code runs as one kernel (a layer's norm weight gradients) moves beside the last buffer they
    read, so the weight-gradient quantizes and GEMMs between them run beside their data
    gradients instead of waiting for the group (a report note says what moved;
    docs/memory.md#order_backward). Nodes move, no op changes: gradients are bit-identical
    either way. Off by default: on CUDA, Inductor's scheduler already runs those GEMMs beside
    their data gradients (the Llama-3-8B FP8 layer's step peak measured 1.34 GiB on an H200
    with and without it), and on the CPU the move measured +4.3% step time on the FP8 tiny
    Llama."""

    fp8_all_gather: bool = True
    """With ``fp8="tensorwise"`` under sequence parallelism: quantize each rank's shard before the
    all-gather of a column-parallel input (and of a row-parallel output gradient in the
    backward), with the amax reduced (max) over the group, and all-gather the FP8 bytes, as
    Transformer Engine does: half the bytes of a bf16 all-gather, the same FP8 bits. ``False``
    all-gathers the high-precision tensor and quantizes it after."""

    fp8_accumulate: FP8Accumulate = "te"
    """How the FP8 GEMMs accumulate: ``"te"`` (fast accumulation for the forward GEMM, split,
    i.e. precise, accumulation for dgrad and wgrad, as Transformer Engine's recipes and torchao's
    float8 set it), ``"fast"`` or ``"precise"`` for every GEMM. ``torch._scaled_mm``'s
    ``use_fast_accum`` and TE's ``use_split_accumulator``; the reference provider accumulates in
    fp32 whatever the mode (it models the precise one)."""

    fp8_cost_model: FP8CostModel = "h100"
    """``"h100"``: a linear whose FP8 GEMMs plus quantizes an H100's roofline estimates slower than
    its bf16 GEMMs (a small N or K, such as grouped-query k/v projections) stays in high
    precision, with a ``not lowered: ...: faster in bf16 (...)`` note (``graphpass/fp8/cost.py``);
    the H100 is the target on every device, a CPU included. ``"off"`` lowers every eligible
    linear."""

    fp8_min_gemm_flops: int = 0
    """Linears whose forward GEMM has fewer FLOPs (2*M*N*K) stay in high precision."""

    save_original: SaveOriginal = "auto"
    """For the quantized copy of a linear's input that wgrad needs (the columnwise X):
    ``"never"`` saves the FP8 copy, quantized in the forward as TE does by default;
    ``"always"`` saves the original and re-quantizes in the backward (TE's
    ``save_original_input``); ``"auto"`` lets the partitioner pick whichever saves fewer bytes
    (the original wins when it is saved anyway or its producer is recomputed). A weight's copy is
    always re-quantized from the resident parameter."""

    save_original_modules: tuple[str, ...] = ()
    """Module-path patterns of linears that always save their original input, whatever
    ``save_original`` says for the others (Megatron's per-module ``save_original_input``)."""

    fp8_weight_once: bool = False
    """Quantize each lowered weight once per step: its fprop and dgrad FP8 copies from one read
    of the weight in the forward, dgrad's copy saved for the backward (1 byte per weight element
    plus its scales, held until the backward reads it: Transformer Engine's default). Off, the
    backward re-quantizes dgrad's copy from the resident parameter: no memory, one more read of
    the weight. A memory decision: gradients are bit-identical either way."""

    fp8_weight_cache: FP8WeightCache = False
    """Quantize each lowered weight once per optimizer step: with gradient accumulation, the
    first micro-batch after the weight changed quantizes both of its FP8 copies and the others
    reuse them (keyed on the parameter's version counter: an optimizer step, ``load_state_dict``
    or an in-place edit invalidates them; writes through ``p.data`` do not, see
    ``graphpass.clear_weight_cache``). The copies are held between steps, 1 byte per element and
    copy (as much as the bf16 weight for a weight with dgrad), listed in the report and counted
    in the step peak. ``True``: every weight that is a parameter; ``"auto"``: the weights the
    memory planner chooses where the predicted peak stays within ``memory_budget``, the most
    quantize work per cached byte first (without a budget, none, with a note). A memory
    decision: gradients are bit-identical either way (docs/memory.md#fp8_weight_cache)."""

    recompute: tuple[RecomputeModule, ...] = ()
    """Output-discarding recompute, in Megatron's words: ``layernorm``, ``act``, ``moe_act``,
    ``core_attn``, ``mlp``, ``moe``, ``shared_experts``, ``mla_up_proj``, or ``full`` layers."""

    recompute_method: RecomputeMethod = "uniform"
    """For ``recompute=("full",)``: ``"uniform"`` checkpoints every chunk of
    ``recompute_num_layers`` layers; ``"block"`` the first ``recompute_num_layers`` layers."""

    recompute_num_layers: int = 1
    """Layers per checkpointed chunk (``uniform``) or checkpointed layers (``block``)."""

    recompute_include: tuple[str, ...] = ("*",)
    """Module-path patterns narrowing where ``recompute`` applies (e.g. ``("layers.[0-3].*",)``)."""

    memory: Memory = None
    """``"auto"``: the planner minimises saved bytes, recomputing any non-GEMM, non-attention op
    within ``recompute_budget``; ``"default"``: torch's min-cut heuristics. ``None`` means
    ``"auto"`` when FP8 is on and ``"default"`` otherwise."""

    recompute_budget: float | None = 0.01
    """Most recompute the planner may add, as a fraction of the step's FLOPs (None: no limit)."""

    memory_budget: int | float | None = None
    """The most the step's predicted peak may be: bytes (an int), or a fraction of the device's
    memory (a float in (0, 1]; an H100's 80 GiB when no CUDA device is present). The planner
    recomputes or offloads saved tensors until it fits, at the least added time by a roofline
    estimate, exactly (gradients unchanged); a ValueError when no plan fits. ``None``: no
    budget (docs/memory.md#memory_budget)."""

    offload: bool = False
    """Offload eligible saved activations to CPU with torch's activation offloading."""

    offload_stream: bool | None = None
    """With ``offload``, on CUDA: copy on a separate stream and prefetch reloads (torch's
    separate-stream mode); ``False``, or on CPU, the copies run synchronously on the default
    stream. ``None`` (unset) means on whenever ``offload`` is."""

    offload_min_bytes: int = 1 << 20
    """Saved tensors smaller than this are never offloaded."""

    offload_hidden_only: bool = False
    """With ``offload``: offload only the saved tensors whose copies an H100's roofline hides
    under compute on torch's separate stream, largest and longest-lived first; the others stay
    on the device, ``offload: no (copy not hidden: ...)`` (docs/memory.md#offload_hidden_only)."""

    offload_exclude: tuple[str, ...] = ()
    """Module-path or op patterns (``"layers.0.*"``, ``"aten.mm"``) never offloaded (opt-out)."""

    fp8_cache: FP8Cache = None
    """Lossy, opt-in: store saved activations in FP8 between forward and backward (after the
    exact passes, of what they still save). ``"act_input"``: inputs of activation functions
    (SwiGLU's gate and up, GELU's input); ``"attn"``: attention's saved inputs and output;
    ``"layer_input"``: residual-stream tensors saved for norms; ``"all"``: every saved floating
    activation. The backward reads the dequantized value; the forward the exact one."""

    fp8_cache_format: FP8CacheFormat = "e4m3_1x128_pow2"
    """The FP8 activation cache's format: ``"e4m3_1x128_pow2"`` (one power-of-two scale per
    1x128 block along the last dimension, stored as an E8M0 byte: DeepSeek-V3's activations),
    ``"e4m3_1x128"`` (the same with fp32 scales), ``"e4m3_tensor"`` or ``"e5m2_tensor"`` (one
    scale per tensor)."""

    fp8_cache_min_bytes: int = 1 << 16
    """Saved activations smaller than this stay in their dtype under ``fp8_cache``."""

    @property
    def memory_policy(self) -> str:
        return self.memory or ("auto" if self.fp8 else "default")

    @property
    def recipe(self) -> recipes.Recipe | None:
        """The FP8 recipe the options name (None: FP8 off): ``fp8`` with its variant of
        ``fp8_format``, ``fp8_pow2_scales`` and ``fp8_accumulate`` (``recipes.from_options``)."""
        return recipes.from_options(self.fp8, self.fp8_format, self.fp8_pow2_scales,
                                    self.fp8_accumulate)

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

    def __post_init__(self) -> None:
        if self.fp8 == "delayed":
            raise ValueError(
                "invalid graphpass option fp8='delayed': DelayedScaling keeps amax history as "
                "state across steps, which torch.compile cannot trace (Transformer Engine refuses "
                "it under compile too); use fp8='tensorwise' (current scaling), 'rowwise', "
                "'blockwise' or 'mxfp8'"
            )
        for name, valid in CHOICES.items():
            _choice(name, getattr(self, name), valid)
        if self.kernels == "te" and self.fp8 == "rowwise":
            raise ValueError(
                "invalid graphpass options kernels='te' with fp8='rowwise': Transformer Engine has "
                "no rowwise (per-row current) scaling recipe; use kernels='scaled_mm' "
                "(torch._scaled_mm / torch._scaled_grouped_mm rowwise), 'auto' or 'reference'"
            )
        runs = {"te": (None, "tensorwise"),
                "scaled_mm": (None, "tensorwise", "rowwise", "blockwise")}
        if self.fp8 not in runs.get(self.kernels, (self.fp8,)):
            raise ValueError(
                f"invalid graphpass options kernels={self.kernels!r} with fp8={self.fp8!r}: that "
                f"provider runs fp8={' or '.join(map(repr, runs[self.kernels][1:]))} only; use "
                f"kernels='reference' (or 'auto') for fp8={self.fp8!r}"
            )
        _type("report", self.report, bool)
        _type("fuse_quantize", self.fuse_quantize, bool)
        _type("order_backward", self.order_backward, bool)
        if self.fp8_pow2_scales is not None:
            _type("fp8_pow2_scales", self.fp8_pow2_scales, bool)
        _type("fp8_all_gather", self.fp8_all_gather, bool)
        _type("fp8_weight_once", self.fp8_weight_once, bool)
        if not (isinstance(self.fp8_weight_cache, bool) or self.fp8_weight_cache == "auto"):
            raise ValueError(f"invalid graphpass option fp8_weight_cache={self.fp8_weight_cache!r}; "
                             "valid values are: False, True, 'auto'")
        for name in ("fp8_exclude", "save_original_modules", "recompute", "recompute_include",
                     "offload_exclude"):
            _patterns(self, name)
        for item in self.recompute:
            _choice("recompute", item, RECOMPUTE_MODULES)
        for name in ("fp8_min_gemm_flops", "recompute_num_layers", "offload_min_bytes",
                     "fp8_cache_min_bytes"):
            _type(name, getattr(self, name), int)
        if self.recompute_num_layers < 1:
            raise ValueError(f"invalid graphpass option recompute_num_layers="
                             f"{self.recompute_num_layers}; expected a positive layer count")
        if self.recompute_budget is not None and not (
                isinstance(self.recompute_budget, (int, float))
                and not isinstance(self.recompute_budget, bool)
                and 0 <= self.recompute_budget < float("inf")):
            raise ValueError(f"invalid graphpass option recompute_budget={self.recompute_budget!r}; "
                             "expected a fraction of step FLOPs such as 0.01, or None for no limit")
        _type("offload", self.offload, bool)
        _type("offload_hidden_only", self.offload_hidden_only, bool)
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or (isinstance(budget, int) and budget <= 0)
                                   or (isinstance(budget, float) and not 0 < budget <= 1)):
            raise ValueError(f"invalid graphpass option memory_budget={budget!r}; expected bytes "
                             "(an int > 0) or a fraction of the device's memory (a float in "
                             "(0, 1], such as 0.9)")
        if self.offload_stream is not None:
            _type("offload_stream", self.offload_stream, bool)
        for name in ("fp8_min_gemm_flops", "offload_min_bytes", "fp8_cache_min_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"invalid graphpass option {name}={getattr(self, name)}; "
                                 "expected a count of 0 or more")
        _combinations(self)

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

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults."""
        return {k: v for k, v in self.as_dict().items()
                if v != Config.__dataclass_fields__[k].default}

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_HINTS = get_type_hints(Config)
# Valid values of the fields that take one of a fixed set; the CLI builds its flags from this.
CHOICES: dict[str, tuple[Any, ...]] = {
    f.name: get_args(_HINTS[f.name]) for f in dataclasses.fields(Config)
    if get_origin(_HINTS[f.name]) is Literal}
# Tuple fields whose items come from a fixed set.
ITEM_CHOICES: dict[str, tuple[str, ...]] = {"recompute": RECOMPUTE_MODULES}


def given(config: Any) -> Config:
    """A ``config=`` argument: a Config, or None for the defaults."""
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise ValueError(f"config={config!r} is not a graphpass.Config; write "
                         "config=graphpass.Config(fp8='tensorwise', ...) (or leave it out)")
    return config


def _choice(name: str, value: Any, valid: tuple[Any, ...]) -> None:
    if value not in valid:
        raise ValueError(
            f"invalid graphpass option {name}={value!r}; valid values are: "
            + ", ".join(map(repr, valid))
        )


def _patterns(config: Config, name: str) -> None:
    """A tuple of strings (a list is accepted and frozen into a tuple)."""
    value = getattr(config, name)
    if isinstance(value, str):
        raise ValueError(f"invalid graphpass option {name}={value!r}; expected a tuple of strings: "
                         f"write {name}=({value!r},)")
    if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"invalid graphpass option {name}={value!r}; expected a tuple of strings")
    object.__setattr__(config, name, tuple(value))


def _combinations(config: Config) -> None:
    """Options that do nothing without another one: a ValueError naming the one to set (or the
    one to drop), rather than a setting silently ignored. ``fp8_exclude`` and ``save_original``
    are exempt: sweeps over ``fp8`` (None included) set them for every point, as the CLI's
    policies and the project's own tests do."""
    defaults = Config.__dataclass_fields__
    needs = [
        # (option set to a non-default value, is it in effect, what it needs)
        ("offload_stream", config.offload_stream is None or config.offload, "offload=True"),
        ("offload_min_bytes", config.offload, "offload=True"),
        ("offload_hidden_only", config.offload, "offload=True"),
        ("offload_exclude", config.offload, "offload=True"),
        ("save_original_modules", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("fp8_weight_once", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("fp8_weight_cache", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("fp8_min_gemm_flops", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("fp8_accumulate", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("fp8_cost_model", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("kernels", config.fp8 is not None, "fp8='tensorwise' (or another recipe)"),
        ("fp8_pow2_scales", recipes.takes_option(config.fp8, "fp8_pow2_scales"),
         "fp8='rowwise' or fp8='blockwise' (mxfp8's E8M0 scales are powers of two by "
         "construction, tensorwise's are not rounded)"),
        ("fp8_format", recipes.takes_option(config.fp8, "fp8_format"),
         "fp8='tensorwise' (the other recipes are E4M3 in every role already)"),
        ("recompute_method", "full" in config.recompute, "recompute=('full',)"),
        ("recompute_num_layers", "full" in config.recompute, "recompute=('full',)"),
        ("fp8_cache_format", config.fp8_cache is not None, "fp8_cache='act_input' (or another "
                                                           "level)"),
        ("fp8_cache_min_bytes", config.fp8_cache is not None, "fp8_cache='act_input' (or another "
                                                              "level)"),
        ("recompute_include", bool(config.recompute), "a recompute selection such as "
                                                       "recompute=('core_attn',)"),
        ("order_backward", config.codegen == "inductor", "codegen='inductor' (graphs run as "
                                                         "they are under codegen='eager')"),
    ]
    for name, in_effect, needed in needs:
        value = getattr(config, name)
        if not in_effect and value != defaults[name].default:
            raise ValueError(f"invalid graphpass options: {name}={value!r} has no effect without "
                             f"{needed}; set that too, or leave {name} unset")


def _type(name: str, value: Any, typ: type | tuple[type, ...]) -> None:
    if typ is int and isinstance(value, bool):  # True is an int to Python, not a count
        raise ValueError(f"invalid graphpass option {name}={value!r}; expected an int")
    if not isinstance(value, typ):
        raise ValueError(
            f"invalid graphpass option {name}={value!r}; expected "
            + " or ".join("None" if t is type(None) else f"a {t.__name__}"
                          for t in (typ if isinstance(typ, tuple) else (typ,))))


__all__ = ["Config"]
