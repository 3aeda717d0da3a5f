"""One Dynamo trace, compiled by several backends.

A tiny Hugging Face model's compile here is mostly Dynamo tracing its Python (a 1-layer GPT-2:
about 6 s of CPU for the trace, 1.5-2 s for graphpass's AOTAutograd partition); tests that
compile one model under two graphpass configurations (FP8 and not, two exclude lists) trace it
once with :class:`OneTrace`: each graph Dynamo captures is handed to every backend, each
compiles it as it would alone, and a call runs the compiled graph of the backend
:meth:`OneTrace.use` names. The graphs each backend's partitions return are kept apart
(``graphs[name]``), so a coverage check reads one configuration's graphs only.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator


class OneTrace:
    def __init__(self, **backends: Callable[..., Any]):
        self.backends = backends
        self.graphs: dict[str, list] = {name: [] for name in backends}
        self.active: str | None = None

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Calls of the compiled function run ``name``'s compiled graphs."""
        assert name in self.backends, name
        self.active = name
        try:
            yield
        finally:
            self.active = None

    def __call__(self, gm, example_inputs):
        backend_module = importlib.import_module("graphpass.backend")  # not the function
        real = backend_module.run
        compiled = {}
        for name, backend in self.backends.items():
            graphs = self.graphs[name]

            def capturing(*args, _graphs=graphs, **kwargs):
                partition = real(*args, **kwargs)
                _graphs.extend((partition.forward, partition.backward))
                return partition

            backend_module.run = capturing
            try:
                compiled[name] = backend(gm, example_inputs)
            finally:
                backend_module.run = real

        def run(*args):
            assert self.active is not None, "call inside OneTrace.use(name)"
            return compiled[self.active](*args)

        return run
