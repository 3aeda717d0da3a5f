"""graphpass: automatic FP8 memory savings for torch.compile training graphs.

    model = torch.compile(model, backend=graphpass.backend())
    loss = model(x).sum(); loss.backward()
    print(graphpass.last_report())
"""

__version__ = "0.1.0"

from .backend import backend
from .config import Config
from .decisions import Decision, What
from .pipeline import last_report, partition
from .plan import plan
from .report import Report, Row

from .backend import register as _register

_register()

__all__ = ["backend", "Config", "Decision", "partition", "plan", "last_report", "Report", "Row",
           "What", "__version__"]
