"""A launcher is one file: ``Spawned``, made up in this file alone, starts a run's ranks as plain
``multiprocessing`` spawn processes with torch's rendezvous variables. It settles the device, calls the
checks every launcher makes (``check_plan``), sets up each rank with ``rank_env`` and runs ``train_rank`` in
it; ``stnb.run(cluster=Spawned())`` then trains DDP on 2 ranks, verified, merged by the same pipeline, and
names the launcher. No other file knows it."""

from __future__ import annotations

import os
import socket

import pytest

import stnb
from stnb.errors import ConfigError
from stnb.launchers.base import Launcher, Plan, check_plan, rank_env

pytestmark = pytest.mark.slow

RUN = dict(strategy="ddp", num_processes=2, model="tiny", per_device_batch_size=4, steps=4, warmup_steps_excluded=1,
           evaluate=False, threads_per_rank=1, timeout=300, device="cpu")


def _rank(rank: int, world: int, port: int, env: dict, config, build, t0: float, queue) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from stnb.training import train_rank

    queue.put(train_rank(config, build, t0, world))


class Spawned(Launcher):
    """The ranks as spawn processes on this machine (a test's launcher: no supervision, no progress)."""

    name = "spawned"

    def check(self, plan: Plan) -> None:
        if plan.config.resolved_device() != "cpu":
            raise ConfigError("Spawned runs CPU ranks only (a test's launcher)")
        check_plan(plan, plan.config, machine=lambda config: config.check_hardware())

    def start(self, plan: Plan) -> list:
        import multiprocessing as mp

        config, world = plan.config, plan.config.world_size()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        env = rank_env(config, plan.device)
        procs = [ctx.Process(target=_rank, args=(r, world, port, env, config, plan.build, plan.t0, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            reports = [queue.get(timeout=config.timeout) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        return sorted(reports, key=lambda r: r.rank)


def test_a_launcher_in_one_file_runs_a_verified_ddp_run():
    result = stnb.run(cluster=Spawned(), echo=False, **RUN)
    assert result.status == "ok" and result.verified, result.reason
    assert (result.launcher, result.world_size, result.strategy) == ("spawned", 2, "ddp")
    assert len(result.peak_memory_bytes) == 2 and result.verification["world_size_requested"] == 2
    with pytest.raises(ConfigError, match="learning_rate must be a number > 0"):  # checked before any rank starts
        stnb.run(cluster=Spawned(), echo=False, **dict(RUN, learning_rate=-1.0))
