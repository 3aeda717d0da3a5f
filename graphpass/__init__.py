"""graphpass: automatic FP8 memory savings for torch.compile training graphs.

    model = torch.compile(model, backend=graphpass.backend())
    loss = model(x).sum(); loss.backward()
    print(graphpass.last_report())
"""

from ._version import __version__
from .backend import backend
from .config import FP8, ActivationCache, Config, MemoryPlan, Offload, Recompute
from .decisions import Decision, OpaqueOpWarning, What
from .job.estimate import estimate
from .job.result import JobEstimate
from .fp8.fsdp import FSDPFP8Warning, fsdp_fp8_weights, precompute_fsdp_fp8_scales
from .fp8.weight_cache import clear as clear_weight_cache, stats as weight_cache_stats
from .pipeline import partition
from .reporting import last_report
from .plan import plan
from .report import Report, Row
from .selections import EmptySelectionWarning

from .named import register as _register

_register()

__all__ = ["ActivationCache", "backend", "clear_weight_cache", "Config", "Decision",
           "EmptySelectionWarning", "estimate", "FP8", "FSDPFP8Warning",
           "fsdp_fp8_weights", "JobEstimate", "MemoryPlan", "Offload", "OpaqueOpWarning",
           "partition", "plan", "precompute_fsdp_fp8_scales",
           "last_report", "Recompute", "Report", "Row", "weight_cache_stats", "What", "__version__"]
