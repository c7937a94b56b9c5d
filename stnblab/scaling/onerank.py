"""A one-rank FSDP run of a configuration, for ``stnb.predict(single, ..., one_rank=...)``: the predictor's
measured host work per FSDP collective (``stnb.scaling.collective_host``).

``stnb.run`` refuses ``fsdp`` with one process (it shards nothing: a user wants ``single``); the predictor wants
exactly that run, FSDP's own work without a peer, so the lab runs it through the pipeline with the ``Unchecked``
launcher (as the GPU check's 'fsdp x1' row does) and returns its verified RunResult.

    single = stnb.run(stnb.TrainConfig(strategy="single", **settings))
    one = one_rank(stnb.TrainConfig(strategy="single", **settings))
    stnb.predict(single, devices=[2, 4, 8], link="nvlink-h100", one_rank=one)
"""

from __future__ import annotations

from dataclasses import replace

from stnb.builds import RecipeBuild
from stnb.config import TrainConfig
from stnb.errors import VerificationError
from stnb.launchers import Plan, execute

from ..launchers import Unchecked


def one_rank(config: TrainConfig, strategy: str = "fsdp", echo: bool = False):
    """``config`` (the single run's settings) trained by ``strategy`` on one rank; refused unless verified."""
    res = execute(Plan(replace(config, strategy=strategy, num_processes=1), RecipeBuild(), echo=echo), Unchecked())
    if not res.verified:
        raise VerificationError(f"the one-rank {strategy} run was not verified: {res.reason}")
    return res
