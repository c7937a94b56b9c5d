"""Ways of starting a run's ranks, one class per file, on one interface (``base.Launcher``).

``choose`` picks the launcher for a run once; ``execute`` runs the pipeline (check -> start -> merge).
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import Launcher, Plan, execute, finish
from .external import External
from .local import Local

__all__ = ["Launcher", "Plan", "execute", "finish", "choose", "Local", "External"]


def choose(cluster=None) -> Launcher:
    """The launcher of a run: inside torchrun / accelerate launch the outer launch's (``External``),
    else ``cluster`` (``stnb.Slurm(...)``, ``stnb.Ray(...)``), else ranks from this process (``Local``)."""
    from ..scaleout import inside_external_launch

    if cluster is not None and not isinstance(cluster, Launcher):
        raise ConfigError(f"cluster= takes stnb.Slurm(...) or stnb.Ray(...); got {type(cluster).__name__}")
    if inside_external_launch():  # a rank of torchrun / accelerate launch: don't launch again
        if cluster is not None:
            raise ConfigError(f"this process is already a rank of an outer launch ({External().name}); "
                              f"cluster={type(cluster).__name__}(...) would start the ranks again: "
                              "leave cluster= out here, or submit from a plain Python process")
        return External()
    return cluster if cluster is not None else Local()
