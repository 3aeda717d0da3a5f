"""The step peak of Inductor's CUDA code, on a machine without a GPU.

    PYTHONPATH=. python benchmarks/cuda_peak.py --model llama --size real --fp8 tensorwise
    PYTHONPATH=. python benchmarks/cuda_peak.py --model llama --size real --fp8 tensorwise \
        --order-backward off --live 15
    PYTHONPATH=. python benchmarks/cuda_peak.py --model llama --size real --fp8 bf16 \
        --partitioner torch     # torch's own min-cut, as plain torch.compile partitions
    PYTHONPATH=. python benchmarks/cuda_peak.py --model llama --size real --kernel-bytes 20
    PYTHONPATH=. python benchmarks/cuda_peak.py --model deepseek --size real --fp8 bf16 \
        --model-peak            # graphpass's own prediction on the same graphs, on cuda

Needs a CUDA build of torch (the PyPI wheels of torch 2.11 and 2.15 are; the CPU wheel of 2.13 is
not) and triton; no GPU, driver or CUDA runtime is touched. graphpass.plan partitions the
example's forward and backward (on CPU fake tensors, as plan always does); each graph is then
compiled by Inductor for an sm_90 device (the graphpass backend's own Inductor settings:
the quantize inlining, exact division) into its CUDA wrapper, the Python code that allocates,
frees and reuses every buffer of the step (the backward given the saved tensors AOTAutograd
donates to it, as torch.compile does). That wrapper then runs on fake CUDA tensors with every
Triton kernel a no-op, under torch's MemTracker: the allocations and frees are Inductor's own
schedule for CUDA, not a model of it. The step peak above weights, inputs and gradients is what
``benchmarks/gpu_report.py`` measures as "step peak" with ``torch.cuda.max_memory_allocated``
(the outputs held through the backward, the output gradients counted as inputs); the activations
after the forward are what it measures as "measured activations".
``--live N`` lists the N largest tensors the wrapper holds where the peak is reached.
``--kernel-bytes N`` adds the bytes Inductor's Triton kernels move, by Inductor's own estimate per
kernel (``kernel_num_gb``, which it writes under ``benchmark_kernel``: each buffer a kernel reads
or writes, counted once), summed over the launches of the step, the time that takes at the
H200's 4.8 TB/s, and the N largest kernels: a profile of the elementwise, norm and quantize
kernels without a GPU, where a step's GEMMs and attention (extern calls, listed by count) are
not. On the H200 the FP8 Llama layer's kernels other than GEMMs and attention measured about
4.7 ms, where this estimate gives 2.33 ms at 4.8 TB/s (11.18 GB, with the quantize inputs stored
as they then were): those kernels ran at about half the bandwidth.

What it leaves out: kernels' own workspaces (cuBLAS, cuDNN) and the caching allocator's
rounding (blocks of 512 B, 2 MiB segments); the attention op is the one the CPU trace picks
(``_scaled_dot_product_flash_attention_for_cpu``), whose saved outputs have the CUDA kernels'
shapes (the output and a float32 logsumexp). Against an H200's measured step peaks (torch 2.11,
docs/numbers.md): the GPT-3 and Llama-3-8B layers in bf16 exact (239.93 and 1,009.05 MiB), the
DeepSeek-V3 layer in bf16 and FP8 rowwise within 0.1 MiB; the FP8 tensorwise Llama-3-8B and
GPT-3 layers about 123 and 73 MiB under (not attributed: the workspaces above are candidates).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

import graphpass  # noqa: E402


def available() -> str | None:
    """None where this machine can generate Inductor's CUDA code, else why not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (Inductor's CUDA code needs a CUDA build)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


class _NoKernel:
    """A Triton kernel that does nothing: its buffers' sizes are all the peak needs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def run(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getitem__(self, grid: Any) -> "_NoKernel":
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def precompile(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Allocations:
    """The wrapper's allocations, seen through its ``empty_strided_cuda``: at each one, what
    MemTracker holds and the wrapper frame that asks."""

    def __init__(self) -> None:
        self.tracker: Any = None
        self.peak = (-1, None, [])  # (bytes held, "file:line", the frame's largest tensors)
        self.live = 0

    def empty_strided(self, size, stride, dtype):
        if self.tracker is not None:
            held = _held(self.tracker)
            if held > self.peak[0]:
                frame = sys._getframe(1)
                tensors = []
                if self.live:
                    # sizes only; and the frame's locals dict (a snapshot that CPython keeps on
                    # the frame) emptied, or it would hold every buffer the wrapper frees later
                    local = frame.f_locals
                    tensors = sorted(((v.untyped_storage().nbytes(), k, tuple(v.shape),
                                       str(v.dtype)[6:]) for k, v in local.items()
                                      if isinstance(v, torch.Tensor)), reverse=True)[:self.live]
                    local.clear()
                    del local
                self.peak = (held, f"{frame.f_code.co_filename}:{frame.f_lineno}", tensors)
                del frame
        return torch.empty_strided(size, stride, dtype=dtype, device="cuda")


def _restrided(input_tensor, stride):
    """``prims.inductor_force_stride_order``'s fake value without its ``Tensor.copy_``, which asks
    the CUDA driver for a fake CUDA tensor's device (there is none here); the value is a tensor
    of the requested strides either way."""
    return input_tensor.clone().as_strided(input_tensor.shape, stride)


@contextlib.contextmanager
def _fake_friendly_force_stride() -> Any:
    from torch._inductor import inductor_prims

    force = inductor_prims.eager_force_stride  # the prim's fake implementation calls it
    code = force.__code__
    force.__code__ = _restrided.__code__
    try:
        yield
    finally:
        force.__code__ = code


@contextlib.contextmanager
def _triton_targets_sm90() -> Any:
    """Triton's active driver answers sm_90 as its target: torch compiles a user kernel's Triton
    IR to find which arguments it writes (``wrap_triton`` launches, graphpass's quantize kernels
    under Inductor), and without a driver it would take every argument as written."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    previous = driver._active  # None until a driver was asked for; none can be made here
    driver.set_active(mock.MagicMock(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    try:
        yield
    finally:
        driver._active = previous


def _scaled_mm_into(*args: Any, out: Any = None, **kwargs: Any) -> Any:
    """``extern_kernels._scaled_mm`` on fake tensors: torch has no fake ``_scaled_mm.out``; the
    wrapper allocated ``out`` already, which is all the memory accounting needs."""
    return out if out is not None else torch.ops.aten._scaled_mm.default(*args, **kwargs)


def _sm90_patches(allocations: _Allocations) -> list:
    """What lets Inductor generate and run its CUDA code without a GPU: an sm_90 device's
    properties and Triton target, no CUDA runtime calls, every Triton kernel a no-op,
    fake-friendly forms of the two ops Inductor's code of the inlined FP8 GEMMs calls that have
    none."""
    from torch._inductor.runtime.hints import DeviceProperties
    from torch._inductor.select_algorithm import extern_kernels

    device = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
                              regs_per_multiprocessor=65536,
                              max_threads_per_multi_processor=2048, max_threads_per_block=1024,
                              warp_size=32)
    props = type("Props", (), dict(name="NVIDIA H200 (no GPU: cuda_peak.py)", major=9, minor=0,
                                   multi_processor_count=132, total_memory=140 << 30,
                                   warp_size=32, max_threads_per_multi_processor=2048,
                                   regs_per_multiprocessor=65536, L2_cache_size=60 << 20,
                                   gcnArchName=""))()
    return [
        mock.patch.object(DeviceProperties, "create", classmethod(lambda cls, d: device)),
        mock.patch("torch.cuda._lazy_init", lambda: None),
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.get_device_properties", lambda *a, **k: props),
        mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch.cuda.set_device", lambda d: None),
        mock.patch("torch.cuda._exchange_device", lambda d: 0),
        mock.patch("torch.cuda._maybe_exchange_device", lambda d: 0),
        mock.patch("torch.cuda.synchronize", lambda *a: None),
        mock.patch("torch.cuda.get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        mock.patch("torch.cuda.set_rng_state", lambda *a, **k: None),
        mock.patch("torch.cuda._DeviceGuard", lambda d: contextlib.nullcontext()),
        mock.patch("torch._subclasses.fake_tensor.init_gpu_context", lambda d: None),
        mock.patch("torch._inductor.scheduler.has_triton", lambda *a: True),
        mock.patch("torch.utils._triton.has_triton", lambda *a: True),
        mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "no-gpu"),
        mock.patch("torch.utils._triton.triton_backend", lambda: None),
        mock.patch("torch._inductor.async_compile.AsyncCompile.triton",
                   lambda self, *a, **k: _NoKernel()),
        mock.patch("torch._C._dynamo.guards._empty_strided_cuda", allocations.empty_strided),
        mock.patch("torch._C._dynamo.guards._reinterpret_tensor",
                   lambda t, size, stride, offset=0: t.as_strided(
                       size, stride, t.storage_offset() + offset)),
        mock.patch("torch._C._cuda_getCurrentRawStream", lambda d: 0),
        mock.patch.object(extern_kernels, "_scaled_mm", _scaled_mm_into, create=True),
        _fake_friendly_force_stride(),
        _triton_targets_sm90(),
    ]


def partitioned(model_name: str, size: str, layers: int, options: dict[str, Any],
                partitioner: str = "graphpass") -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs graphpass.plan partitions for the example; with
    ``partitioner="torch"``, those torch's own min-cut (what plain ``torch.compile`` runs) makes
    of the same joint graph instead (``options`` must then leave FP8 off)."""
    backend_module = importlib.import_module("graphpass.backend")
    pipeline = importlib.import_module("graphpass.pipeline")
    graphs: list = []
    real: Callable = backend_module.run

    def torch_min_cut(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: Any, compiler: str, **_: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(
            joint, joint_inputs, compiler=compiler, num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices)
        return pipeline.Partition(fw, bw, None)

    def capturing(*args: Any, **kwargs: Any):
        out = (real if partitioner == "graphpass" else torch_min_cut)(*args, **kwargs)
        graphs.append(out)
        out[0].meta["num_fwd_outputs"] = kwargs["num_fwd_outputs"]
        return out

    example = importlib.import_module(f"graphpass.models.{model_name}")
    model, inputs = example.build(size, layers=layers, device="meta", dtype=torch.bfloat16)
    # partitioned as for a GPU (graphpass.plan traces on the CPU): min_cut's choices for CUDA
    with mock.patch.object(backend_module, "run", capturing), \
            mock.patch("graphpass.min_cut._on_cuda", lambda plan: True):
        report = graphpass.plan(model, *inputs, config=graphpass.Config(**options))
    if len(graphs) != 1:
        raise SystemExit(f"cuda_peak.py: {len(graphs)} graphs (a graph break?); one expected")
    # graphpass.plan's own prediction, on the CPU graphs it traced
    graphs[0][0].meta["plan_peak"] = report.meta.get("step_peak", {}).get("bytes")
    return graphs[0][0], graphs[0][1]


def _on_cuda(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its factory ops' CPU devices made CUDA."""
    def fix(a: Any) -> Any:
        return torch.device("cuda", 0) if isinstance(a, torch.device) and a.type == "cpu" else a

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, fix)
        node.kwargs = fx.node.map_aggregate(node.kwargs, fix)
    gm.recompile()
    return gm


def _held(tracker: Any, which: str = "current") -> int:
    """The bytes MemTracker holds now (``current``) or held at most (``peak``)."""
    return sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot(which).values())


def _donated(fw: fx.GraphModule, bw: fx.GraphModule, saved_count: int) -> list[int]:
    """The backward's donated inputs, as AOTAutograd computes them for torch.compile (with
    ``torch._functorch.config.donated_buffer``, on by default): the saved tensors that alias no
    forward input, user output or gradient, by torch's own check. Inductor may write a kernel's
    result into one of them where it dies (on the H200, the SwiGLU backward's second output
    went into a saved (8192, 14336) tensor: without the donation this run allocated a fifth
    such tensor the GPU's step did not). None where a saved value is not a tensor (a SymInt:
    AOTAutograd orders those apart)."""
    from torch._functorch._aot_autograd.graph_compile import collect_fw_donated_buffer_idxs

    if not torch._functorch.config.donated_buffer:
        return []

    def vals(nodes) -> list:
        return [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]

    fw_outs = vals(fw.graph.find_nodes(op="output")[0].args[0])
    user, saved = fw_outs[:len(fw_outs) - saved_count], fw_outs[len(fw_outs) - saved_count:]
    if not all(isinstance(v, torch.Tensor) for v in saved):
        return []
    return collect_fw_donated_buffer_idxs(
        vals(fw.graph.find_nodes(op="placeholder")), user,
        vals(bw.graph.find_nodes(op="output")[0].args[0]), saved)


def _cuda_fakes(gm: fx.GraphModule, mode: Any) -> list:
    """Fake tensors on ``cuda`` in ``mode`` like ``gm``'s placeholders (other inputs as they are),
    the inputs a GPU compiles the graph for."""
    vals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    with mode:
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda")
                if isinstance(v, torch.Tensor) else v for v in vals]


HBM_BYTES_PER_S = 4.8e12  # the H200's HBM3e


def kernel_bytes(source: str) -> list[tuple[str, float, int]]:
    """(kernel, GB per launch, launches) for each Triton kernel a generated wrapper launches,
    from Inductor's ``kernel_num_gb`` (present where ``benchmark_kernel`` was set)."""
    per_launch = dict(re.findall(r"'kernel_name': '(\w+)'.*?'kernel_num_gb': ([0-9.e-]+)",
                                 source))
    launches = Counter(re.findall(r"\b(triton_\w+)\.run\(", _step_code(source)))
    return [(name, float(per_launch.get(name, "nan")), n) for name, n in launches.items()]


def _step_code(source: str) -> str:
    """The part of a generated wrapper that runs the step (its ``Runner`` class, or its ``call``
    function in versions without one): each kernel's source embeds a benchmark harness of its
    own, and the module ends with one, which launch kernels too."""
    start = source.rfind("\nclass Runner")
    if start < 0:
        start = source.rfind("\ndef call(")
    end = source.find("\ndef get_args(", start)
    return source[start:end if end > 0 else len(source)]


def extern_calls(source: str) -> dict[str, int]:
    """How often a generated wrapper calls each extern op (GEMMs, attention, custom ops)."""
    return dict(Counter(re.findall(
        r"(extern_kernels\.\w+|torch\.ops\.\w+\.\w+)(?:\.default)?\(", _step_code(source))))


def model_peak(fw: fx.GraphModule, bw: fx.GraphModule, options: dict[str, Any]) -> Any:
    """graphpass's step-peak model (``graph/peak.step_peak``) on ``fw`` and ``bw`` with their
    tensors on ``cuda``: fake tensors propagated afresh under the sm_90 patches, as the graphs a
    GPU compiles (a quantize then computes its input in its own loops; the kernels run in the
    order of Inductor's ``reorder_for_peak_memory``), with the quantizes' code of ``options``
    (``fp8.inductor.quantize_code``). What the backend reports on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from graphpass.fp8.inductor import quantize_code
    from graphpass.graph.peak import step_peak

    num_fwd_outputs = fw.meta["num_fwd_outputs"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as stack:
        for patch in _sm90_patches(_Allocations()):
            stack.enter_context(patch)
        for gm in (fw, bw):
            FakeTensorProp(_on_cuda(gm), mode).propagate(*_cuda_fakes(gm, mode))
        with quantize_code(graphpass.Config(**options)):
            return step_peak(fw, bw, num_fwd_outputs=num_fwd_outputs, parameter_names=set())


def _storage_bytes(tensors) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            total += t.untyped_storage().nbytes()
    return total


def cuda_step_peak(model_name: str, size: str, options: dict[str, Any], layers: int = 1,
                   live: int = 0, partitioner: str = "graphpass",
                   predict: bool = False) -> dict[str, Any]:
    """The step's peak as Inductor's CUDA code allocates it: ``total`` (everything), ``above``
    (less weights, inputs and gradients), ``where`` (the wrapper line of the peak) and, with
    ``live``, the largest tensors the wrapper holds there; ``left``: what is held after the
    backward beyond inputs and gradients, which is the ``outputs`` alone when the backward freed
    every saved tensor."""
    why = available()
    if why is not None:
        raise SystemExit(f"cuda_peak.py: {why}")
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    fw, bw = partitioned(model_name, size, layers, options, partitioner)
    predicted = model_peak(copy.deepcopy(fw), copy.deepcopy(bw), options) if predict else None
    allocations = _Allocations()
    allocations.live = live
    mode = FakeTensorMode()

    tangent_count = sum(n.name.startswith("tangents")
                        for n in bw.graph.find_nodes(op="placeholder"))
    with contextlib.ExitStack() as stack:
        for patch in _sm90_patches(allocations):
            stack.enter_context(patch)
        inductor_config = importlib.import_module("torch._inductor.config")
        stack.enter_context(inductor_config.patch(fx_graph_cache=False, compile_threads=1,
                                                  benchmark_kernel=True))
        fw_in = _cuda_fakes(fw, mode)
        inputs = _storage_bytes(fw_in)
        patches = {k: v for k, v in graphpass.backend(**options)._inductor_patches(fw_in).items()
                   if k != "custom_partitioner_fn"}
        with inductor_config.patch(patches):
            forward = compile_fx_inner(_on_cuda(fw), fw_in)
            bw_in = _cuda_fakes(bw, mode)
            saved_count = len(bw_in) - tangent_count
            # the saved tensors AOTAutograd donates to the backward, which Inductor may write in
            # place: torch.compile hands them over through its tracing context
            with mock.patch("torch._inductor.graph.get_donated_idxs",
                            lambda: _donated(fw, bw, saved_count)):
                backward = compile_fx_inner(_on_cuda(bw), bw_in, is_backward=True)
        with mode:
            tracker = MemTracker()
            tracker.track_external(*[x for x in fw_in if isinstance(x, torch.Tensor)])
            with tracker:
                allocations.tracker = tracker
                outs = forward(list(fw_in))
                # the outputs live on through the backward (``out.backward(grad)``), as in the GPU
                # measurement; the output gradients were allocated before it (not tracked)
                user, saved = outs[:len(outs) - saved_count], outs[len(outs) - saved_count:]
                # what the forward created and the backward keeps: the saved tensors (a saved
                # model input excepted: it existed before the step, as in the GPU measurement)
                activations = _held(tracker) - inputs - _storage_bytes(
                    [t for t in user
                     if _storage_bytes([t]) and not any(
                         t.untyped_storage()._cdata == s.untyped_storage()._cdata
                         for s in saved if isinstance(s, torch.Tensor))])
                # the backward frees each saved tensor after its last use (it clears the list it
                # is given), so nothing here may hold them: only the list handed to it
                bw_args = list(saved) + bw_in[saved_count:]
                del outs, saved
                grads = backward(bw_args)
                # what the step leaves beyond inputs and gradients: the outputs alone
                left = _held(tracker) - _storage_bytes(list(fw_in) + list(grads))
                outputs = _storage_bytes(user)
                del user
                allocations.tracker = None
            total = _held(tracker, "peak")
    held, where, largest = allocations.peak
    base = inputs + _storage_bytes(grads)
    return {"total": total, "above": total - base, "base": base, "where": where,
            "largest": largest, "activations": activations,
            "inputs": inputs, "left": left, "outputs": outputs,
            "sources": {"forward": forward.source_code, "backward": backward.source_code},
            "predicted": predicted, "plan_peak": fw.meta.get("plan_peak")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=("llama", "gpt", "deepseek"))
    p.add_argument("--size", default="real")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--fp8", default="tensorwise", help="a recipe, or bf16")
    p.add_argument("--kernels", default="scaled_mm")
    p.add_argument("--order-backward", choices=("on", "off"), default="off",
                   help="graphpass's order_backward option (off by default, as in graphpass)")
    p.add_argument("--memory", default=None,
                   help="graphpass's memory option; 'default' is torch's own partitioner, what "
                        "plain torch.compile saves")
    p.add_argument("--live", type=int, default=0, help="list the N largest tensors at the peak")
    p.add_argument("--model-peak", action="store_true",
                   help="also graphpass's step-peak model on the same graphs on cuda (what the "
                        "backend reports on a GPU)")
    p.add_argument("--kernel-bytes", type=int, default=0, metavar="N",
                   help="the bytes Inductor's kernels move, and the N largest kernels")
    p.add_argument("--partitioner", choices=("graphpass", "torch"), default="graphpass",
                   help="'torch': torch's own min-cut of the same joint graph, as plain "
                        "torch.compile partitions it (bf16 only)")
    args = p.parse_args(argv)
    if args.partitioner == "torch" and args.fp8 != "bf16":
        p.error("--partitioner torch partitions bf16 graphs only (--fp8 bf16)")
    options: dict[str, Any] = {"order_backward": args.order_backward == "on"}
    if args.memory:
        options["memory"] = args.memory
    if args.fp8 != "bf16":
        options.update(fp8=args.fp8, kernels=args.kernels)
    got = cuda_step_peak(args.model, args.size, options, args.layers, args.live,
                         args.partitioner, predict=args.model_peak)
    print(f"{args.model} {args.size}, {args.layers} layer(s), {args.fp8}, {args.partitioner}'s "
          f"partition, order_backward "
          f"{args.order_backward}, torch {torch.__version__}: step peak {got['total']:,} B, "
          f"{got['above'] / 2**20:.2f} MiB above weights, inputs and gradients "
          f"({got['base']:,} B); activations after the forward {got['activations']:,} B")
    if got["predicted"] is not None:
        peak = got["predicted"]
        print(f"graphpass.plan's step peak (its CPU graphs): {got['plan_peak']:,} B; "
              f"graphpass's step-peak model on these graphs on cuda: {peak.bytes:,} B "
              f"({peak.bytes / got['total']:.3f} of the CUDA code's), in the {peak.phase} at "
              f"{peak.node}")
    if args.live:
        print(f"at {got['where']}:")
        for nbytes, name, shape, dtype in got["largest"]:
            print(f"  {nbytes / 2**20:9.2f} MiB  {name}  {shape} {dtype}")
    if args.kernel_bytes:
        _print_kernels(got["sources"], args.kernel_bytes)
    return 0


def _print_kernels(sources: dict[str, str], top: int) -> None:
    rows = [(gb * n, gb, n, name, graph) for graph, code in sources.items()
            for name, gb, n in kernel_bytes(code)]
    total = sum(r[0] for r in rows)
    print(f"Inductor's Triton kernels: {sum(r[2] for r in rows)} launches, {total:.3f} GB by "
          f"Inductor's estimate, {total * 1e9 / HBM_BYTES_PER_S * 1e3:.2f} ms at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    for graph, code in sources.items():
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(extern_calls(code).items()))
        print(f"  {graph} extern calls: {calls or 'none'}")
    print(f"{'GB':>8} {'us':>7} {'launches':>8}  graph     kernel")
    for moved, gb, n, name, graph in sorted(rows, reverse=True)[:top]:
        print(f"{moved:8.3f} {moved * 1e9 / HBM_BYTES_PER_S * 1e6:7.1f} {n:8d}  {graph:9} "
              f"{name[:90]}")


if __name__ == "__main__":
    sys.exit(main())
