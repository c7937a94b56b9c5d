"""The lab's ways of starting ranks, each a ``stnb.launchers.Launcher`` (check / start / deliver) run through
``stnb.launchers.execute``, so ``stnb.launchers.finish`` decides their RunResults as it decides ``stnb.run``'s.
Only the bench and the GPU check start ranks these ways; one class per file:

    raw_notebook    raw accelerate ``notebook_launcher``, as a user would write it (results left in files)
    concurrent      N independent single-device runs side by side, no communication
    torchrun_rank   one rank of the bench's ``torchrun`` comparison (stnb's External, the bench's clock)
    unchecked       stnb's own ranks without ``TrainConfig.validate`` (the GPU check's 1-rank fsdp)
"""

from .concurrent import Concurrent
from .raw_notebook import RawNotebookLauncher
from .torchrun_rank import TorchrunRank
from .unchecked import Unchecked

__all__ = ["Concurrent", "RawNotebookLauncher", "TorchrunRank", "Unchecked"]
