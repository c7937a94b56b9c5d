"""What the memory budget tells a user, word for word, and how it holds in this process (stnb.budget, issue 45).

The refusal before launch (which strategies fit the budget, on how many ranks), the out-of-memory explanation a
rank raises (the budget, what it held, the prediction, the peak, what would fit), what counts as running out, the
model folder read without loading it, and the limit applied and taken back (RLIMIT_DATA, in this process and in a
forked one). The real 2-rank runs under a budget are in tests/test_memory_budget.py. The model is made up: one
million fp32 parameters trained with AdamW, whose model state is easy to say (16 MB on one device, 20 MB under
DDP with its buckets)."""

from __future__ import annotations

import os
import resource
from types import SimpleNamespace

import pytest

from stnb import ConfigError, TrainConfig, budget, memory, strategies
from stnb.errors import OutOfMemory
from stnb.strategies.base import Strategy
from stnb.training import Here

MIB, GIB = 2**20, 2**30
MILLION = {"param_count": 1_000_000, "trainable_param_count": 1_000_000, "bytes_per_param": 4, "optimizer": "adamw"}
CPU = "the whole rank process: its private writable memory (VmData), limited by RLIMIT_DATA"


def _config(strategy: str, budget_bytes: int | None, **kw) -> TrainConfig:
    return TrainConfig(strategy=strategy, memory_budget_gib=None if budget_bytes is None else budget_bytes / GIB, **kw)


def _refusal(strategy: str, budget_bytes: int, world: int = 2, **kw):
    return budget.refusal(_config(strategy, budget_bytes, **kw), MILLION, world, "cpu")


# ---- the refusal before any rank starts -----------------------------------------------------------------------

def test_a_budget_that_holds_the_model_state_exactly_is_not_refused():
    """DDP on 2 ranks holds 20,000,000 bytes of model state: a budget of exactly that passes, one byte less not."""
    assert _refusal("ddp", 20_000_000) is None
    assert _refusal("ddp", 19_999_999) is not None
    assert budget.refusal(_config("ddp", None), MILLION, 2, "cpu") is None  # no budget
    assert _refusal("ddp", 1000) is not None
    assert budget.refusal(_config("ddp", 1000), None, 2, "cpu") is None  # nothing to predict from (a hub id)


def test_the_refusal_names_every_sharding_strategy_that_fits_on_these_ranks():
    """zero2 holds exactly 10,000,000 bytes on 2 ranks and fsdp 8,000,000: both fit 10,000,000, zero1 (16 MB) not."""
    assert _refusal("ddp", 10_000_000) == (
        "memory_budget_gib=0.00931323 (9.5 MiB per rank) is below the model state one rank holds under strategy "
        "'ddp' on 2 rank(s): stnb.memory.predict says 19.1 MiB (params 3.8 MiB, grads 3.8 MiB, optimizer_state "
        "7.6 MiB, ddp_buckets 3.8 MiB), and activations and the runtime (Python, torch) come on top. It fits under "
        "strategy='zero2' (9.5 MiB per rank on 2), strategy='fsdp' (7.6 MiB per rank on 2); or raise "
        "memory_budget_gib.")


def test_a_one_process_run_is_offered_sharding_on_two_ranks_and_a_larger_run_on_its_own_ranks():
    assert _refusal("single", 10_000_000, world=1).endswith(
        "under strategy 'single' on 1 rank(s): stnb.memory.predict says 15.3 MiB (params 3.8 MiB, grads 3.8 MiB, "
        "optimizer_state 7.6 MiB), and activations and the runtime (Python, torch) come on top. It fits under "
        "strategy='zero2' (9.5 MiB per rank on 2), strategy='fsdp' (7.6 MiB per rank on 2); or raise "
        "memory_budget_gib.")
    assert "It fits under strategy='zero2' (7.6 MiB per rank on 3), strategy='fsdp' (5.1 MiB per rank on 3); " in \
        _refusal("ddp", 8_000_001, world=3)  # zero2 holds 8,000,001 bytes on 3 ranks: it fits, exactly


def test_the_configs_own_options_count_for_its_strategy_only():
    """gradient_as_bucket_view=True: DDP's gradients live in its buckets (16 MB, not 20); zero1 takes the option too,
    but the prediction for another strategy than the run's is that strategy's default."""
    config = _config("zero1", 16_000_000, gradient_as_bucket_view=True)
    assert budget.predicted(config, MILLION, "zero1", 2) == memory.predict("zero1", 1_000_000, 2,
                                                                           gradient_as_bucket_view=True)
    assert budget.predicted(config, MILLION, "zero1", 2)["total"] == 12_000_000
    assert budget.predicted(config, MILLION, "ddp", 2)["total"] == 20_000_000
    assert budget.predicted(config, MILLION, "single", 4)["total"] == 16_000_000  # one process whatever the world
    assert budget.predicted(config, MILLION, "fsdp", 4)["total"] == 4_000_000
    shape = {**MILLION, "trainable_param_count": 500_000, "bytes_per_param": 2, "optimizer": "sgd"}
    assert budget.predicted(config, shape, "ddp", 2) == memory.predict("ddp", 1_000_000, 2, 500_000,
                                                                       bytes_per_param=2, optimizer="sgd")


def test_no_strategy_fitting_these_ranks_names_the_fewest_ranks_each_would_need():
    """7,000,000 bytes: fsdp fits from 3 ranks (5.3 MB), zero2 from exactly 4 (7.0 MB), zero1 never (its
    parameters, gradients and buckets stay whole). The run's own strategy comes first when it shards."""
    assert _refusal("fsdp", 7_000_000).endswith(
        "No strategy fits it on 2 rank(s); with more ranks, strategy='fsdp' from num_processes=3, strategy='zero2' "
        "from num_processes=4; or raise memory_budget_gib.")
    assert _refusal("ddp", 7_000_000).endswith(  # ddp shards nothing: more ranks never help it
        "No strategy fits it on 2 rank(s); with more ranks, strategy='zero2' from num_processes=4, strategy='fsdp' "
        "from num_processes=3; or raise memory_budget_gib.")
    assert _refusal("zero2", 7_000_000).endswith(
        "'zero2' on 2 rank(s): stnb.memory.predict says 9.5 MiB (params 1.9 MiB, grads 1.9 MiB, optimizer_state "
        "3.8 MiB, gathered_params 1.9 MiB), and activations and the runtime (Python, torch) come on top. No strategy "
        "fits it on 2 rank(s); with more ranks, strategy='zero2' from num_processes=4, strategy='fsdp' from "
        "num_processes=3; or raise memory_budget_gib.")


def test_the_runs_own_strategy_on_more_ranks_keeps_its_options():
    """DeepSpeed's ZeRO stage 2 (its default) shards the gradients and the optimizer's 12 bytes a parameter: 7,000,000
    bytes from 6 ranks; stage 3 shards the parameters too: from 3."""
    tail = "strategy='zero2' from num_processes=4, strategy='fsdp' from num_processes=3; or raise memory_budget_gib."
    assert _refusal("deepspeed", 7_000_000).endswith(
        "with more ranks, strategy='deepspeed' from num_processes=6, " + tail)
    assert _refusal("deepspeed", 7_000_000, stage=3).endswith(
        "with more ranks, strategy='deepspeed' from num_processes=3, " + tail)


def test_where_no_sharding_strategy_runs_none_is_offered():
    """The strategies offered are those that run on the run's device: this machine's GPUs (none here: on a CPU-only
    machine no multi-rank strategy runs on 'cuda')."""
    from stnb.hardware import strategy_availability

    runs = strategy_availability("cuda")
    fits = [n for n in ("zero2", "fsdp") if runs[n]["runnable"]]
    said = budget.refusal(_config("ddp", 10_000_000), MILLION, 2, "cuda")
    if fits:  # a machine with GPUs
        assert "It fits under " in said and all(f"strategy={n!r} (" in said for n in fits)
    else:
        assert said.endswith("come on top. No strategy fits it on up to 1024 ranks; or raise memory_budget_gib.")
        assert budget._others(_config("ddp", GIB), 2, "cuda") == []
        with pytest.raises(ConfigError, match="No strategy fits it on up to 1024 ranks"):
            budget.Budget(_config("ddp", 10_000_000), _here(cuda=True), SimpleNamespace(model_shape=MILLION),
                          recipe=True).check_model()
        with pytest.raises(ConfigError, match="No strategy fits it on up to 1024 ranks"):
            budget.refuse(_config("ddp", 10_000_000), MILLION, 2, "cuda")
        assert "a strategy that holds" not in _budget(cuda=True).explain(MemoryError())


def test_a_budget_no_strategy_fits_on_any_number_of_ranks_says_so():
    """1,000 bytes: fsdp on 1,024 ranks still holds 15,627 (each part's share rounded up), on 1,023 15,643."""
    assert budget.MAX_RANKS == 1024
    assert _refusal("fsdp", 1000).endswith(
        "come on top. No strategy fits it on up to 1024 ranks; or raise memory_budget_gib.")
    assert budget._ranks_that_fit(_config("fsdp", 15_643), MILLION, "fsdp", 2, 15_643) == 1023
    assert budget._ranks_that_fit(_config("fsdp", 15_627), MILLION, "fsdp", 2, 15_627) == 1024
    assert budget._ranks_that_fit(_config("fsdp", 15_626), MILLION, "fsdp", 2, 15_626) is None
    assert budget._ranks_that_fit(_config("fsdp", 8_000_000), MILLION, "fsdp", 1, 8_000_000) == 2  # above the world


class _Sharding(Strategy):
    """A made-up strategy that shards its optimizer state and needs 4 ranks."""

    name, label, summary = "quarter", "quarter", "shards the optimizer state over 4 ranks (a test)"
    distributed, min_ranks, sharded = True, 4, frozenset({"optimizer_state"})

    def available(self, device, n_gpu, max_ranks, backend):
        return True, ""

    def check_prepared(self, trainer, world_size):
        return {}, []

    def check_ranks(self, rank_results, world_size):
        return {}, []


class _Elsewhere(_Sharding):
    name, label, min_ranks = "elsewhere", "elsewhere", 2

    def available(self, device, n_gpu, max_ranks, backend):
        return False, "needs hardware this machine lacks (a test)"


@pytest.fixture
def made_up():
    strategies.register(_Sharding)
    strategies.register(_Elsewhere)
    yield
    strategies.unregister("quarter")
    strategies.unregister("elsewhere")


def test_the_strategies_offered_shard_something_run_here_and_get_the_ranks_they_need(made_up):
    assert budget._others(_config("ddp", GIB), 2, "cpu") == [("zero1", 2), ("zero2", 2), ("fsdp", 2), ("quarter", 4)]
    assert budget._others(_config("fsdp", GIB), 1, "cpu") == [("zero1", 2), ("zero2", 2), ("quarter", 4)]
    assert budget._others(_config("ddp", GIB), 5, "cpu") == [("zero1", 5), ("zero2", 5), ("fsdp", 5), ("quarter", 5)]


# ---- what a rank says when it ran out --------------------------------------------------------------------------

def _here(rank=1, world=2, cuda=False):
    return Here(ctx=None, launch_time=0.0, requested=world, cuda=cuda, distributed=world > 1, rank=rank, world=world,
                device="cuda" if cuda else "cpu", n_gpu=int(cuda))


def _budget(strategy="ddp", *, shape=MILLION, batch=None, trainer_batch=None, recipe=True, cuda=False, held=900):
    """A Budget whose readings are given: held (MiB) now, 500 MiB when applied, a peak of 300 MiB over a start of
    100 MiB (the CPU's resident growth, made whole by adding the start)."""
    config = TrainConfig(strategy=strategy, memory_budget_gib=1, **({} if batch is None else
                                                                     {"per_device_batch_size": batch}))
    trainer = None if trainer_batch is None else SimpleNamespace(args=SimpleNamespace(
        per_device_train_batch_size=trainer_batch))
    peak = SimpleNamespace(peak=lambda: 300 * MIB, base=100 * MIB, cuda=cuda,
                           method="cuda max_memory_allocated" if cuda else "resident high-water mark (VmHWM) growth")
    b = budget.Budget(config, _here(cuda=cuda), SimpleNamespace(model_shape=shape, trainer=trainer, peak=peak), recipe)
    b._held = lambda: held * MIB
    b.record = {"limit_bytes": b.bytes, "how": CPU, "held_at_start": 500 * MIB}
    return b


def test_an_out_of_memory_rank_names_the_budget_what_it_held_the_prediction_its_peak_and_what_fits():
    e = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2097152 bytes.")
    assert _budget(batch=16).explain(e) == (
        f"rank 1 ran out of its memory budget, memory_budget_gib=1 (1,024.0 MiB, {CPU}): an allocation of 2.0 MiB "
        "failed while it held 900.0 MiB (500.0 MiB already when the budget was applied, before its model was built: "
        "the runtime); the prediction (stnb.memory.predict) for strategy 'ddp' on 2 rank(s) is 19.1 MiB of model "
        "state per rank, activations and the runtime on top; its measured peak was 400.0 MiB (resident high-water "
        "mark (VmHWM)). What would fit: a smaller per-device batch, per_device_batch_size=8 (activations grow with "
        "the batch); a strategy that holds less model state per rank: strategy='fsdp' (7.6 MiB on 2 rank(s)), "
        "strategy='zero2' (9.5 MiB on 2 rank(s)), strategy='zero1' (15.3 MiB on 2 rank(s)); a larger "
        "memory_budget_gib.")


def test_before_its_model_was_built_there_is_no_prediction_and_no_strategy_to_offer():
    assert _budget(shape=None, batch=1, held=520).explain(MemoryError()) == (
        f"rank 1 ran out of its memory budget, memory_budget_gib=1 (1,024.0 MiB, {CPU}): it held 520.0 MiB (500.0 "
        "MiB already when the budget was applied, before its model was built: the runtime); it ran out before its "
        "model was built, so there is no prediction; its measured peak was 400.0 MiB (resident high-water mark "
        "(VmHWM)). What would fit: a larger memory_budget_gib.")


def test_a_users_trainer_is_told_its_own_batch_argument_and_the_trainers_batch_wins():
    fixes = _budget("fsdp", trainer_batch=9, recipe=False).explain(MemoryError()).split("What would fit: ")[1]
    assert fixes == ("a smaller per-device batch, override_args={'per_device_train_batch_size': 4} (activations grow "
                     "with the batch); a larger memory_budget_gib.")  # nothing holds less than fsdp's 7.6 MiB
    fixes = _budget("zero2", batch=32, trainer_batch=6).explain(MemoryError()).split("What would fit: ")[1]
    assert fixes == ("a smaller per-device batch, per_device_batch_size=3 (activations grow with the batch); a "
                     "strategy that holds less model state per rank: strategy='fsdp' (7.6 MiB on 2 rank(s)); a larger "
                     "memory_budget_gib.")
    assert _budget(recipe=False).explain(MemoryError()).endswith(  # a build function's rank before its trainer
        "What would fit: a strategy that holds less model state per rank: strategy='fsdp' (7.6 MiB on 2 rank(s)), "
        "strategy='zero2' (9.5 MiB on 2 rank(s)), strategy='zero1' (15.3 MiB on 2 rank(s)); a larger "
        "memory_budget_gib.")


def test_a_batch_of_two_is_halved_and_a_strategy_holding_as_much_is_not_offered(made_up):
    """zero2 on 2 ranks holds 10,000,000 bytes, the made-up 'quarter' on its 4 ranks as much: only fsdp holds less."""
    fixes = _budget("zero2", batch=2).explain(MemoryError()).split("What would fit: ")[1]
    assert fixes == ("a smaller per-device batch, per_device_batch_size=1 (activations grow with the batch); a "
                     "strategy that holds less model state per rank: strategy='fsdp' (7.6 MiB on 2 rank(s)); a larger "
                     "memory_budget_gib.")
    assert budget.predicted(_config("zero2", GIB), MILLION, "quarter", 4)["total"] == 10_000_000


def test_on_a_gpu_the_peak_is_the_allocators_alone():
    said = _budget(cuda=True).explain(MemoryError())
    assert "(1,024.0 MiB, torch's caching allocator on the rank's GPU (torch.cuda.set_per_process_memory_fraction))" \
        in said
    assert "its measured peak was 300.0 MiB (cuda max_memory_allocated). " in said


def test_what_counts_as_running_out_of_memory_and_what_does_not():
    torch_cuda = type("OutOfMemoryError", (RuntimeError,), {})
    for e in (MemoryError(), OutOfMemory("x"), torch_cuda("CUDA error"),
              RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"),
              RuntimeError("CUDA out of memory."), RuntimeError("std::bad_alloc"),
              OSError(12, "Cannot allocate memory"), RuntimeError("can't start new thread")):
        assert budget.out_of_memory(e), repr(e)
    for e in (None, RuntimeError("shape mismatch"), ValueError("out of memory"), KeyError("bad_alloc")):
        assert not budget.out_of_memory(e), repr(e)
    outer = ValueError("a library's own error")
    outer.__cause__ = MemoryError()
    assert budget.out_of_memory(outer)  # raised from one
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert not budget.out_of_memory(a)  # a cycle ends


def test_the_failed_allocation_is_read_from_torchs_message_in_every_unit():
    asked = {"you tried to allocate 1048576 bytes.": "an allocation of 1.0 MiB failed",
             "Tried to allocate 20.00 MiB (GPU 0)": "an allocation of 20.0 MiB failed",
             "Tried to allocate 512 KiB": "an allocation of 0.5 MiB failed",
             "Tried to allocate 1.50 GiB": "an allocation of 1,536.0 MiB failed",
             "tried to allocate 3bytes": "an allocation of 0.0 MiB failed",
             "CUDA out of memory.": ""}
    assert {m: budget._asked(RuntimeError(m)) for m in asked} == asked


# ---- the model folder, read without loading it ----------------------------------------------------------------

def test_the_model_folder_is_counted_from_every_safetensors_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "1_Dense").mkdir()
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    save_file({"w": torch.zeros(2, 3, 7)}, str(tmp_path / "1_Dense" / "model.safetensors"))
    assert budget.shape_from_files(str(tmp_path)) == {"param_count": 59, "trainable_param_count": 59,
                                                      "bytes_per_param": 4, "optimizer": "adamw"}
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    assert budget.shape_from_files(str(bin_only)) is None
    assert budget.shape_from_files("sentence-transformers/all-MiniLM-L6-v2") is None  # a hub id
    assert budget.shape_from_files(str(tmp_path / "model.safetensors")) is None  # a file, not a folder


# ---- the limit, applied and taken back ---------------------------------------------------------------------------

def _live(room: int, strategy="ddp"):
    """A Budget for this process, ``room`` bytes above what it holds now (VmData)."""
    held = memory.proc_status("VmData")
    config = TrainConfig(strategy=strategy, memory_budget_gib=(held + room) / GIB)
    use = SimpleNamespace(model_shape=None, trainer=None,
                          peak=SimpleNamespace(peak=lambda: 0, base=0, cuda=False, method="VmHWM growth"))
    return budget.Budget(config, _here(rank=0, world=1), use, recipe=True), held


def test_without_a_budget_nothing_is_limited_or_reported():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    b = budget.Budget(TrainConfig(), _here(), SimpleNamespace(model_shape=None), recipe=True)
    with b.enforced():
        assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert b.report() == {}


def test_the_limit_holds_inside_and_is_taken_back_after():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    b, held = _live(2 * GIB)
    with b.enforced():
        assert resource.getrlimit(resource.RLIMIT_DATA) == (b.bytes, before[1])
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    report = b.report()
    assert report["limit_bytes"] == b.bytes and report["how"] == CPU
    assert abs(report["held_at_start"] - held) < 64 * MIB and abs(report["held_at_end"] - held) < 256 * MIB
    assert abs(b._held() - memory.proc_status("VmData")) < 64 * MIB


def test_without_proc_what_is_held_reads_as_nothing(monkeypatch):
    b, _ = _live(GIB)
    monkeypatch.setattr(memory, "proc_status", lambda key: None)  # no /proc (not Linux)
    assert b._held() == 0


def test_on_a_gpu_what_is_held_is_what_the_allocator_reserved():
    import torch

    b = budget.Budget(_config("ddp", GIB), _here(cuda=True), SimpleNamespace(model_shape=None), recipe=True)
    assert b._held() == torch.cuda.memory_reserved()  # (0 on a machine without a GPU: nothing reserved)


def test_an_allocation_past_the_limit_is_out_of_memory_and_the_limit_is_taken_back_first():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    b, _ = _live(512 * MIB)
    with pytest.raises(OutOfMemory, match=r"^rank 0 ran out of its memory budget, memory_budget_gib=") as e:
        with b.enforced():
            bytearray(2 * GIB)
    assert isinstance(e.value.__cause__, MemoryError)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_any_error_close_to_the_limit_is_out_of_memory_but_a_refusal_stays_a_refusal():
    """Within budget.NEAR of the limit an allocation anywhere may fail as anything (a C extension's SystemError):
    taken for running out. Far from it, the error is the rank's own; a ConfigError is a refusal wherever."""
    b, _ = _live(512 * MIB)
    with pytest.raises(OutOfMemory):
        with b.enforced():
            hold = bytearray(480 * MIB)  # within NEAR (64 MiB) of the limit, still under it
            raise SystemError("error return without exception set")
    del hold
    b, _ = _live(512 * MIB)
    with pytest.raises(ConfigError, match="a refusal"):
        with b.enforced():
            hold = bytearray(480 * MIB)
            raise ConfigError("a refusal")
    del hold
    b, _ = _live(2 * GIB)
    with pytest.raises(SystemError, match="its own"):
        with b.enforced():
            raise SystemError("its own")


def test_a_budget_the_runtime_already_holds_is_said_at_once_and_never_applied():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    b, held = _live(budget.NEAR - 16 * MIB)
    with pytest.raises(OutOfMemory, match="the runtime") as e:
        with b.enforced():
            pytest.fail("the block ran under a budget the runtime already held")
    assert "before its model was built, so there is no prediction" in str(e.value)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert b.report()["limit_bytes"] == b.bytes and abs(b.report()["held_at_start"] - held) < 64 * MIB


def test_a_lower_hard_limit_is_the_one_applied():
    """A process whose hard RLIMIT_DATA is below the budget (set by an administrator) is limited by it, and says so.
    In a forked process: a hard limit cannot be raised again without root."""
    import json

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lower its hard limit, apply a budget above it, report what it saw
        try:
            b, held = _live(2 * GIB)
            hard = held + GIB
            resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
            with b.enforced():
                inside = resource.getrlimit(resource.RLIMIT_DATA)
            out = {"hard": hard, "inside": inside, "after": resource.getrlimit(resource.RLIMIT_DATA),
                   "limit": b.report()["limit_bytes"]}
        except BaseException as e:  # noqa: BLE001 - told to the parent
            out = {"error": repr(e)}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        got = json.loads(f.read())
    os.waitpid(pid, 0)
    assert "error" not in got, got
    assert got["limit"] == got["hard"] and got["inside"] == [got["hard"]] * 2 and got["after"] == [got["hard"]] * 2


def test_check_model_refuses_a_built_model_the_budget_cannot_hold():
    use = SimpleNamespace(model_shape=MILLION, trainer=None)
    budget.Budget(_config("ddp", 20_000_000), _here(), use, recipe=False).check_model()  # holds it
    with pytest.raises(ConfigError, match=r"^memory_budget_gib=0.0186265 \(19.1 MiB per rank\) is below"):
        budget.Budget(_config("ddp", 19_999_999), _here(), use, recipe=False).check_model()
