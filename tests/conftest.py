import os

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from hypothesis import settings

# CI must not turn red or green by chance: there, property tests run a fixed set of examples.
settings.register_profile("ci", derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# Tests must see graphpass partition every graph; a cache hit would skip the partitioner. Set
# the configs themselves: graphpass's pytest plugin imports torch before this file, too early for
# the environment variables to count. (The cache test turns them on in its own subprocesses.)
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
