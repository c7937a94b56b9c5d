"""What a rank returns is a typed RankReport: a rank's record cannot go missing on the way to the merged
RunResult, and the report crosses a spawned launch as itself."""

from __future__ import annotations

from dataclasses import asdict

import pytest

import stnb
from stnb.models import tiny_path
from stnb.rankreport import RankReport
from stnb.results import merge

REQUIRED = dict(rank=0, device="cpu", global_batch_size=4, step_times=[1.0, 1.0], losses=[0.5, 0.4],
                verification={"ok": True, "problems": [], "world_size_seen": 1, "local_param_count": 5,
                              "total_param_count": 5},
                peak_memory_bytes=1, weight_digests={})


def _cfg():
    return stnb.TrainConfig(strategy="single", model="tiny", steps=2, per_device_batch_size=4, train_size=16,
                            dev_size=8, evaluate=False, device="cpu", warmup_steps_excluded=0)


def test_a_report_without_its_verification_record_cannot_be_built():
    """Fail closed: no default stands in for a rank's record, and a record of the wrong type is refused."""
    with pytest.raises(TypeError, match="verification"):
        RankReport(**{k: v for k, v in REQUIRED.items() if k != "verification"})
    with pytest.raises(TypeError, match="verification record"):
        RankReport(**dict(REQUIRED, verification=None))
    with pytest.raises(TypeError, match="unexpected keyword argument 'weights_digest'"):  # a misspelt field
        RankReport(**REQUIRED, weights_digest={})
    assert merge(_cfg(), [RankReport(**REQUIRED)], device="cpu").verified


def test_merge_refuses_what_is_not_a_rank_report():
    """A plain dict (what train_rank returned before, or a rank's own value) is refused by name, with the
    fix, instead of merging with fields read as missing."""
    report = RankReport(**REQUIRED)
    with pytest.raises(TypeError, match=r"item 1 of the ranks' results is a dict, not a stnb.rankreport.RankReport"):
        merge(_cfg(), [report, asdict(report)], device="cpu")
    with pytest.raises(ValueError, match="no rank reported"):
        merge(_cfg(), [], device="cpu")


def test_train_rank_reports_across_a_spawned_launch():
    """A spawned rank (a fresh interpreter) sends its RankReport back pickled; it arrives as a RankReport
    whose record merges as verified, with the start method the rank itself observed."""
    from stnb.builds import RecipeBuild
    from stnb.training import train_rank

    cfg = _cfg()
    reports = stnb.launch(train_rank, cfg, RecipeBuild(tiny_path()), None, 1, num_processes=1, device="cpu", start_method="spawn",
                          distributed=False,
                          timeout=300, echo=False)
    assert [type(r) for r in reports] == [RankReport]
    (r,) = reports
    assert r.start_method == "spawn" and r.start_method_requested == "spawn"
    assert len(r.step_times) == cfg.steps and r.verification["ok"] is True
    assert r.verification["loss_model"]["ok"] is True and r.verification["trained_parameters"]["model"] > 0
    # every instrument attached, in its order, and each reported its part
    from stnb import instruments

    kinds = list(instruments.BUILT_IN)
    assert r.verification["callbacks"]["added"] == ["LossParameterSyncCallback",
                                                    *(k.__name__ for k in instruments.order(kinds))]
    assert len(r.train_flops) == len(r.time_split["steps"]) == len(r.losses) == cfg.steps
    assert r.memory_split["built"] > 0 and r.peak_memory_bytes > 0 and r.model_shape["optimizer"]
    assert r.loss_inputs == {"texts": 2, "label": True} and r.data_columns and r.time_to_first_step_s > 0
    res = merge(cfg, reports, device="cpu")
    assert res.verified, res.reason
    assert res.start_method == "spawn" and res.verification["ranks"] == [r.verification]


def test_every_check_of_a_rank_reaches_its_one_verification_record():
    """The record is composed in one place (``instruments.record``) from what the rank's instruments
    observed: a problem found at the first optimizer step, a loss that never called the module that trains,
    a first batch other than the one asked for (``LossInputs``, from the rows the loss really received),
    each one lands in ``problems`` (in the order training found them) and turns ``ok`` off; every
    instrument's entries land beside them; a rank where no step began has an empty record, which merges as
    never verified."""
    import types

    import torch

    from stnb.instruments import AllocatorRelease, FirstStepChecks, LossInputs, record

    def checks(**kw):
        c = FirstStepChecks(None, None, None, world_size_requested=2, process_group_size=2, loss_sync=None)
        c.prepared = {"strategy": "ddp", "world_size_seen": 2, "problems": [], "ok": True}
        c.loss_model = {"trains": "DistributedDataParallel", "rebound": [], "calls_in_first_step": 1, "ok": True}
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    class Loss(torch.nn.Module):
        def forward(self, features, labels):
            return torch.zeros(())

    def loss_inputs(rows: int, asked: int | None = 4):
        trainer = types.SimpleNamespace(loss=Loss(), args=types.SimpleNamespace(n_gpu=0), train_dataset=list(range(16)))
        instrument = LossInputs(trainer, asked)
        pair = [{"input_ids": torch.ones(rows, 5, dtype=torch.long)} for _ in range(2)]
        trainer.loss(pair, torch.ones(rows))  # the loss's first call: its hook records what it received
        trainer.loss(pair[:1], None)  # later calls change nothing
        return instrument

    allocator = AllocatorRelease(reuse_freed_memory=False, cuda=False, gathers_during_step=False)
    facts = {"wrapper_kind": "ddp", "callbacks": {"added": ["StepLog"]}}
    good = checks(step_check=({"grads_sharded": False}, []), trained_parameters={"model": 3})
    first = loss_inputs(rows=4)
    assert first.report()["loss_inputs"] == {"texts": 2, "label": True} and first.first_batch_rows == 4
    v = record([good, allocator, first], facts)
    assert v["ok"] is True and v["problems"] == [] and v["grads_sharded"] is False and v["wrapper_kind"] == "ddp"
    assert v["trained_parameters"] == {"model": 3} and v["callbacks"] == {"added": ["StepLog"]}
    assert v["batch_override"] == {"asked": 4, "first_batch_rows": 4, "ok": True}
    assert v["reuse_freed_memory"] == {"applied": False, "reason": "off (reuse_freed_memory=False)"}
    assert v["released_each_step"] is None and v["loss_model"]["ok"] is True

    bad = checks(step_check=({}, ["the optimizer updates 1 parameter(s) that neither the model nor the loss own"]),
                 loss_model={"trains": "DistributedDataParallel", "rebound": [], "calls_in_first_step": 0, "ok": False})
    v = record([bad, allocator, loss_inputs(rows=2)], {})
    assert v["ok"] is False and len(v["problems"]) == 3
    assert v["problems"][0].startswith("the optimizer updates 1 parameter(s)")
    assert v["problems"][1].startswith("the loss never called the DistributedDataParallel that trains")
    assert v["problems"][2] == ("per_device_train_batch_size was overridden to 4, but the loss's first batch "
                                "had 2 rows")
    assert "batch_override" not in record([checks(), loss_inputs(rows=2, asked=None)], {})  # nothing overridden
    # fp16's loss scaler skipped the first steps: checked at the first that updated; skipped all: not verified
    assert v["steps_skipped_before_step_check"] == 0 and record([good], {})["steps_skipped_before_step_check"] == 0
    assert record([checks(step_check=({}, []), skipped_steps=2)], {})["ok"] is True
    skipped = record([checks(skipped_steps=3)], {})
    assert skipped["ok"] is False and skipped["problems"] == [
        "the loss scaler skipped every optimizer step (3: inf/nan gradients under fp16), so nothing was updated and "
        "the strategy's step check never ran; train more steps, lower the learning rate, or use bf16"]
    assert record([checks()], {})["ok"] is True  # no optimizer step at all (a step that never ended): not this
    with pytest.raises(ValueError, match=r"AllocatorRelease gives the verification entries \['reuse_freed_memory'\]"):
        record([good, allocator], {"reuse_freed_memory": "a fact"})  # one entry, two sources: refused
    never = record([allocator, first, checks(prepared=None)], facts)
    assert never == {}
    res = merge(_cfg(), [RankReport(**dict(REQUIRED, verification=never))], device="cpu")
    assert not res.verified and "no training step began" in res.reason


def test_each_instrument_reports_its_own_fields():
    """The instruments' parts of the report are disjoint: a field two of them reported would be decided by
    whichever came last; ``reports`` refuses it, naming both."""
    from stnb.instruments import reports
    from stnb.instruments.base import Instrument

    class A(Instrument):
        def report(self):
            return {"losses": [1.0], "step_times": [0.5]}

    class B(Instrument):
        def report(self):
            return {"losses": [2.0]}

    assert reports([A()]) == {"losses": [1.0], "step_times": [0.5]}
    with pytest.raises(ValueError, match=r"B reports \['losses'\], already reported"):
        reports([A(), B()])
