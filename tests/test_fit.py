"""``graphpass fit``: transformers models from a config JSON with no network, the exit codes, the
option search and bad input (one line, exit 2)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import graphpass  # noqa: E402
from graphpass.cli import main, parse_bytes  # noqa: E402
from graphpass.job import models  # noqa: E402
from graphpass.job.search import Options, micro_batch_sizes, plan_layer  # noqa: E402

# Tiny shapes per model type: two layers (DeepSeek-V3: one dense, two MoE), sequence 32.
ATTENTION = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 128, "max_position_embeddings": 64}
TINY = {
    "llama": {**ATTENTION, "num_hidden_layers": 2, "intermediate_size": 128},
    "mixtral": {**ATTENTION, "num_hidden_layers": 2, "intermediate_size": 128,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**ATTENTION, "num_hidden_layers": 2, "intermediate_size": 128, "head_dim": 16,
                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {**ATTENTION, "num_key_value_heads": 4, "num_hidden_layers": 3,
                    "first_k_dense_replace": 1, "intermediate_size": 128,
                    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "q_lora_rank": 32,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "rope_scaling": None},
}
RUN = ["--seq", "32", "--codegen", "eager"]


def _config(tmp_path: Path, model_type: str, **extra) -> str:
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **TINY[model_type], **extra}))
    return str(path)


def _fit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["fit", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# one_version: the config file, the meta-device build and the estimate of a transformers model
# run on every version in test_fit_text_says_whether_it_fits (llama, FSDP2 x TP over 2 x 2 ranks)
@pytest.mark.one_version
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_fit_from_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """Each MoE model type from a config file with no network (the hub is unreachable), FSDP2
    over two fake ranks: exit 0, it fits."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any download would fail
    args = ["--config", _config(tmp_path, model_type), *RUN, "--fsdp", "2", "--json"]
    code, out, _ = _fit(capsys, *args)
    result = json.loads(out)
    peak = result["estimate"]["peak_bytes"]
    assert code == 0 and result["fits"] and 0 < peak < 64 << 20
    assert result["estimate"]["world_size"] == 2
    breakdown = result["estimate"]["breakdown"]
    assert breakdown["parameters"] > 0 and breakdown["optimizer state"] > 0


def test_fit_text_says_whether_it_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama from a config file with no network, FSDP2 and tensor parallelism over
    2 x 2 fake ranks, in a device smaller than its peak: the estimate, the verdict, exit 1."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # any download would fail
    code, out, _ = _fit(capsys, "--config", _config(tmp_path, "llama"), *RUN, "--fsdp", "2",
                        "--tp", "2", "--device-memory", "1KiB")
    assert code == 1
    assert "step peak (predicted) (rank 0 of 4)" in out and "does not fit in 1.00 KiB" in out
    assert "optimizer state" in out
    assert "the embedding and the output layer are whole on every tensor-parallel rank" in out


# one_version: the estimate of an FSDP2 model runs on every version in
# test_fit_text_says_whether_it_fits; this adds the factory's way in
@pytest.mark.one_version
def test_fit_a_factory(capsys: pytest.CaptureFixture[str]) -> None:
    """``--model package.module:factory`` as ``graphpass report`` takes it: the tiny reference
    Llama (real weights, moved to the meta device for FSDP2), its default loss noted."""
    code, out, _ = _fit(capsys, "--model", "graphpass.models.llama:build", "--size", "tiny",
                        "--codegen", "eager", "--fsdp", "2")
    assert code == 0 and "(rank 0 of 2)" in out and "loss: output.float().mean()" in out


# one_version: half a minute of estimates; the layer planner and its roofline run on every version
# in test_plan_layer_times_the_partitioned_graphs, the ranking's code has no torch in it
@pytest.mark.one_version
def test_search_ranks_and_its_best_call_is_valid(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny Llama's search over the FP8 weight cache (the recipe given, two micro-batches):
    option sets that fit, fastest first, each counted by graphpass.estimate, and the printed
    backend call evaluates to a graphpass backend with the options given and chosen."""
    code, out, _ = _fit(capsys, "--config", _config(tmp_path, "llama"), *RUN, "--search",
                        "--fp8", "tensorwise", "--micro-batches", "2", "--count", "1")
    assert code == 0
    lines = out.splitlines()
    ranked = [m for m in (re.match(r"\s*\d+\. (.*) peak .*\((counted|predicted)\)\s+layers\s+"
                                   r"([0-9.]+) (ms|us)$", line) for line in lines) if m]
    assert [m.group(2) for m in ranked] == ["counted", "counted"], out
    assert {"fp8_weight_cache" in m.group(1) for m in ranked} == {True, False}
    times = [float(m.group(3)) * (1e-3 if m.group(4) == "ms" else 1e-6) for m in ranked]
    assert times == sorted(times)
    call = lines[lines.index(next(line for line in lines if line.startswith("best:"))) + 1].strip()
    tree = ast.parse(call, mode="eval")
    assert isinstance(tree.body, ast.Call) and ast.unparse(tree.body.func) == "graphpass.backend"
    backend = eval(compile(tree, "<best>", "eval"), {"graphpass": graphpass})  # noqa: S307
    assert isinstance(backend, graphpass.backend().__class__)
    assert (backend.config.codegen, backend.config.fp8) == ("eager", "tensorwise")


def test_plan_layer_times_the_partitioned_graphs() -> None:
    """One decoder layer of the tiny Llama planned as the search plans it: FP8's saved bytes and
    roofline differ from bf16's; full recompute saves fewer bytes and takes longer."""
    config = models.load_config(model_type="llama", overrides=list(TINY["llama"].items()))
    kinds = models.layer_kinds(config, parallel=models.Parallel())
    [(count, block, args, kwargs)] = kinds.with_inputs(2, 64)
    assert count == 2
    plain, fp8, full = (plan_layer(block, args, kwargs, graphpass.Config(codegen="eager", **o))
                        for o in ({}, {"fp8": "tensorwise"}, {"recompute": ("full",)}))
    assert fp8.activation_bytes != plain.activation_bytes
    assert full.activation_bytes < plain.activation_bytes and full.seconds > plain.seconds > 0
    assert fp8.seconds != plain.seconds and plain.peak_bytes >= plain.activation_bytes


def test_micro_batch_sizes_keep_the_sequences_per_step() -> None:
    assert micro_batch_sizes(4, 2) == [(4, 2), (2, 4), (1, 8)]
    assert micro_batch_sizes(3, 1) == [(3, 1), (1, 3)]
    assert micro_batch_sizes(1, 8) == [(1, 8)]


def test_backend_call_keeps_given_options() -> None:
    options = Options("rowwise", ("layernorm", "act"), True, False, 1, 1)
    call = options.backend_call({"kernels": "reference", "fp8": "tensorwise"})
    assert call == ("graphpass.backend(kernels='reference', fp8='rowwise', "
                    "recompute=('layernorm', 'act'), offload=True)")
    assert eval(call, {"graphpass": graphpass}).config.fp8 == "rowwise"  # noqa: S307


def test_presets_are_published_configs() -> None:
    known = models.presets()
    assert set(known) == {"llama-3-8b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"}
    config = models.load_config(preset="deepseek-v3")
    assert (config.model_type, config.num_hidden_layers, config.n_routed_experts) == ("deepseek_v3", 61, 256)
    assert models.load_config(preset="llama-3-8b").vocab_size == 128256


@pytest.mark.parametrize("sizes", [["1.5TiB", 3 << 39], ["141GB", 141 * 10**9], ["80GiB", 80 << 30],
                                   ["1024", 1024]])
def test_device_memory_sizes(sizes: list) -> None:
    assert parse_bytes(sizes[0]) == sizes[1]


@pytest.mark.parametrize("argv, message", [
    (["--model-type", "lama"], "unknown model type 'lama'"),
    (["--model-type", "llama", "--set", "hidden_size=big"], "hidden_size is a number"),
    (["--model-type", "llama", "--set", "num_attention_heads=6", "--set", "num_key_value_heads=6",
      "--set", "hidden_size=96", "--tp", "4"], "tensor parallel degree 4 must divide the attention heads (6)"),
    (["--model-type", "llama", "--device-memory", "lots"], "'lots' is not a size"),
    (["--model-type", "llama", "--world-size", "6", "--fsdp", "4"], "world size 6 is not a multiple"),
    (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
    (["--model-type", "llama", "--preset", "llama-3-8b"], "give one model"),
    (["--model-type", "llama", "--mp", "bf16"], "--mp bf16 is FSDP2's"),
    (["--model-type", "gpt2", "--tp", "2"], "no tensor-parallel plan for model type 'gpt2'"),
    (["--model-type", "llama", "--seq", "0"], "sequence length and micro-batch size must be at least 1"),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code = main(["fit", "--seq", "8", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_config_transformers_rejects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama", **TINY["llama"], "hidden_size": 63}))
    assert main(["fit", "--config", str(bad), "--seq", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "llama" in err, err
    missing = tmp_path / "none.json"
    assert main(["fit", "--config", str(missing)]) == 2
    assert "cannot read" in capsys.readouterr().err
    no_type = tmp_path / "no_type.json"
    no_type.write_text("{}")
    assert main(["fit", "--config", str(no_type)]) == 2
    assert 'has no "model_type"' in capsys.readouterr().err
