"""The model of a training job for ``graphpass fit``, built with no weights and no network.

A Hugging Face causal LM from its config (a ``config.json`` file, a model type with overrides, or
a preset shipped under ``graphpass/job/configs/``) is built on the meta device with transformers'
``AutoModelForCausalLM.from_config``; nothing is downloaded (``HF_HUB_OFFLINE`` is set while it
builds). Then, on the default process group (``graphpass.distributed.fake_process_group`` for a
fit), in torchtitan's order: tensor parallelism of the decoder layers (``parallelize_module``
with a Megatron-style plan: the projections that read the residual stream column-parallel, those
that write it row-parallel), then FSDP2 (``fully_shard`` per decoder layer and at the root, on
the ``fsdp`` dimension of a ``(fsdp, tp)`` device mesh). ``graphpass.estimate`` compiles the
model itself, under the config it is given.

Errors a user can fix (an unknown model type, a config transformers rejects, a tensor-parallel
degree that does not divide the heads, an override that is not a number) are ``JobError``, one
line each.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

CONFIGS = Path(__file__).parent / "configs"


class JobError(ValueError):
    """A job that cannot be built as given: the message is one line saying what to change."""


class MixedPrecision(enum.Enum):
    """FSDP2's ``MixedPrecisionPolicy``: none (parameters in their own dtype), or fp32 parameters
    computed in bf16 with fp32 gradient reductions."""

    NONE = "none"
    BF16 = "bf16"


@dataclass(frozen=True)
class Parallel:
    """The job's ranks: ``world_size = replicate * fsdp * tp`` (``replicate > 1`` is HSDP)."""

    world_size: int = 1
    fsdp: int = 1
    tp: int = 1
    reshard_after_forward: bool = True
    mp: MixedPrecision = MixedPrecision.NONE

    def __post_init__(self) -> None:
        for name in ("world_size", "fsdp", "tp"):
            if getattr(self, name) < 1:
                raise JobError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.world_size % (self.fsdp * self.tp):
            raise JobError(f"world size {self.world_size} is not a multiple of fsdp x tp = "
                           f"{self.fsdp} x {self.tp}")
        if self.mp is MixedPrecision.BF16 and self.fsdp * self.replicate == 1:
            raise JobError("--mp bf16 is FSDP2's MixedPrecisionPolicy: it needs --fsdp 2 or more "
                           "(or HSDP); without FSDP, give the parameters' dtype with --dtype")

    @property
    def replicate(self) -> int:
        return self.world_size // (self.fsdp * self.tp)

    @property
    def sharded(self) -> bool:
        return self.fsdp * self.replicate > 1


@dataclass
class Job:
    """A built job: call ``model(*inputs, **input_kwargs)`` for a forward; ``blocks`` are its
    decoder layers; ``notes`` say what the build did not do as asked."""

    model: nn.Module
    inputs: tuple[Any, ...]
    input_kwargs: dict[str, Any]
    blocks: list[nn.Module]
    name: str
    notes: list[str] = field(default_factory=list)


# -- configs --------------------------------------------------------------------------------------

def presets() -> dict[str, Path]:
    """The shipped configs by name (``llama-3-8b``, ``mixtral-8x7b``, ...)."""
    return {p.stem: p for p in sorted(CONFIGS.glob("*.json"))}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise JobError("graphpass fit builds transformers models: pip install 'transformers>=5'") from None
    return transformers


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub access while transformers builds: a config that names remote code fails here."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_override(text: str) -> tuple[str, Any]:
    """``num_hidden_layers=4`` -> ``("num_hidden_layers", 4)``: the value as JSON (numbers,
    ``true``, ``null``, lists), else the text itself."""
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise JobError(f"--set {text!r}: expected KEY=VALUE, such as num_hidden_layers=4")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def load_config(*, config_file: str | os.PathLike | None = None, model_type: str | None = None,
                preset: str | None = None, overrides: Sequence[tuple[str, Any]] = ()) -> Any:
    """A transformers ``PretrainedConfig`` from exactly one of a ``config.json`` path, a model
    type (transformers' defaults) or a preset name, with ``overrides`` applied. An override of a
    field whose default is a number must be a number."""
    if sum(x is not None for x in (config_file, model_type, preset)) != 1:
        raise JobError("give one of --config FILE, --model-type TYPE or --preset NAME")
    transformers = _transformers()
    if preset is not None:
        known = presets()
        if preset not in known:
            raise JobError(f"unknown preset {preset!r}; presets: {', '.join(known)}")
        config_file = known[preset]
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            values = json.loads(Path(config_file).read_text(encoding="utf-8"))
        except OSError as e:
            raise JobError(f"cannot read {str(config_file)!r} ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise JobError(f"{str(config_file)!r} is not JSON ({e})") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise JobError(f"{str(config_file)!r} has no \"model_type\": pass a transformers "
                           "config.json (it names its model type)")
        model_type = values.pop("model_type")
    assert model_type is not None
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        near = sorted(t for t in mapping.keys() if t.split("_")[0] == model_type.split("_")[0])
        raise JobError(f"unknown model type {model_type!r} for transformers "
                       f"{transformers.__version__}" + (f"; did you mean {', '.join(near)}?" if near else ""))
    defaults = mapping[model_type]()
    for key, value in overrides:
        default = getattr(defaults, key, None)
        number = isinstance(default, (int, float)) and not isinstance(default, bool)
        if number and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise JobError(f"--set {key}={value}: {key} is a number (the default is {default})")
        values[key] = value
    values.pop("quantization_config", None)  # a checkpoint's weight format; training builds bf16
    values.pop("auto_map", None)  # remote code: never fetched
    with _offline():
        try:
            return transformers.AutoConfig.for_model(model_type, **values)
        except Exception as e:  # transformers' validators raise their own classes
            raise JobError(f"transformers rejects the {model_type} config: {_line(e)}") from None


def _line(e: BaseException) -> str:
    """An exception's message on one line (transformers' validators write several)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def with_layers(config: Any, layers: int) -> Any:
    """A copy of ``config`` with its first ``layers`` decoder layers (per-layer lists cut)."""
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(config, name, None)
        if isinstance(value, list) and name == "layer_types":
            setattr(config, name, value[:layers])
    return config


def describe(config: Any) -> str:
    """One line: the model type, its size and layer count."""
    return (f"{config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocabulary {config.vocab_size}")


# -- building ------------------------------------------------------------------------------------

class Split(enum.Enum):
    """How a linear's weight splits across the tensor-parallel ranks."""

    OUTPUT = enum.auto()  # by output features: torch's ColwiseParallel
    INPUT = enum.auto()  # by input features, an all-reduce after: torch's RowwiseParallel


# Megatron-style tensor parallelism of decoder layers, per model type: the linears that read the
# residual stream split by output features (ColwiseParallel), the ones that write it split by
# input features (RowwiseParallel, an all-reduce after). Anything not listed stays whole on
# every rank. Routed experts (3-D weights of transformers' fused experts) have no plan here.
_OUT, _IN = Split.OUTPUT, Split.INPUT
_ATTENTION = {"self_attn.q_proj": _OUT, "self_attn.k_proj": _OUT, "self_attn.v_proj": _OUT,
              "self_attn.o_proj": _IN}
_MLP = {"mlp.gate_proj": _OUT, "mlp.up_proj": _OUT, "mlp.down_proj": _IN}
_MLA = {"self_attn.q_proj": _OUT, "self_attn.q_b_proj": _OUT, "self_attn.kv_b_proj": _OUT,
        "self_attn.o_proj": _IN}
_SHARED = {f"mlp.{shared}.{name}": split for shared in ("shared_expert", "shared_experts")
           for name, split in (("gate_proj", _OUT), ("up_proj", _OUT), ("down_proj", _IN))}
TP_PLANS: dict[str, dict[str, Split]] = {
    "llama": {**_ATTENTION, **_MLP},
    "mistral": {**_ATTENTION, **_MLP},
    "qwen2": {**_ATTENTION, **_MLP},
    "qwen3": {**_ATTENTION, **_MLP},
    "mixtral": dict(_ATTENTION),
    "qwen3_moe": {**_ATTENTION, **_MLP, **_SHARED},
    "deepseek_v3": {**_MLA, **_MLP, **_SHARED},
}


def build_hf(config: Any, *, seq: int, micro_batch: int, parallel: Parallel,
             dtype: torch.dtype | None = None, shard: bool = True) -> Job:
    """``config``'s causal LM on the meta device, parallelized, with inputs of
    ``micro_batch`` sequences of ``seq`` tokens (``input_ids`` and ``labels``: the model computes
    its own loss). Call on the default process group when ``parallel`` has more than one rank.
    ``dtype``: the parameters' (default bf16; fp32 under ``--mp bf16``). ``shard=False``
    leaves out FSDP2 (tensor parallelism is applied)."""
    transformers = _transformers()
    if seq < 1 or micro_batch < 1:
        raise JobError(f"sequence length and micro-batch size must be at least 1, got {seq} and "
                       f"{micro_batch}")
    if dtype is None:
        dtype = torch.float32 if parallel.mp is MixedPrecision.BF16 else torch.bfloat16
    config.use_cache = False  # training: no key/value cache
    notes = []
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq > limit:
        notes.append(f"sequence {seq} is longer than the config's max_position_embeddings ({limit})")
    with _offline(), torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except Exception as e:  # transformers raises its own classes
            raise JobError(f"transformers cannot build a causal LM from the {config.model_type} "
                           f"config: {_line(e)}") from None
    blocks = decoder_layers(model)
    mesh = _mesh(parallel) if parallel.world_size > 1 else None
    if parallel.tp > 1:
        notes += _tensor_parallel(blocks, config, parallel, mesh)
    if parallel.sharded and shard:
        _fully_shard(model, blocks, parallel, mesh)
    ids = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    return Job(model, (ids,), {"labels": ids}, blocks, describe(config), notes)


def build_module(model: nn.Module, inputs: Sequence[Any], *, parallel: Parallel,
                 name: str = "model") -> Job:
    """A factory's model (already tensor-parallel where it takes ``tp=``), sharded as
    :func:`build_hf` does, its decoder layers the first ``nn.ModuleList`` it holds. Sharded, a
    model with weights moves to the meta device first (FSDP2 shards it there; no value is read)."""
    blocks = decoder_layers(model) if parallel.sharded else []
    if parallel.sharded:
        model = model.to("meta")
        inputs = [t.detach().to("meta").requires_grad_(t.requires_grad)
                  if isinstance(t, torch.Tensor) else t for t in inputs]
        _fully_shard(model, blocks, parallel, _mesh(parallel))
    return Job(model, tuple(inputs), {}, blocks, name, [])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the first ``nn.ModuleList`` of ``model`` (transformers'
    ``model.layers``)."""
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return list(module)
    raise JobError(f"{type(model).__name__} has no nn.ModuleList of layers to shard per layer; "
                   "drop --fsdp, or build it with its layers in an nn.ModuleList")


def _tensor_parallel(blocks: list[nn.Module], config: Any, parallel: Parallel,
                     mesh: Any) -> list[str]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = TP_PLANS.get(config.model_type)
    if plan is None:
        raise JobError(f"no tensor-parallel plan for model type {config.model_type!r} (plans: "
                       f"{', '.join(TP_PLANS)}); drop --tp or use --fsdp")
    tp = parallel.tp
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise JobError(f"tensor parallel degree {tp} must divide the attention heads ({heads}) and "
                       f"the key/value heads ({kv_heads})")
    mesh = mesh["tp"]
    styles = {Split.OUTPUT: ColwiseParallel, Split.INPUT: RowwiseParallel}
    left: set[str] = set()
    for block in blocks:
        names = dict(block.named_modules())
        here = {path: styles[style]() for path, style in plan.items()
                if isinstance(names.get(path), nn.Linear)}
        parallelize_module(block, mesh, here)
        left |= {path for path, m in block.named_parameters()
                 if m.dim() >= 2 and path.rpartition(".")[0] not in here}
    notes = ["tensor parallelism shards the decoder layers only: the embedding and the output "
             "layer are whole on every tensor-parallel rank"]
    if left:
        notes.append(f"not tensor-parallel, whole on every tensor-parallel rank: {', '.join(sorted(left))} "
                     f"(graphpass fit has no plan for them in {config.model_type})")
    return notes


def _mesh(parallel: Parallel) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if parallel.replicate > 1:
        return init_device_mesh("cpu", (parallel.replicate, parallel.fsdp, parallel.tp),
                                mesh_dim_names=("replicate", "fsdp", "tp"))
    return init_device_mesh("cpu", (parallel.fsdp, parallel.tp), mesh_dim_names=("fsdp", "tp"))


def _fully_shard(model: nn.Module, blocks: list[nn.Module], parallel: Parallel, mesh: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp = mesh["replicate", "fsdp"] if parallel.replicate > 1 else mesh["fsdp"]
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if parallel.mp is MixedPrecision.BF16 else MixedPrecisionPolicy())
    for block in blocks:
        # FSDP2 gathers one dtype per group: modules kept in another dtype (DeepSeek-V3's fp32
        # router) are groups of their own, as transformers keeps them
        for module in _other_dtype_modules(block):
            fully_shard(module, mesh=dp, reshard_after_forward=parallel.reshard_after_forward,
                        mp_policy=mp)
        fully_shard(block, mesh=dp, reshard_after_forward=parallel.reshard_after_forward, mp_policy=mp)
    # the root's parameters (embedding, final norm, output) are used last: not resharded (torchtitan)
    fully_shard(model, mesh=dp, reshard_after_forward=False, mp_policy=mp)


def _other_dtype_modules(block: nn.Module) -> list[nn.Module]:
    """The submodules whose own parameters are in a dtype other than most of ``block``'s."""
    sizes: dict[torch.dtype, int] = {}
    for p in block.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=sizes.__getitem__)
    return [m for m in block.modules()
            if (own := list(m.parameters(recurse=False))) and own[0].dtype != main
            and all(p.dtype == own[0].dtype for p in own)]


@dataclass
class LayerKinds:
    """The distinct decoder layers of a transformers model (tensor-parallel as the job, not
    sharded by FSDP2, parameters in bf16: what one layer computes in), each with its count."""

    model: nn.Module
    kinds: list[tuple[int, nn.Module]]
    hidden_size: int

    def with_inputs(self, micro_batch: int, seq: int
                    ) -> list[tuple[int, nn.Module, tuple[Any, ...], dict[str, Any]]]:
        """Each kind with a layer's inputs for ``micro_batch`` sequences of ``seq`` tokens: the
        hidden states (requiring grad), positions and the rotary tables; no attention mask
        (causal)."""
        x = torch.empty(micro_batch, seq, self.hidden_size, dtype=torch.bfloat16, device="meta",
                        requires_grad=True)
        positions = torch.arange(seq, device="meta").unsqueeze(0).expand(micro_batch, -1)
        rotary = getattr(self.model.get_decoder(), "rotary_emb", None)
        kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": positions}
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(x, positions)
        return [(n, block, (x,), kwargs) for n, block in self.kinds]


def layer_kinds(config: Any, *, parallel: Parallel) -> LayerKinds:
    """Group ``config``'s decoder layers by their parameters' names and shapes (DeepSeek-V3: its
    dense first layers and its MoE layers). Call on the default process group under TP."""
    job = build_hf(config, seq=1, micro_batch=1, parallel=parallel, dtype=torch.bfloat16,
                   shard=False)
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for block in job.blocks:
        key = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
        groups.setdefault(key, [0, block])[0] += 1
    return LayerKinds(job.model, [(n, b) for n, b in groups.values()], config.hidden_size)
