"""Faults injected at run time, and stnb (or the test that states the behaviour) catching them.

These replace the hand-written mutation table (tests/mutations.py, text replacements in a scratch copy of
stnb): each fault here is made by patching the library stnb calls (torch, transformers,
sentence-transformers) in this process, which the forked ranks inherit, never by editing stnb's code, so a
refactor of stnb does not break them. Each is a real 2-rank launch (gloo, the tiny model, 3 steps), and
each asserts that the run is reported unverified, with the reason naming what went wrong.
docs/testing.md lists the 26 faults of the old table and where each lives now.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import stnb
from stnb.models import tiny_path

pytestmark = pytest.mark.slow

DDP = dict(strategy="ddp", num_processes=2, model="tiny", per_device_batch_size=4, steps=3, train_size=64,
           evaluate=False, threads_per_rank=1, timeout=300, warmup_steps_excluded=1)


def _verdict(**kw):
    """(verified, what stnb said): a result's reason, or the error a rank raised about what it observed."""
    try:
        r = stnb.run(stnb.TrainConfig(**{**DDP, **kw}), echo=False)
    except stnb.LaunchError as e:
        return False, str(e)
    return r.verified, r.reason or ""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@pytest.fixture
def after_training_rank_1(monkeypatch):
    """``after_training_rank_1(change)``: rank 1 calls ``change(model)`` as soon as ``trainer.train()`` returns."""
    from transformers import Trainer

    def inject(change):
        real = Trainer.train

        def train(self, *a, **kw):
            out = real(self, *a, **kw)
            if _rank() == 1:
                with torch.no_grad():
                    change(self.model)
            return out

        monkeypatch.setattr(Trainer, "train", train)

    return inject


def test_ddp_that_never_all_reduces_is_caught(monkeypatch):
    """Every DDP model gets a no-op communication hook: each rank steps on its own half batch's gradients."""
    DDPModel = torch.nn.parallel.DistributedDataParallel
    real_init, real_register = DDPModel.__init__, DDPModel.register_comm_hook

    def no_op(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        real_register(self, None, no_op)

    monkeypatch.setattr(DDPModel, "__init__", init)
    monkeypatch.setattr(DDPModel, "register_comm_hook", lambda self, state, hook: None)  # stnb's own: ignored
    verified, why = _verdict()
    assert verified is False
    assert "weights differ across ranks" in why, why


def _word_embeddings(model):
    return next(p for n, p in model.named_parameters() if n.endswith("word_embeddings.weight"))


def _swap_rows(model):
    w = _word_embeddings(model)
    w[[100, 101]] = w[[101, 100]].clone()


def _nudge(model):
    _word_embeddings(model).view(-1)[0] += 3e-4


@pytest.mark.parametrize("change", [_swap_rows, _nudge], ids=["swap-two-embedding-rows", "add-3e-4-to-one-weight"])
def test_rank_1_changing_its_weights_after_training_is_caught(after_training_rank_1, change):
    after_training_rank_1(change)
    verified, why = _verdict()
    assert verified is False
    assert "weights differ across ranks in 1 of" in why and "word_embeddings" in why and "(ranks [1])" in why, why


def test_saving_the_untrained_model_is_caught(monkeypatch, tmp_path):
    """SentenceTransformer.save writes the model as loaded from disk, not the one trained."""
    from sentence_transformers import SentenceTransformer

    real = SentenceTransformer.save

    def save_initial(self, path, *a, **kw):
        return real(SentenceTransformer(tiny_path(), device="cpu"), path, *a, **kw)

    monkeypatch.setattr(SentenceTransformer, "save", save_initial)
    target = tmp_path / "model"
    verified, why = _verdict(save_to=str(target))
    assert verified is False
    assert "the saved model's weights are not the trained ones" in why, why
    assert "equal the initial (untrained) model's" in why, why
    assert not target.exists()  # nothing saved under the name the user gave


def test_a_loss_parameter_left_unsynced_is_caught(monkeypatch, tmp_path):
    """SoftmaxLoss's classifier keeps each rank's own gradient (stnb's sync made a no-op): the classifier
    drifts apart across ranks while the DDP-wrapped model stays identical."""
    from stnb.strategies import loss_sync
    from test_loss_params import build_softmax
    from trainfns import FAST

    monkeypatch.setattr(loss_sync.LossParameterSync, "sync_grads", lambda self: None)
    try:
        r = stnb.run(functools.partial(build_softmax, str(tmp_path)), strategy="ddp", echo=False, **FAST)
        verified, why = r.verified, r.reason or ""
    except stnb.LaunchError as e:
        verified, why = False, str(e)
    assert verified is False
    assert "weights differ across ranks" in why and "classifier" in why, why


def test_zero1_left_with_the_plain_optimizer_is_caught(monkeypatch):
    """torch's ZeroRedundancyOptimizer hands back the plain optimizer: every rank holds the whole state."""
    import torch.distributed.optim as dist_optim

    class PlainOptimizer(dist_optim.ZeroRedundancyOptimizer):
        def __new__(cls, params, optimizer_class, **defaults):
            return optimizer_class(params, **defaults)

    monkeypatch.setattr(dist_optim, "ZeroRedundancyOptimizer", PlainOptimizer)
    verified, why = _verdict(strategy="zero1")
    assert verified is False
    assert "the trainer's optimizer is AdamW, not a ZeroRedundancyOptimizer" in why, why


def test_zero2_blocks_resharded_after_forward_are_caught(monkeypatch):
    """Every FSDP2 unit reshards after its forward (ZeRO-3's re-gather in the backward) under zero2."""
    import torch.distributed.fsdp as fsdp

    real = fsdp.fully_shard

    def reshard(module, *a, **kw):
        return real(module, *a, **{**kw, "reshard_after_forward": True})

    monkeypatch.setattr(fsdp, "fully_shard", reshard)
    verified, why = _verdict(strategy="zero2")
    assert verified is False
    assert "the first block's parameters were resharded after its forward" in why, why


def test_cleanup_without_the_child_subreaper_leaves_the_daemon_behind(tmp_path, monkeypatch):
    """The fault injected: prctl is unavailable (ctypes cannot open this process's libc), so the launcher
    cannot become the child subreaper. A killed rank's double-forked daemon is then re-parented to init,
    out of reach of the cleanup: tests/test_faults.py::test_2c's check (nothing left behind) sees it."""
    import ctypes

    import faultcases as fc
    import psutil
    from stnb.processes import child_subreaper

    was = child_subreaper(False)  # start from a process that is not a subreaper already
    real = ctypes.CDLL

    def cdll(name, *a, **kw):
        if name is None:
            raise OSError("injected: this process's libc cannot be opened")
        return real(name, *a, **kw)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    out = fc.case_sigkill_with_children(str(tmp_path))
    monkeypatch.undo()
    left = out.rank_pids_alive + [p.pid if hasattr(p, "pid") else p for p in out.orphans]
    for pid in left:  # stop what the fault left behind
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    if was:
        child_subreaper(True)
    assert isinstance(out.error, stnb.LaunchError) and out.error.rank == 1, repr(out.error)
    assert left, "without the subreaper the cleanup still found every process the killed rank started"


def test_a_killed_process_that_comes_back_as_a_zombie_after_the_first_reaping_is_reaped(monkeypatch):
    """The race seen under load (a zombie left after a launch that failed): a killed rank's child is still
    its parent's when the cleanup first tries to reap it (waitpid: "no child processes"), and comes back to
    this process (the child subreaper) as a zombie a moment later. Injected: the first waitpid of that
    process is refused as it would be then; the cleanup must reap it on a later round, not leave it."""
    import subprocess
    import sys

    from stnb.processes import supervise

    before = supervise.children_now()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    real, refused = os.waitpid, []

    def waitpid(pid, flags):
        if pid == orphan.pid and not refused:
            refused.append(pid)
            raise ChildProcessError(10, "No child processes")  # still the killed rank's child
        return real(pid, flags)

    monkeypatch.setattr(os, "waitpid", waitpid)
    try:
        supervise.kill_new_children(before)
    finally:
        monkeypatch.undo()
    assert refused == [orphan.pid]
    assert orphan.pid not in supervise.children_now(), "killed, but left a zombie below this process"


def test_a_launcher_on_the_default_port_fails_while_it_is_busy(monkeypatch):
    """The fault injected: the launcher's free-port choice returns torch's default 29500 (patched by name:
    a renamed function fails this test loudly). With 29500 held, as in
    tests/test_launch.py::test_busy_port_29500_does_not_matter, that launch cannot start."""
    import faultcases as fc
    from stnb.processes import launcher

    monkeypatch.setattr(launcher, "free_port", lambda *a, **kw: 29500)
    with fc.busy_port(29500):
        assert fc.port_busy(29500)
        with pytest.raises((stnb.LaunchError, stnb.ConfigError)) as e:
            fc.cpu_launch(os.getpid, num_processes=2, echo=False, timeout=120)
    assert "29500" in str(e.value), str(e.value)[:2000]
