"""``kernels="auto"`` never falls back silently, and the partitioner's cache key covers what it
resolves to. A broken Transformer Engine is simulated by an import hook: ``transformer_engine`` is
found (installed) but importing it raises, as a missing CUDA library does."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

import pytest
import torch

import graphpass
from graphpass.backend import Partitioner
from graphpass.fp8 import cudnn, providers

_ERROR = "libtransformer_engine.so: cannot open shared object file: No such file or directory"


class _BrokenTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError(_ERROR)


@pytest.fixture
def broken_te(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(), *sys.meta_path])
    providers.te_status.cache_clear()
    yield
    providers.te_status.cache_clear()


@pytest.fixture
def healthy_te(monkeypatch):
    monkeypatch.setattr(providers, "te_status", lambda: providers.TEStatus("2.8.0", "", True))


@pytest.fixture
def fake_hopper(monkeypatch):
    """A CUDA device of capability 9.0 as far as the provider choice asks."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


class _RecordingTE(_BrokenTE):
    """A TE whose import records the ``CUDNN_PATH`` it sees, then fails."""

    seen: list = []

    def exec_module(self, module):
        self.seen.append(os.environ.get("CUDNN_PATH"))
        raise OSError(_ERROR)


@pytest.mark.parametrize("user_env", [None, "CUDNN_HOME", "CUDNN_PATH"])
def test_te_imports_with_torchs_cudnn_unless_the_user_named_one(monkeypatch, user_env):
    """TE loads cuDNN from ``CUDNN_HOME``/``CUDNN_PATH`` first, else the system's: graphpass
    names torch's while TE imports (a second cuDNN broke TE's import on the H200 image), and
    leaves a user's own setting and the environment afterwards as they were."""
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    recording = _RecordingTE()
    recording.seen.clear()
    monkeypatch.setattr(sys, "meta_path", [recording, *sys.meta_path])
    monkeypatch.setattr(cudnn, "torch_cudnn_dir", lambda: "/torch/nvidia/cudnn/lib")
    for name in ("CUDNN_HOME", "CUDNN_PATH"):
        monkeypatch.delenv(name, raising=False)
    if user_env:
        monkeypatch.setenv(user_env, "/mine")
    providers.te_status.cache_clear()
    try:
        assert not providers.te_available()
    finally:
        providers.te_status.cache_clear()
    expected = {None: "/torch/nvidia/cudnn/lib", "CUDNN_HOME": None, "CUDNN_PATH": "/mine"}
    assert recording.seen == [expected[user_env]]
    assert os.environ.get("CUDNN_PATH") == ("/mine" if user_env == "CUDNN_PATH" else None)


def test_torch_cudnn_dir_is_the_loaded_library_folder():
    loaded = [line.split()[-1] for line in open("/proc/self/maps") if "/libcudnn.so." in line]
    if not loaded:
        assert cudnn.torch_cudnn_dir() is None
        pytest.skip("this torch loaded no cuDNN (a CPU build)")
    assert os.path.isfile(os.path.join(cudnn.torch_cudnn_dir(), os.path.basename(loaded[0])))


def test_torchs_cudnn_libraries_load_each_after_those_it_needs(tmp_path):
    """Before TE imports, torch's cuDNN libraries are loaded graph first (every other one needs
    it), so a later load by name gets torch's copy; a file that does not load is left alone."""
    (tmp_path / "libcudnn_graph.so.9").write_bytes(b"not a library")
    assert cudnn.preload(str(tmp_path)) == []
    folder = cudnn.torch_cudnn_dir()
    if folder is None:
        pytest.skip("this torch loaded no cuDNN (a CPU build)")
    loaded = cudnn.preload(folder)
    assert loaded and loaded[0] == "libcudnn_graph.so.9"
    assert loaded == sorted(loaded, key=lambda n: cudnn.ORDER.index(
        n.removeprefix("libcudnn_").removesuffix(".so.9")))
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/libcudnn_" in line}
    assert {os.path.join(folder, n) for n in loaded} <= mapped


def test_broken_te_is_told_apart_from_an_absent_one(broken_te):
    status = providers.te_status()
    assert status == providers.TEStatus(None, f"OSError: {_ERROR}", installed=True)
    assert status.describe() == f"TE present but failed to import: OSError: {_ERROR}"
    assert not providers.te_available()


def test_auto_with_broken_te_falls_back_to_scaled_mm_with_the_error(broken_te, fake_hopper):
    provider, why = providers.resolve("auto", "tensorwise", torch.device("cuda", 0))
    assert provider.name == "scaled_mm"
    assert why == f"kernels='auto' chose scaled_mm: TE present but failed to import: OSError: {_ERROR}"


def test_auto_with_te_chooses_te_and_says_its_version(healthy_te, fake_hopper, monkeypatch):
    from graphpass.fp8.te import TransformerEngine

    class FakeTE:  # TE's own rules of what it runs, without importing TE
        name = "te"
        supports = TransformerEngine.supports

    real_get = providers.get
    monkeypatch.setattr(providers, "get", lambda name: FakeTE() if name == "te" else real_get(name))
    provider, why = providers.resolve("auto", "tensorwise", torch.device("cuda", 0))
    assert (provider.name, why) == ("te", "kernels='auto' chose te (Transformer Engine 2.8.0)")
    # blockwise: TE is not wired for it here; torch's own blockwise GEMM runs it on Hopper where
    # this torch has it (a CUDA build older than 12.9 does not): the note names the reasons
    from graphpass.fp8 import blockwise_gemm

    provider, why = providers.resolve("auto", "blockwise", torch.device("cuda", 0))
    missing = blockwise_gemm.unsupported(torch.device("cuda", 0))
    if missing is None:
        assert provider.name == "scaled_mm"
        assert why.startswith("kernels='auto' chose scaled_mm: te: the TE provider runs ")
    else:
        assert provider.name == "reference"
        assert why.startswith("kernels='auto' chose reference: te: ")
        assert f"scaled_mm: {missing}" in why


def test_explicit_te_with_broken_te_names_the_import_error(broken_te):
    with pytest.raises(ValueError, match="kernels='te' needs Transformer Engine "
                                         r"\(TE present but failed to import: OSError: "):
        providers.resolve("te", "tensorwise", torch.device("cuda", 0))


def test_auto_choice_is_a_report_note(broken_te):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    report = graphpass.plan(model, torch.randn(32, 64), config=graphpass.Config(fp8="tensorwise"))
    kernel_notes = [n for n in report.notes if n.startswith("kernels:")]
    assert kernel_notes == [
        "kernels: kernels='auto' chose reference on cpu: the te and scaled_mm FP8 GEMMs are used "
        f"on CUDA only (TE present but failed to import: OSError: {_ERROR})"]
    # a provider the user named is no choice of graphpass's: no note
    named = graphpass.plan(model, torch.randn(32, 64),
                           config=graphpass.Config(fp8="tensorwise", kernels="reference"))
    assert not [n for n in named.notes if n.startswith("kernels:")]


def test_cache_key_covers_the_resolved_provider_and_te_version(monkeypatch):
    config = graphpass.Config(fp8="tensorwise")
    keys = {}
    for label, status in [("absent", providers.TEStatus(None)),
                          ("broken", providers.TEStatus(None, "OSError: x", True)),
                          ("te 2.8", providers.TEStatus("2.8.0", "", True)),
                          ("te 2.9", providers.TEStatus("2.9.0", "", True))]:
        monkeypatch.setattr(providers, "te_status", lambda status=status: status)
        keys[label] = Partitioner(config).uuid()
    # the same environment gives the same key; each environment its own
    assert Partitioner(config).uuid() == keys["te 2.9"]
    assert len(set(keys.values())) == len(keys)
    # two configs resolving to different providers on one machine
    assert (Partitioner(config).uuid()
            != Partitioner(config.replace(kernels="reference")).uuid())
    # what `auto` resolves to on CUDA is in the key
    monkeypatch.setattr(providers, "te_status", lambda: providers.TEStatus(None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "cuda: scaled_mm" in providers.environment_key("auto", "tensorwise")
