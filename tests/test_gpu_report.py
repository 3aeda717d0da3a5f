"""benchmarks/gpu_report.py's CPU dry run: the script the GPU machine runs cannot rot between
loans. Same code path as on the GPU (tiny sizes, reference kernels, aot_eager for Inductor)."""

import re

import pytest
import torch
from _benchmarks import load


def _load():
    return load("gpu_report")


# the benchmark's plumbing on the CPU (about two minutes); the passes it runs are tested on every
# torch version by their own tests
@pytest.mark.one_version
def test_dry_run_writes_every_section(tmp_path):
    gpu_report = _load()
    out = tmp_path / "report.md"
    gpu_report.main(["--dry-run", "--models", "llama", "--steps", "1", "--out", str(out)])
    text = out.read_text()

    for section in gpu_report.SECTIONS:
        assert section in text, section
    # CPU numbers are labelled as such in the header and in every measured section.
    assert text.count("NOT GPU numbers") >= 3
    assert "## pytest -m gpu\n\n- exit 0:" in text  # the gpu tests ran (and skipped) cleanly
    assert "deselected" in text

    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([^|]+?) \|.*$", text, re.M)}
    for label, _ in gpu_report.step_configs(gpu_report.mode_for(True, 1)):
        assert label in rows, label
    # Every graphpass config and the baseline ran a timed step and was planned: a number in the
    # median and predicted columns, no failure note.
    for label in ("bf16, torch.compile default (aot_eager (dry run))", "graphpass bf16",
                  "graphpass FP8 tensorwise/reference, default",
                  "graphpass FP8 tensorwise/reference, opaque quantize",
                  "graphpass FP8 tensorwise/reference, precise accumulation",
                  "graphpass FP8 blockwise (kernels=auto)", "without offload", "offload + stream",
                  "offload + stream, hidden copies only"):
        cells = [c.strip() for c in rows[label].strip("|").split("|")]
        assert re.fullmatch(r"\d+\.\d\d", cells[1]), rows[label]
        assert "failed" not in rows[label], rows[label]
        assert re.search(r"\d+(\.\d+)? [KM]iB", rows[label]), rows[label]
    # The offload rows say what the plan offloads and how many copies hide (H100 roofline): all
    # of them with offload_hidden_only
    assert re.search(r"planned: \d+ offloaded \([^)]*\), copies of \d+ hidden, \d+ not",
                     rows["offload + stream"]), rows["offload + stream"]
    assert re.search(r"planned: [1-9]\d* offloaded \([^)]*\), copies of [1-9]\d* hidden, 0 not",
                     rows["offload + stream, hidden copies only"])
    assert "memory not measured on CPU" in text
    targets = text.split("## Targets", 1)[1]
    llama = "Llama-3-8B layer, seq 8192"
    for line in (f"{llama}: FP8 tensorwise default vs bf16 Inductor >= 1.25x (measured ",
                 f"{llama}: FP8 tensorwise default vs torchao float8 + compile >= 1.05x",
                 f"{llama}: FP8 blockwise default vs bf16 Inductor >= 1.15x (measured ",
                 f"{llama}: step peak of graphpass FP8 tensorwise/reference, default <= bf16 "
                 "Inductor's (peak not measured on CPU)",
                 f"{llama}: step peak of graphpass FP8 blockwise (kernels=auto) <= bf16"):
        assert line in targets, (line, targets)
    assert "offload (hidden copies only): activation peak >= 30% lower" in targets
    assert "offload alone (hidden copies only): step <= 5% longer" in targets
    assert "PASS" not in targets and "FAIL" not in targets  # a dry run judges nothing
    # The step peak: predicted and MemTracker-measured agree on every row, the budget's included.
    peak = text.split("## Step peak: predicted vs MemTracker", 1)[1].split("## Targets", 1)[0]
    peak_rows = [r for r in peak.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert len(peak_rows) == 5 and "memory_budget 95% of its peak" in peak_rows[-1], peak_rows
    assert "offload + stream, hidden copies only" in peak_rows[-2], peak_rows
    assert all(" | 1.000 | " in r for r in peak_rows), peak_rows
    assert "would pass; CPU numbers, not judged): memory_budget 95%: the measured peak fits" in targets


def test_step_ms_times_each_call_once(monkeypatch):
    """The benchmarks' step timer calls the step once per timed step (torch's ``Timer.timeit``
    ran two untimed calls before each: three steps for each one measured), reads the clock
    around each call, and gives the median in milliseconds."""
    harness = load("_harness")
    now = [0.0]
    monkeypatch.setattr(harness, "clock", lambda: now[0])
    calls = []

    def step():
        calls.append(None)
        now[0] += 0.002 * len(calls)  # steps of 2, 4 and 6 ms

    assert harness.step_ms(step, 3) == pytest.approx(4.0)
    assert len(calls) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_gpu_run_names_the_dry_run():
    gpu_report = _load()
    with pytest.raises(SystemExit, match="--dry-run"):
        gpu_report.mode_for(False, None)


def _load_experts():
    return load("experts_fp8")


def test_experts_benchmark_dry_run(tmp_path):
    """benchmarks/experts_fp8.py on the CPU: bf16, FP8 rowwise (the default, and every GEMM
    whatever the cost model says), tensorwise e4m3 and tensorwise rows with numbers, each FP8
    row's share of GEMM FLOPs in FP8 in its note (the tiny experts are not judged by the cost
    model: all of them), a profile of the FP8 steps (one FP8 GEMM op per GEMM role: 6 for the two
    expert linears, every recipe alike; HYBRID tensorwise's per-expert _scaled_mm calls for
    dgrad and wgrad on top); four micro-batches per optimizer step with the weight cache, each
    of the two expert weights quantized once per step and looked up by the forward and backward
    of every other micro-batch; every target listed and none judged."""
    experts = _load_experts()
    out = tmp_path / "experts.md"
    # every config but the fast-accumulation one (a recipe option the other tests cover)
    assert experts.main(["--dry-run", "--cases", "experts_8k", "--steps", "1",
                         "--configs", "FP8", "Inductor token quantize", "CUDA graphs",
                         "weight once", "every GEMM", "--out", str(out)]) == 0
    text = out.read_text()
    assert "NOT GPU numbers" in text
    header = [c.strip() for c in re.search(r"^\| case .*$", text, re.M).group(0)
              .strip("|").split("|")]
    rows = {tuple(c[:2]): c for c in (
        [c.strip() for c in m.group(0).strip("|").split("|")]
        for m in re.finditer(r"^\| experts.*$", text, re.M))}
    ms, launches, note = (header.index(h) for h in ("median ms", "GEMM launches/step", "note"))
    for config in ("bf16", "FP8 rowwise/scaled_mm", "FP8 rowwise/scaled_mm, every GEMM",
                   "FP8 rowwise/scaled_mm, Inductor token quantize",
                   "FP8 rowwise/scaled_mm, weight once", "FP8 tensorwise e4m3/scaled_mm",
                   "FP8 tensorwise/scaled_mm", "bf16, 4 micro-batches",
                   "FP8 rowwise/scaled_mm, 4 micro-batches, weight cache, every GEMM",
                   "bf16, CUDA graphs",
                   "FP8 rowwise/scaled_mm, CUDA graphs"):
        cells = rows[("experts, 8,192 tokens", config)]
        assert re.fullmatch(r"\d+\.\d\d", cells[ms]), cells
        assert "failed" not in cells[note], cells
        assert cells[note].startswith("FP8 GEMM FLOPs 100%") == ("FP8" in config), cells
    case = "experts, 8,192 tokens"
    assert rows[(case, "FP8 rowwise/scaled_mm")][launches] == "6"  # no per-group _scaled_mm
    assert rows[(case, "FP8 tensorwise e4m3/scaled_mm")][launches] == "6"
    assert float(rows[(case, "FP8 tensorwise/scaled_mm")][launches]) > 6
    accumulating = "FP8 rowwise/scaled_mm, 4 micro-batches, weight cache, every GEMM"
    assert rows[(case, accumulating)][note] == (
        "FP8 GEMM FLOPs 100%; weight cache: 2 quantizes and 14 reuses per optimizer step")
    targets = text.split("## Targets", 1)[1]
    assert re.search(r"experts, 8,192 tokens: FP8 rowwise >= 1.0x bf16: not judged \(dry run; "
                     r"\d+\.\d\dx, FP8 GEMM FLOPs 100%\)", targets), targets
    assert ("experts, 8,192 tokens: FP8 rowwise with 4 micro-batches and the weight cache >= "
            "1.15x bf16 with 4: not judged") in targets
    assert "no per-expert loop in the FP8 rowwise step" in targets
    assert "no per-expert loop in the FP8 tensorwise e4m3 step" in targets
    assert "PASS" not in targets and "FAIL" not in targets


def test_model_section_dry_run(tmp_path):
    """The model section (N Llama layers with AdamW): the baseline and graphpass FP8 each time a
    step, tokens/s beside it, and the three targets listed (memory is not measured on the CPU)."""
    gpu_report = _load()
    out = tmp_path / "report.md"
    gpu_report.main(["--dry-run", "--no-pytest", "--sections", "model", "--layers", "1",
                     "--steps", "1", "--configs", "graphpass FP8", "--out", str(out)])
    text = out.read_text()
    assert "## 1 Llama-3-8B layer with AdamW" in text
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| ([^|]+?) \|.*$", text, re.M)}
    for label in ("bf16, torch.compile default", "graphpass FP8 tensorwise"):
        cells = [c.strip() for c in rows[label].strip("|").split("|")]
        assert re.fullmatch(r"\d+\.\d\d", cells[1]), rows[label]  # median ms
        assert re.fullmatch(r"[\d,]+", cells[2]), rows[label]  # tokens/s
        assert not cells[-1], rows[label]  # no failure note
    assert "torchao float8" not in rows  # not picked
    targets = text.split("## Targets", 1)[1]
    assert "1 Llama-3-8B layer with AdamW: graphpass FP8 tokens/s at least 1.25x bf16's (" in targets
    assert "NOT MEASURED: 1 Llama-3-8B layer with AdamW: graphpass FP8 peak at most 0.8x bf16's" in targets
    assert "NOT MEASURED: 1 Llama-3-8B layer with AdamW: graphpass FP8 peak at most torchao's" in targets


def test_cuda_graph_rows_run_under_a_filter_only_when_it_names_them():
    """The GPU scripts' stages filter configs by words (``--configs rowwise``); the CUDA-graph
    rows would add their compiles to those stages' time, so a filter runs them only by name."""
    picked = _load().picked  # gpu_report's, which is _harness's
    row = "FP8 rowwise/scaled_mm, CUDA graphs"
    assert picked(row, None)
    assert not picked(row, ["rowwise"])
    assert picked(row, ["CUDA graphs"])
    assert picked("FP8 rowwise/scaled_mm", ["rowwise"])
    assert not picked("FP8 rowwise/scaled_mm", ["CUDA graphs"])


def test_experts_comparison_rows_run_under_a_filter_only_when_it_names_them():
    """experts_fp8's comparison rows (the token quantizes left to Inductor; every GEMM with fast
    accumulation) are opt-in too: ``--configs rowwise torchao`` leaves them out, their own words
    pick them."""
    experts = _load_experts()
    row = f"FP8 rowwise/scaled_mm, {experts.INDUCTOR_TOKEN_ROW}"
    assert any(label == row for label, _ in experts.CONFIGS)
    assert not experts.picked(row, ["rowwise", "torchao"], experts.OPT_IN)
    assert experts.picked(row, ["Inductor token quantize"], experts.OPT_IN)
    assert experts.picked("FP8 rowwise/scaled_mm", ["rowwise"], experts.OPT_IN)
    assert experts.picked(row, None, experts.OPT_IN)
    fast = f"FP8 rowwise/scaled_mm, {experts.FAST_ACCUMULATION}"  # torchao's accumulation
    assert dict(experts.CONFIGS)[fast]["fp8_accumulate"] == "fast"
    assert not experts.picked(fast, ["rowwise"], experts.OPT_IN)
    assert experts.picked(fast, ["rowwise", "fast accumulation"], experts.OPT_IN)
    once = f"FP8 rowwise/scaled_mm, {experts.WEIGHT_ONCE}"  # a memory decision
    assert dict(experts.CONFIGS)[once]["fp8_weight_once"] is True
    assert not experts.picked(once, ["rowwise"], experts.OPT_IN)
    assert experts.picked(once, ["rowwise", "weight once"], experts.OPT_IN)
    # the default row is what a user gets; the row that lowers every GEMM, the cost model off,
    # is opt-in, and so are the kernel comparisons, which lower every GEMM too
    every = f"FP8 rowwise/scaled_mm, {experts.EVERY_GEMM}"
    configs = dict(experts.CONFIGS)
    assert "fp8_cost_model" not in configs["FP8 rowwise/scaled_mm"]
    assert configs[every] == {**configs["FP8 rowwise/scaled_mm"], "fp8_cost_model": "off"}
    assert not experts.picked(every, ["rowwise"], experts.OPT_IN)
    assert experts.picked(every, ["rowwise", "every GEMM"], experts.OPT_IN)
    assert all(options.get("fp8_cost_model") == "off" for label, options in experts.CONFIGS
               if options.get("fp8") and label != "FP8 rowwise/scaled_mm")


def test_experts_kernel_time_counts_each_kernel_once():
    """A profile recorded with CPU and CUDA activity gives a CPU op self device time for the
    kernels it launched itself (``graphpass::quantize``'s Triton launches): the kernel time is
    the device-side events' alone. (An H200 run summed both: 11.17 ms of "kernels" for a
    7.97 ms step.)"""
    from types import SimpleNamespace

    experts = _load_experts()
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(key="graphpass::quantize", device_type=cpu,
                              self_device_time_total=300.0),
              SimpleNamespace(key="_cast_kernel", device_type=cuda, self_device_time_total=200.0),
              SimpleNamespace(key="_amax_kernel", device_type=cuda, self_device_time_total=100.0),
              SimpleNamespace(key="aten::add_", device_type=cpu, self_device_time_total=0.0),
              SimpleNamespace(key="idle", device_type=cuda, self_device_time_total=0.0)]
    assert [e.key for e in experts.kernel_events(events)] == ["_cast_kernel", "_amax_kernel"]


def test_the_sweeps_fastest_tiles_run_the_experts_benchmark(tmp_path, monkeypatch):
    """``quantize_kernels.py --sweep --best-out F`` writes each kernel family's fastest
    bit-identical configuration; ``experts_fp8.py --tiles F`` makes them the kernels' defaults
    (tuples come back from JSON as tuples)."""
    from graphpass.fp8 import triton_grouped, triton_quantize

    kernels = load("quantize_kernels")
    experts = _load_experts()
    assert kernels.fastest([]) == {}
    best = {"experts": kernels.fastest([(2.0, {}), (1.5, {"amax_block": (32, 512),
                                                          "amax_n_chunk": 32})]),
            "grouped": kernels.fastest([(0.4, {}), (0.5, {"cast_k_chunk": 128})])}
    path = tmp_path / "tiles.json"
    kernels.write_best(path, best)
    monkeypatch.setattr(triton_quantize, "DEFAULT_CONFIG", triton_quantize.DEFAULT_CONFIG)
    monkeypatch.setattr(triton_grouped, "DEFAULT_CONFIG", triton_grouped.DEFAULT_CONFIG)
    said = experts.use_tiles(path)
    assert triton_quantize.DEFAULT_CONFIG == triton_quantize.KernelConfig(
        amax_block=(32, 512), amax_n_chunk=32)
    assert triton_grouped.DEFAULT_CONFIG == triton_grouped.GroupedKernelConfig()
    assert "amax_n_chunk" in said and "token groups default" in said
    path.write_text('{"weights": {}}')
    with pytest.raises(SystemExit, match="unknown kernel families"):
        experts.use_tiles(path)


# its own 1-rank gloo process group in this process (as tests/test_fsdp_fp8_gather.py's
# one-process tests make one), destroyed when the script ends: a subprocess would pay torch's
# import again; FSDP2's FP8 gathers themselves are tested on every torch version
# (tests/test_fsdp_fp8_gather.py)
@pytest.mark.one_version
def test_fsdp_fp8_gather_benchmark_dry_run(tmp_path):
    """benchmarks/fsdp_fp8_gather.py (issue 51's GPU check: FSDP2 on one rank, FP8 against bf16
    weight gathers): both configs time their steps, the losses are equal (bit-identical
    gathers), and the 2% target is judged, as a dry run."""
    import torch.distributed as dist

    out = tmp_path / "fsdp.md"
    assert load("fsdp_fp8_gather").main(["--dry-run", "--layers", "1", "--steps", "1",
                                         "--out", str(out)]) == 0
    assert not dist.is_initialized()  # the script's process group is gone
    text = out.read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (FSDP2[^|]+?) \|.*$", text, re.M)}
    assert len(rows) == 2, text
    for row in rows.values():
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"\d+\.\d\d", cells[1]) and not cells[-1], row
    assert re.search(r"^- DRY RUN \(would (pass|fail)\): FP8 all-gathered step at most 1\.02x",
                     text, re.M), text
    assert "- losses equal" in text
