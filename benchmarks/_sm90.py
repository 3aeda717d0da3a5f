"""graphpass's Triton quantize kernels compiled for Hopper (sm_90) on a machine without a GPU.

A quantize function's launches are recorded instead of run (:func:`launches`), each is compiled
by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the ptxas Triton's wheel carries
(:func:`compile_launch`), specialised as Triton's launcher specialises a launch on a GPU where
asked, and ptxas says what the machine code takes (:func:`resources`: registers, spill stores,
shared memory). From those, how many programs of a kernel an SM holds at once
(:func:`programs_per_sm`) and how many bytes of the input its programs have in flight
(:func:`in_flight`): what a memory-bound loop's bandwidth follows. Used by
``tests/test_triton_compile.py`` and ``quantize_kernels.py --resources``.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

_POINTER = {torch.int16: "*i16", torch.int32: "*i32", torch.uint8: "*u8", torch.float32: "*fp32",
            torch.bfloat16: "*bf16", torch.float16: "*fp16"}

# Hopper's limits an SM: registers, shared memory (1 KiB of it reserved per program), programs,
# warps; registers are allocated per warp in units of 8 a thread
SM90 = dict(registers=65536, shared=228 * 1024, programs=32, warps=64)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the
    launch instead of running it."""

    def __init__(self, fn, recorded: list) -> None:
        self.fn, self.recorded = fn, recorded

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.recorded.append((self.fn, args, kwargs))


def launches(call) -> list[tuple]:
    """The kernel launches ``call()`` makes, as (kernel, args, kwargs), as on a CUDA tensor of
    an sm_90 GPU: the interpreter off, every kernel recorded rather than run, the fp8 cast by
    PTX. ``call`` may take CPU tensors (``torch.empty`` ones: nothing reads them)."""
    from graphpass.fp8 import triton_grouped as tg, triton_quantize as tq

    recorded: list = []
    kernels = [(tq, "_amax_kernel"), (tq, "_cast_kernel"), (tq, "_rows_kernel"),
               (tg, "_amax_kernel"), (tg, "_cast_kernel")]
    with mock.patch.object(tq, "_interpreted", lambda: False), \
            mock.patch.object(tq, "available", lambda x: None), \
            mock.patch.object(tg, "available", lambda x: None), \
            mock.patch.object(tq, "_cast_mode", lambda x, cfg: "ptx"):
        patches = [mock.patch.object(m, name, _Recorder(getattr(m, name), recorded))
                   for m, name in kernels]
        for p in patches:
            p.start()
        try:
            call()
        finally:
            for p in patches:
                p.stop()
    return recorded


def source(fn, args: tuple, kwargs: dict, *, specialise: bool = False) -> tuple[object, dict]:
    """The ``ASTSource`` of one recorded launch and its compile options (num_warps,
    num_stages, enable_fp_fusion). Argument types come from the values passed, as Triton's
    launcher derives them; with ``specialise``, also its specialisations on a GPU: an integer
    equal to 1 becomes a constant, and pointers (to allocations, 16-byte aligned) and integers
    divisible by 16 carry that divisibility, which decides how wide the loads are and whether
    they can be asynchronous copies."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, fn.params)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name], constants[name] = "constexpr", value
        elif specialise and type(value) is int and value == 1:
            signature[name], constants[name] = "constexpr", 1
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} = {value!r} of no Triton type")
        if specialise and signature[name] != "constexpr" and (
                isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constants, attrs or None), options


def compile_launch(fn, args: tuple, kwargs: dict, *, specialise: bool = False,
                   options: dict | None = None):
    """One recorded launch compiled for sm_90 (``options`` over the launch's own)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src, launch_options = source(fn, args, kwargs, specialise=specialise)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={**launch_options, **(options or {})})


def tool(name: str) -> Path:
    """A CUDA tool Triton's wheel carries by name (nvdisasm; for ptxas, :func:`resources` asks
    Triton which one it uses for sm_90)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int  # spill stores a thread
    shared: int  # bytes a program
    warps: int


def resources(kernel) -> Resources:
    """What ptxas gives a compiled kernel (``ptxas -v`` on its PTX, for sm_90a as Triton
    compiles it, with the ptxas Triton picks for sm_90: triton 3.9's PTX needs its newer one)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o",
                              "/dev/null"], capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v said no register count: {out}")
    return Resources(int(registers.group(1)), int(spills.group(1)), kernel.metadata.shared,
                     kernel.metadata.num_warps)


def programs_per_sm(r: Resources) -> int:
    """Programs of the kernel one SM holds at once (registers, shared memory, warps)."""
    per_warp = -(-r.registers // 8) * 8 * 32
    return min(SM90["registers"] // (per_warp * r.warps),
               SM90["shared"] // (r.shared + 1024), SM90["programs"],
               SM90["warps"] // r.warps)


def tile_bytes(kwargs: dict, element_size: int) -> int:
    """Bytes of the input one iteration of a kernel's loop loads: its tile's two block sizes."""
    blocks = [v for k, v in kwargs.items() if k.startswith("BLOCK_")]
    if len(blocks) != 2:
        raise ValueError(f"expected two BLOCK_ sizes in {sorted(kwargs)}")
    return blocks[0] * blocks[1] * element_size


def in_flight(r: Resources, kwargs: dict, element_size: int) -> int:
    """Bytes of the input an SM's programs have in flight: one tile a program in an
    unpipelined loop (``STAGES`` 1), ``STAGES - 1`` tiles in a pipelined one."""
    return programs_per_sm(r) * max(1, kwargs.get("STAGES", 1) - 1) * tile_bytes(
        kwargs, element_size)
