import os

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from hypothesis import settings

# Neither `make test` nor CI may turn red or green by chance: property tests run a fixed set of
# examples (the "ci" profile: derandomized, the same examples every run, no example database),
# CI set or not. GRAPHPASS_PROPERTY_EXAMPLES=N (`make hunt`) loads "hunt": new random examples
# every run, N for each property test that reads it, failures kept in .hypothesis/ and replayed
# first by the next hunt.
HUNTING = bool(os.environ.get("GRAPHPASS_PROPERTY_EXAMPLES"))
settings.register_profile("ci", derandomize=True)
settings.register_profile("hunt")
settings.load_profile("hunt" if HUNTING else "ci")

# Tests must see graphpass partition every graph; a cache hit would skip the partitioner. Set
# the configs themselves: graphpass's pytest plugin imports torch before this file, too early for
# the environment variables to count. (The cache test turns them on in its own subprocesses.)
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


# Under pytest-xdist, every worker is a process with torch's default intra-op threads (one per
# core): two workers on two cores ran four threads, and the suite's tiny tensors paid for it
# (38 bf16 training steps of the tiny Llama on a busy 2-core machine: 28 s with 2 threads per
# process, 8.8 s with 1). Each worker gets its share of the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_addoption(parser):
    parser.addoption(
        "--first-params", action="store_true",
        help="run each parametrized test with its first parameter set only (CI's later torch "
             "versions; the first version runs every set): tests marked every_param keep theirs")


@pytest.hookimpl(trylast=True)  # after -m's deselection: the first set that is left runs
def pytest_collection_modifyitems(config, items):
    if not config.getoption("--first-params"):
        return
    seen: set[str] = set()
    keep, drop = [], []
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        if (getattr(item, "callspec", None) is None or function not in seen
                or item.get_closest_marker("every_param")):
            keep.append(item)
        else:
            drop.append(item)
        seen.add(function)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: CPU kernels that split a sum over threads (embedding's
    backward scatter-adds the rows of a repeated token) give bits that vary from run to run on
    more than one, and a bit-identity test must compare plans, not thread schedules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
