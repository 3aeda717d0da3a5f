"""``graphpass.estimate``: the peak memory per device of one whole training step, before launch.

    from graphpass.job.estimate import estimate
    from graphpass.job.result import JobEstimate, Part, Phase

    est: JobEstimate = estimate(model, *inputs, optimizer=torch.optim.AdamW, loss_fn=None,
                                config=graphpass.Config(...), micro_batches=1, **input_kwargs)
    est.peak_bytes, est.breakdown[Part.OPTIMIZER_STATE], est.phase, est.fits(80 << 30)

Contract: ``model`` is built on the meta device (or holds real or fake tensors); it is never run
on data. FSDP2 (``fully_shard``) and tensor/sequence parallel (DTensor) models are planned per
rank: build and parallelize them inside ``graphpass.distributed.fake_process_group(world)``
(or any process group) on the meta device and call ``estimate`` there. The step is run once to
warm up (the optimizer's state is made, the graphs compiled) and once under torch's
``MemTracker`` (``FSDPMemTracker`` for an FSDP2 root), both under a ``FakeTensorMode``:
zero_grad, then ``micro_batches`` times forward, loss and backward (gradients accumulate), then
the optimizer's step. Every tensor the step allocates is counted as torch allocates it, but
under ``config`` with ``codegen="inductor"`` the compiled graphs' transients, which graphpass's
model of Inductor's code predicts instead (``job/graphs.py``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import _compat
from ..config import Config, given
from ..decisions import What
from ..plan import _fake_like
from .._compat.mem_tracker import fake_mode_for_meta
from .budget import budgeted, job_budget, outside_graphs
from .graphs import EstimateGraphs
from .result import JobEstimate, Part, Phase, PhasePeak
from .tracker import Key, Sample, StepTracker, fsdp_step_tracker

Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""An optimizer class (``torch.optim.AdamW``) or any callable that builds one from the
parameters (``functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True)``, a lambda)."""

# The optimizers whose state the estimate is checked against real steps (tests/test_estimate.py).
CHECKED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class EstimateError(ValueError):
    """The step cannot be estimated as given; the message says which part and why."""


def estimate(model: nn.Module, *inputs: Any, optimizer: Optimizer | None,
             loss_fn: Callable[..., torch.Tensor] | None = None, config: Config | None = None,
             micro_batches: int = 1, **input_kwargs: Any) -> JobEstimate:
    """The predicted peak memory of one training step of ``model(*inputs, **input_kwargs)`` on
    this rank's device.

    ``optimizer``: an optimizer class or a factory ``params -> Optimizer``, built here on the
    fake parameters; None runs no optimizer step (a note says so). ``loss_fn(output, *inputs)``
    returns the scalar loss; without one, the output's ``.loss`` (a Hugging Face model given
    ``labels=``) or, for a tensor output, ``output.float().mean()`` (a note says which).
    ``config``: compile the model with graphpass's partition under this config (its
    ``codegen`` decides how the compiled graphs' transients are counted); None runs the model as
    given, eagerly. ``micro_batches``: forward and backward passes that accumulate gradients
    before the step, each on the same inputs.
    """
    if not isinstance(model, nn.Module):
        raise EstimateError(f"graphpass.estimate takes an nn.Module, not {type(model).__name__}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise EstimateError(f"micro_batches must be a positive int, not {micro_batches!r}")
    notes: list[str] = []
    model = _uncompiled(model, notes)
    if getattr(getattr(model, "config", None), "use_cache", False) and not input_kwargs.get(
            "use_cache") is False:
        notes.append("counted: the model's config has use_cache=True, so a Hugging Face model "
                     "fills a KV cache in the forward; training keeps none: pass use_cache=False "
                     "(or set it in the config)")
    fsdp = _fsdp_root(model)
    mode = fake_mode_for_meta() if fsdp else _compat.fake_tensor_mode()
    with mode:
        fake_model = _fake_model(model, fsdp, notes)
        fake_inputs = [_fake_like(x) if isinstance(x, torch.Tensor) else x for x in inputs]
        fake_kwargs = {k: _fake_like(x) if isinstance(x, torch.Tensor) else x
                       for k, x in input_kwargs.items()}
        opt = _optimizer(optimizer, fake_model, notes)
    config = given(config) if config is not None else None
    if config is None:
        notes.append("counted: the model runs eagerly as given (no config): pass config= to "
                     "count graphpass's compiled graphs")
    budget = job_budget(config)
    with mode, _compat.unlimited_recompiles():
        if budget is None:
            tracker, graphs = _tracked(fake_model, fsdp, config, fake_inputs, fake_kwargs,
                                       loss_fn, opt, micro_batches, notes)
            return _result(tracker, graphs, notes, micro_batches)
        # The job's budget: the step without one shows what lives outside the compiled graphs
        # while each runs; graphpass then plans every graph within what is left.
        unbudgeted = config.replace(memory_budget=None)
        tracker, graphs = _tracked(fake_model, fsdp, unbudgeted, fake_inputs, fake_kwargs,
                                   loss_fn, opt, micro_batches, [])
        first = _result(tracker, graphs, [], micro_batches)
        outside = outside_graphs(tracker, graphs, first)
        per_graph = budget - outside
        if per_graph <= 0:
            raise EstimateError(
                f"memory_budget={budget:,} B: what lives outside the compiled graphs while they "
                f"run takes {outside:,} B alone (parameters, gradients, optimizer state, FSDP "
                "buffers, the other graphs' saved activations); no plan inside them fits")
        tracker, graphs = _tracked(fake_model, fsdp, config.replace(memory_budget=per_graph),
                                   fake_inputs, fake_kwargs, loss_fn, opt, micro_batches, notes)
        result = _result(tracker, graphs, notes, micro_batches)
    return budgeted(result, budget, outside, per_graph)


def _tracked(fake_model: nn.Module, fsdp: bool, config: Config | None, fake_inputs: list[Any],
             fake_kwargs: dict[str, Any], loss_fn: Callable[..., torch.Tensor] | None,
             opt: torch.optim.Optimizer | None, micro_batches: int, notes: list[str]
             ) -> tuple[Any, EstimateGraphs | None]:
    """Call under the fake mode: compile (under ``config``), warm up, and run the step under
    torch's tracker; the tracker and the compiled graphs."""
    graphs = EstimateGraphs(config) if config is not None else None
    runner: Callable[..., Any] = fake_model
    if graphs is not None:
        runner = (_compiled_blocks(fake_model, graphs, notes) if fsdp
                  else _compiled(fake_model, graphs))
    step = _Step(runner, fake_inputs, fake_kwargs, loss_fn, opt, micro_batches, notes)
    step.run(None)  # warm-up: compiles, makes the optimizer's state and the gradients
    tracker = fsdp_step_tracker(fake_model, opt) if fsdp else StepTracker()
    if fsdp:
        tracker.track_inputs((fake_inputs, fake_kwargs))
    else:
        tracker.track_external(fake_model, *(o for o in [opt] if o is not None),
                               *[x for x in (*fake_inputs, *fake_kwargs.values())
                                 if isinstance(x, torch.Tensor)])
        # The gradients' hooks, which torch's tracker installs as each module's forward
        # starts: a compiled module's children run inside its graph, never as modules.
        tracker._track_module_params_and_buffers(fake_model, install_grad_hooks=True)
    if graphs is not None:
        tracker.graph_source = graphs
        graphs.runs.clear()
    with tracker:
        step.run(tracker)
    return tracker, graphs


def _compiled(model: nn.Module, graphs: EstimateGraphs) -> Callable[..., Any]:
    """``model`` compiled with the estimate's backend. torch warns that a compiled module's
    wrapper runs global module hooks once more; the tracker's hooks count modules, not bytes."""
    compiled = torch.compile(model, backend=graphs, dynamic=False)

    def run(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
            return compiled(*args, **kwargs)

    return run


def _compiled_blocks(model: nn.Module, graphs: EstimateGraphs, notes: list[str]) -> nn.Module:
    """An FSDP2 model with each module ``fully_shard`` wraps below the root compiled in place
    (``Module.compile``, as torchtitan compiles its blocks): FSDP2's hooks run between the
    graphs. The root's own layers (embedding, final norm, head) run eagerly, counted."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [(name, m) for name, m in model.named_modules()
              if isinstance(m, FSDPModule) and m is not model]
    for _, block in blocks:
        block.compile(backend=graphs, dynamic=False)
    notes.append(f"compiled: the {len(blocks)} modules fully_shard wraps below the root, each "
                 "on its own (Module.compile); the root's own layers run eagerly")
    return model


class _Step:
    """One training step, run with a tracker (phases set) or without (the warm-up)."""

    def __init__(self, runner: Callable[..., Any], inputs: list[Any], kwargs: dict[str, Any],
                 loss_fn: Callable[..., torch.Tensor] | None,
                 opt: torch.optim.Optimizer | None, micro_batches: int, notes: list[str]) -> None:
        self.runner, self.inputs, self.kwargs = runner, inputs, kwargs
        self.loss_fn, self.opt, self.micro_batches, self.notes = loss_fn, opt, micro_batches, notes
        self._noted_loss = False

    def run(self, tracker: Any) -> None:
        def phase(p: Phase, k: int = 0) -> None:
            if tracker is not None:
                tracker.phase, tracker.micro_batch = p, k
                tracker.record()

        phase(Phase.ZERO_GRAD)
        _run(Phase.ZERO_GRAD, self._zero_grad)
        for k in range(self.micro_batches):
            if tracker is not None and k:
                tracker.reset_mod_stats()  # torch's trackers refuse a second root forward
            phase(Phase.FORWARD, k)
            output = _run(Phase.FORWARD, lambda: self.runner(*self.inputs, **self.kwargs))
            if tracker is not None:
                tracker.mark_loss(output)
            phase(Phase.LOSS, k)
            loss = _run(Phase.LOSS, lambda: self._loss(output))
            del output
            phase(Phase.BACKWARD, k)
            _run(Phase.BACKWARD, loss.backward)
            del loss
        if self.opt is not None:
            phase(Phase.OPTIMIZER_STEP)
            _run(Phase.OPTIMIZER_STEP, self.opt.step)
        if tracker is not None:
            tracker.record()

    def _zero_grad(self) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)

    def _loss(self, output: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(output, *self.inputs)
            what = "loss_fn"
        elif isinstance(getattr(output, "loss", None), torch.Tensor):
            loss, what = output.loss, "the output's .loss"
        elif isinstance(output, torch.Tensor):
            loss, what = output.float().mean(), "output.float().mean()"
            if not self._noted_loss:
                self.notes.append("loss: output.float().mean() (the model returns a tensor and "
                                  "no loss_fn was given); pass loss_fn= for the step's own loss")
        else:
            raise EstimateError(
                f"the model returns {type(output).__name__} with no tensor .loss: pass "
                "loss_fn=lambda output, *inputs: <scalar loss>")
        self._noted_loss = True
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise EstimateError(f"{what} must give a scalar tensor, not {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}"
                                   if isinstance(loss, torch.Tensor) else ""))
        if not loss.requires_grad:
            raise EstimateError(f"{what} does not require grad: no parameter or input of the "
                                "model requires grad, so there is no backward to estimate")
        return loss


def _run(phase: Phase, fn: Callable[[], Any]) -> Any:
    """``fn()``, an error of running the step on fake tensors named for what it is."""
    try:
        return fn()
    except EstimateError:
        raise
    except Exception as e:
        raise _explained(phase, e) from e


def _explained(phase: Phase, error: BaseException) -> BaseException:
    from .._compat.mem_tracker import reads_data

    inner = error
    while inner.__cause__ is not None or getattr(inner, "inner_exception", None) is not None:
        inner = getattr(inner, "inner_exception", None) or inner.__cause__  # type: ignore[assignment]
    value_error = _compat.backend_value_error(error)
    if value_error is not None:
        return value_error
    if reads_data(inner) or "data-dependent" in str(inner).lower():
        return EstimateError(
            f"the {phase.value} cannot run on fake tensors: it reads a tensor's values "
            f"({type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}): "
            "an .item(), a data-dependent branch or an output shape that depends on the data. "
            "graphpass.estimate runs no data; move that code out of the step, or give it "
            "static values")
    if _is_collective(inner):
        return EstimateError(
            f"the {phase.value} runs a collective graphpass.estimate cannot fake "
            f"({type(inner).__name__}: {str(inner).splitlines()[0]}); build and parallelize the "
            "model inside graphpass.distributed.fake_process_group(world_size)")
    return error


def _is_collective(error: BaseException) -> bool:
    text = str(error)
    return any(w in text for w in ("c10d", "ProcessGroup", "process group", "_c10d_functional"))


def _uncompiled(model: nn.Module, notes: list[str]) -> nn.Module:
    """The module under ``torch.compile``'s wrapper: the estimate compiles it itself."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module):
        notes.append("the model was wrapped by torch.compile: the estimate runs the module "
                     "inside, compiled only under config= (which says how)")
        return inner
    return model


def _fsdp_root(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 root (``fully_shard`` applied to it); a model with FSDP2
    only below the root is refused (torch's FSDPMemTracker tracks a root)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return False
    if isinstance(model, FSDPModule):
        return True
    inner = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if inner:
        raise EstimateError(
            f"fully_shard is applied to {inner[0]} but not to the root: apply fully_shard to the "
            "model as well (torch's FSDPMemTracker tracks an FSDP2 root)")
    return False


def _fake_model(model: nn.Module, fsdp: bool, notes: list[str]) -> nn.Module:
    """Call under a FakeTensorMode: ``model`` on fake tensors. A plain model is copied
    (``plan``'s fake copy); an FSDP2 model, on the meta device, is materialized in place
    (``to_empty``: FSDP2's sharded parameters cannot be copied), its weights fake ever after."""
    tensors = [*model.parameters(), *model.buffers()]
    if not fsdp:
        memo: dict[int, Any] = {id(t): _fake_like(t) for t in tensors}
        return copy.deepcopy(model, memo)
    local = [_compat.dtensor_local(t) if _compat.is_dtensor(t) else t for t in tensors]
    if any(t.device.type != "meta" for t in local):
        raise EstimateError(
            "an FSDP2 model is estimated on the meta device: build it under "
            "torch.device('meta') before fully_shard (its real weights would be replaced)")
    model.to_empty(device=_fsdp_device(model))
    notes.append("the FSDP2 model was materialized in place on fake tensors (to_empty)")
    return model


def _fsdp_device(model: nn.Module) -> torch.device:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            mesh = getattr(state._fsdp_param_group, "mesh_info", None) if state._fsdp_param_group else None
            device = getattr(getattr(mesh, "mesh", None), "device_type", None)
            if device is not None:
                return torch.device("cpu" if device == "meta" else device)
    return torch.device("cpu")


def _optimizer(optimizer: Optimizer | None, model: nn.Module, notes: list[str]
               ) -> torch.optim.Optimizer | None:
    if optimizer is None:
        notes.append("no optimizer: the step has no optimizer state and no optimizer step")
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        raise EstimateError(
            "optimizer= takes an optimizer class or a factory params -> Optimizer (it is built "
            "on the estimate's fake parameters), not an optimizer already built on the model's")
    if not callable(optimizer):
        raise EstimateError(f"optimizer= must be an optimizer class or a factory, not "
                            f"{type(optimizer).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise EstimateError(f"optimizer({len(params)} parameters) gave "
                            f"{type(opt).__name__}, not a torch.optim.Optimizer")
    if type(opt) not in CHECKED_OPTIMIZERS:
        notes.append(f"optimizer {type(opt).__qualname__} is not one graphpass checks "
                     f"({', '.join(c.__name__ for c in CHECKED_OPTIMIZERS)}): its state and "
                     "step are counted as they allocate under fake tensors, unchecked")
    if any(opt.defaults.get(k) for k in ("fused",)):
        notes.append("fused optimizer step: its kernel's own scratch is not counted")
    return opt


def _result(tracker: Any, graphs: EstimateGraphs | None, notes: list[str],
            micro_batches: int) -> JobEstimate:
    """The estimate from the tracker's samples, each compiled graph pass's corrected."""
    device = _compute_device(tracker.samples)
    corrected: dict[Key, Sample] = {}
    for (dev, key), sample in tracker.samples.items():
        if dev != device:
            continue
        if key.graph is not None and graphs is not None:
            delta = graphs.correction(key.graph)
            if delta:
                parts = dict(sample.parts)
                parts[Part.TRANSIENTS] += delta
                sample = Sample(sample.total + delta, parts, sample.module)
        corrected[key] = sample
    if not corrected:
        raise EstimateError("the step allocated nothing the tracker could see")
    peak_key, peak = max(corrected.items(), key=lambda kv: kv[1].total)
    phases: list[PhasePeak] = []
    for phase in Phase:
        found = [(k, s) for k, s in corrected.items() if k.phase is phase]
        if found:
            k, s = max(found, key=lambda kv: kv[1].total)
            phases.append(PhasePeak(phase, s.total, k.micro_batch, s.module))
    report = graphs.report() if graphs is not None else None
    if graphs is not None:
        notes.extend(_graph_notes(graphs))
    world, rank = _rank()
    return JobEstimate(
        peak_bytes=peak.total, breakdown={p: n for p, n in peak.parts.items()},
        phase=peak_key.phase, module=peak.module, micro_batch=peak_key.micro_batch,
        phases=tuple(phases), notes=tuple(notes), world_size=world, rank=rank,
        micro_batches=micro_batches, step_time_s=_step_time(graphs), report=report)


def _graph_notes(graphs: EstimateGraphs) -> list[str]:
    runs, distinct = sum(graphs.runs.values()), len(graphs.corrections)
    what = f"{runs} compiled graph run(s) ({distinct} distinct graph(s))"
    # attention traced as CUDA's kernel (or left to the math path) on the fake tensors
    attention = dict.fromkeys(str(d) for r in graphs.reports for d in r.decisions
                              if d.what in (What.CUDA_ATTENTION, What.MATH_ATTENTION))
    if graphs.config.codegen == "eager":
        return [f"counted: {what} run as-is (codegen='eager'), every tensor they allocate",
                *attention]
    return [f"estimated: the transients of {what} under Inductor's code, from graphpass's "
            "step-peak model (graph/peak.py) in place of the graphs run as-is; their saved "
            "activations are counted", *attention]


def _compute_device(samples: dict[tuple[str, Key], Sample]) -> str:
    """The device with the highest total (a CPU-offloaded tensor's host is another)."""
    best: dict[str, int] = {}
    for (dev, _), s in samples.items():
        best[dev] = max(best.get(dev, 0), s.total)
    return max(best, key=best.__getitem__) if best else "cpu"


def _step_time(graphs: EstimateGraphs | None) -> float | None:
    """The compiled graphs' FLOPs, each graph's times the forwards it ran in the step, at the
    roofline's bf16 peak (``graph/roofline.py``), where graphpass compiled any."""
    if graphs is None or not graphs.reports:
        return None
    from ..graph.roofline import H100

    flops = sum((r.meta.get("step_flops") or 0) * graphs.runs.get(i, 0)
                for i, r in enumerate(graphs.reports))
    return H100.compute(flops, 0) if flops else None


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0
