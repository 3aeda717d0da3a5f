import os

import pytest
import torch
from hypothesis import settings

# CI must not turn red or green by chance: there, property tests run a fixed set of examples.
settings.register_profile("ci", derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# Tests must see graphpass partition every graph; a cache hit would skip the partitioner.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
