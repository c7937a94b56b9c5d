"""strategy='deepspeed' (DeepSpeed ZeRO 1/2 through the trainer's own integration) on 2 gloo CPU ranks:
verified from the engine, side by side with the native stage of the same number, from stnb's recipe,
the CLI and a user's build function; and the bad input refused before any process starts.

Every run is real (the tiny model, a few steps). DeepSpeed's CPU op is built once per environment
(``make install``; else ``rank_env`` builds it before the first launch), and each launch loads a copy.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

import faultcases as fc
import stnb
from stnb import ConfigError, TrainConfig
from stnb.models import tiny_path

pytest.importorskip("deepspeed", reason='the dev extra installs deepspeed (pip install "stnb[deepspeed]")')

# lr 1e-3 so that the training moves the weights far beyond the tolerance the losses are compared with
SIDE = dict(model="tiny", num_processes=2, device="cpu", steps=6, per_device_batch_size=4, learning_rate=1e-3,
            train_size=64, dev_size=16, warmup_steps_excluded=1, evaluate=False, threads_per_rank=1, timeout=600,
            stall_timeout=300)
# DeepSpeed's ZeRO optimizer updates a flat fp32 copy of the partition with the trainer's own torch AdamW
# (no DeepSpeed optimizer section): the same update as the native stage, summed in a different order.
# Measured on the 2-core CPU machine: losses apart by at most 3e-7 (relative) over 6 steps.
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def runs():
    """{(strategy, stage): RunResult}, each run once for the module."""
    cache = {}

    def get(strategy, stage=None):
        key = (strategy, stage)
        if key not in cache:
            extra = {"stage": stage} if strategy == "deepspeed" else {}
            cache[key] = stnb.run(TrainConfig(strategy=strategy, **SIDE, **extra), echo=False)
        return cache[key]

    return get


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_stage_verified_from_the_engine(runs, stage):
    r = runs("deepspeed", stage)
    assert r.verified and r.world_size == 2, r.verification.get("problems")
    ranks = r.verification["ranks"]
    for v in ranks:
        assert v["wrapper"] == "DeepSpeedEngine" and v["backend"] == "gloo"
        assert v["zero_stage_asked"] == v["zero_stage_seen"] == stage
        assert v["partition_gradients"] is (stage >= 2)
        # this rank's optimizer partition: AdamW's two moments over its fp32 half, no more
        assert v["state_numel"] == 2 * v["partition_numel"]
        assert v["grads_whole_grad_numel"] == 0 and v["grads_partition_grad_numel"] == v["partition_numel"]
    if stage < 3:
        assert r.verification["weights_identical_across_ranks"] is True
        assert r.verification["weights_tensors_compared"] > 30  # every parameter of the engine's module
    else:  # every parameter partitioned: this rank's piece is half, and the pieces add up to the model
        assert all(v["ds_partitioned_params"] > 30 and v["local_param_fraction"] == pytest.approx(0.5, abs=0.01)
                   for v in ranks)
        assert r.verification["shards_add_up"] is True
    assert r.verification["optimizer_partition_fractions"] == [pytest.approx(0.5, abs=0.01)] * 2
    trainable = ranks[0]["trainable_numel"]
    for mb in r.memory_breakdown:  # AdamW's 2 moments + the fp32 master copy, over half the parameters
        assert mb["optimizer_state"] == pytest.approx(3 * 4 * trainable / 2, rel=0.01)
        assert mb["grads"] == pytest.approx(4 * trainable / 2, rel=0.01)
        # stage 3: half, plus the small parameters ZeRO-3 keeps whole on every rank (param_persistence_threshold)
        want, tol = (4 * r.total_param_count, 0.01) if stage < 3 else (4 * r.total_param_count / 2, 0.15)
        assert mb["params"] == pytest.approx(want, rel=tol)
    # the prediction for this stage (memory.predict(..., stage=)) against what the ranks measured
    cmp = stnb.memory.compare(r)
    opt = cmp[cmp["component"] == "optimizer_state"]["measured_over_predicted"]
    assert len(opt) == 2 and all(x == pytest.approx(1.0, abs=0.01) for x in opt)
    grads = cmp[cmp["component"] == "grads"]["measured_over_predicted"]
    # at the step every stage holds the gradient partition; stage 1's prediction is ZeRO's whole gradients
    assert all(x == pytest.approx(1.0 if stage >= 2 else 0.5, abs=0.01) for x in grads)


@pytest.mark.parametrize("stage, native", [(1, "zero1"), (2, "zero2"), (3, "fsdp")])
def test_deepspeed_trains_like_the_native_stage(runs, stage, native):
    ds, ref = runs("deepspeed", stage), runs(native)
    assert ds.verified and ref.verified
    assert len(ds.losses) == len(ref.losses) == SIDE["steps"]
    assert ds.losses == pytest.approx(ref.losses, rel=LOSS_RTOL), (ds.losses, ref.losses)
    assert max(ds.losses) - min(ds.losses) > 100 * LOSS_RTOL * max(ds.losses), "the losses did not move"
    # the ranks' optimizer states add up the same (DeepSpeed adds its fp32 master copy: 3 slots, not 2); per
    # rank DeepSpeed splits a flat buffer in halves, while ZeroRedundancyOptimizer (zero1) gives whole
    # parameters to a rank: the tiny model's word embeddings (95% of it) land on one rank
    ds_opt = [mb["optimizer_state"] for mb in ds.memory_breakdown]
    ref_opt = [mb["optimizer_state"] for mb in ref.memory_breakdown]
    assert sum(ds_opt) == pytest.approx(1.5 * sum(ref_opt), rel=0.01)
    assert ds_opt == [pytest.approx(sum(ds_opt) / 2, rel=0.01)] * 2
    print(f"\n{native} vs deepspeed stage {stage}: losses {ref.losses} / {ds.losses}; samples/s "
          f"{ref.samples_per_second:.1f} / {ds.samples_per_second:.1f}")


def test_cli_runs_deepspeed_stage_2():
    out = subprocess.run([sys.executable, "-m", "stnb", "run", "--strategy", "deepspeed", "--stage", "2", "--nproc", "2",
                          "--model", "tiny", "--steps", "3", "--batch-size", "4", "--no-eval", "--json",
                          "--device", "cpu", "--stall-timeout", "300"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["strategy"] == "deepspeed" and d["verified"] is True and d["config"]["stage"] == 2
    assert {v["zero_stage_seen"] for v in d["verification"]["ranks"]} == {2}



def test_torchrun_runs_deepspeed_stage_2(tmp_path):
    """`torchrun ... -m stnb run --strategy deepspeed`: each rank (stnb.launchers.external) gets what
    stnb.launch's ranks get, DeepSpeed's config and on CPU its CPU accelerator, so the trainer enables
    DeepSpeed (without it the rank refuses: "the trainer did not enable DeepSpeed")."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = subprocess.run([*torchrun, "-m", "stnb", "run", "--strategy", "deepspeed", "--stage", "2", "--model", "tiny",
                          "--steps", "3", "--batch-size", "4", "--no-eval", "--json", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert d["launcher"] == "torchrun" and d["world_size"] == 2
    assert d["strategy"] == "deepspeed" and d["verified"] is True and d["config"]["stage"] == 2
    assert {v["zero_stage_seen"] for v in d["verification"]["ranks"]} == {2}

# ---- a user's build function --------------------------------------------------------------------

def build_pairs(outdir: str, deepspeed=None, batch=4):
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments, losses)

    model = SentenceTransformer(tiny_path(), device="cpu")
    data = Dataset.from_dict({"anchor": [f"question {i}" for i in range(32)],
                              "positive": [f"answer {i}" for i in range(32)]})
    args = SentenceTransformerTrainingArguments(output_dir=outdir, per_device_train_batch_size=batch, max_steps=3,
                                                learning_rate=1e-3, logging_steps=1, report_to="none",
                                                save_strategy="no", seed=7, deepspeed=deepspeed)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                      loss=losses.MultipleNegativesRankingLoss(model))


BUILD = dict(num_processes=2, device="cpu", threads_per_rank=1, timeout=600, stall_timeout=300)


def test_a_users_trainer_gets_deepspeed_and_is_verified(tmp_path):
    """The build function never mentions DeepSpeed: the ranks' environment hands it to its arguments
    (as accelerate launch does), and the engine runs the stage asked."""
    r = stnb.run(functools.partial(build_pairs, str(tmp_path)), strategy="deepspeed", stage=2, echo=False, **BUILD)
    assert r.verified, r.verification.get("problems")
    assert {(v["wrapper"], v["zero_stage_seen"]) for v in r.verification["ranks"]} == {("DeepSpeedEngine", 2)}
    assert r.verification["weights_identical_across_ranks"] is True
    assert len(r.losses) == 3


def test_a_users_deepspeed_config_that_contradicts_the_stage_is_refused(tmp_path):
    ds = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 8}
    before = fc.descendants()
    with pytest.raises(stnb.StnbError) as ei:
        stnb.run(functools.partial(build_pairs, str(tmp_path), deepspeed=ds), strategy="deepspeed", stage=2,
                 echo=False, **BUILD)
    msg = str(ei.value)
    assert "zero_optimization.stage=1" in msg and "stage=2 was asked" in msg
    assert "train_micro_batch_size_per_gpu=8" in msg and "per-device batch is 4" in msg
    assert fc.new_descendants(before) == []


def test_deepspeed_in_a_users_arguments_under_ddp_is_refused(tmp_path):
    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto"}
    with pytest.raises(stnb.StnbError) as ei:
        stnb.run(functools.partial(build_pairs, str(tmp_path), deepspeed=ds), strategy="ddp", echo=False, **BUILD)
    assert "strategy='deepspeed'" in str(ei.value)


# ---- refused before any process starts --------------------------------------------------------------

BAD = [
    ("unknown-stage", dict(stage=4), ["unknown DeepSpeed ZeRO stage 4", "stage=1", "2 (+ gradients)", "3"]),
    ("stage-under-ddp", dict(strategy="ddp", stage=2), ["stage=2 is an option of deepspeed", "not of strategy 'ddp'"]),
    ("config-stage", dict(stage=2, deepspeed_config={"zero_optimization": {"stage": 3}}),
     ["zero_optimization.stage=3", "stage=2 was asked"]),
    ("config-batch", dict(stage=1, deepspeed_config={"train_micro_batch_size_per_gpu": 32}),
     ["train_micro_batch_size_per_gpu=32", "per-device batch is 16"]),
    ("config-accumulation", dict(stage=1, deepspeed_config={"gradient_accumulation_steps": 4}),
     ["gradient_accumulation_steps=4", "gradient_accumulation_steps is 1"]),
    ("config-precision", dict(stage=1, deepspeed_config={"bf16": {"enabled": True}}),
     ["bf16.enabled=True", "mixed precision is 'no'"]),
    ("config-not-a-dict", dict(stage=1, deepspeed_config="ds.json"), ["deepspeed_config must be a dict"]),
    ("bf16-on-cpu", dict(stage=1, mixed_precision="bf16"),  # transformers asks use_cpu, which accelerate refuses
     ["mixed_precision='bf16' with strategy='deepspeed' on CPU", "use strategy='zero1', 'zero2' or 'fsdp'"]),
]


@pytest.mark.parametrize("name, overrides, words", BAD, ids=[b[0] for b in BAD])
def test_bad_deepspeed_input_refused_before_any_process(name, overrides, words):
    cfg = TrainConfig(strategy="deepspeed", model="tiny", device="cpu", steps=3).replace(**overrides)
    before = fc.descendants()
    with fc.ChildSampler(before) as sampler:
        with pytest.raises(ConfigError) as ei:
            stnb.run(cfg, echo=False)
    for w in words:
        assert w in str(ei.value), f"{name}: {w!r} not in {ei.value}"
    assert not sampler.seen, f"{name}: a process was started before the refusal"


def test_deepspeed_not_installed_names_the_install_command():
    code = ("import sys; sys.modules['deepspeed'] = None\n"  # importlib.util.find_spec now finds no deepspeed
            "import stnb\n"
            "try:\n"
            "    stnb.run(stnb.TrainConfig(strategy='deepspeed', stage=2, model='tiny', device='cpu', steps=3), echo=False)\n"
            "except stnb.ConfigError as e:\n"
            "    print('REFUSED', e)\n"
            "print(stnb.strategies.availability('cpu', 0, 2, 'gloo')['deepspeed'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED" in out.stdout and 'pip install "stnb[deepspeed]"' in out.stdout
    assert "'runnable': False" in out.stdout


def build_softmax_loss(outdir: str):
    """SoftmaxLoss owns a classifier: parameters of the loss, not of the model DeepSpeed's engine wraps."""
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments, losses)

    model = SentenceTransformer(tiny_path(), device="cpu")
    data = Dataset.from_dict({"premise": [f"premise {i}" for i in range(32)],
                              "hypothesis": [f"hypothesis {i}" for i in range(32)], "label": [i % 3 for i in range(32)]})
    args = SentenceTransformerTrainingArguments(output_dir=outdir, per_device_train_batch_size=4, max_steps=3,
                                                report_to="none", save_strategy="no")
    loss = losses.SoftmaxLoss(model, model.get_embedding_dimension(), num_labels=3)
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)


def test_a_loss_with_its_own_parameters_is_refused_before_any_process_starts(tmp_path):
    """SoftmaxLoss's classifier is seen in the build function (its class's ``__init__`` makes an
    ``nn.Linear``), so the refusal comes in the cell, naming the strategies that keep it in sync."""
    before = fc.descendants()
    with pytest.raises(ConfigError) as ei:
        stnb.run(functools.partial(build_softmax_loss, str(tmp_path)), strategy="deepspeed", stage=2, echo=False,
                 **BUILD)
    msg = str(ei.value)
    assert "SoftmaxLoss" in msg and "strategy='zero1' or 'ddp'" in msg and "'deepspeed'" in msg
    assert fc.new_descendants(before) == []
    script = tmp_path / "train.py"
    with pytest.raises(ConfigError, match="SoftmaxLoss"):  # nor written as a script for torchrun
        stnb.export_script(functools.partial(build_softmax_loss, str(tmp_path)), script, strategy="deepspeed",
                           num_processes=2, echo=False)
    assert not script.exists()


class MaybeScaledLoss(torch.nn.Module):
    """In-batch negatives whose learnable scale exists only when asked: the build function's source cannot
    tell, so it is the ranks that find the loss's own parameter."""

    def __init__(self, model, learn_scale: bool = True):
        super().__init__()
        self.model = model
        if learn_scale:
            self.log_scale = torch.nn.Parameter(torch.tensor(3.0))

    def forward(self, features, labels):
        a, b = (self.model(f)["sentence_embedding"] for f in features)
        scores = torch.nn.functional.normalize(a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T
        return torch.nn.functional.cross_entropy(scores * self.log_scale.exp(), torch.arange(len(a)))


def build_maybe_scaled(outdir: str):
    trainer = build_pairs(outdir)
    trainer.loss = MaybeScaledLoss(trainer.model)
    return trainer


def test_a_loss_parameter_only_the_ranks_can_see_is_refused_there(tmp_path):
    from stnb.buildsource import read_objects
    from stnb.strategies.tensors import loss_classes_with_parameters

    build = functools.partial(build_maybe_scaled, str(tmp_path))
    assert loss_classes_with_parameters(read_objects(build)) == []  # under a condition: not seen in the cell
    before = fc.descendants()
    with pytest.raises(stnb.LaunchError) as ei:  # a BuildError in the ranks, carried by the launch
        stnb.run(build, strategy="deepspeed", stage=2, echo=False, **BUILD)
    msg = str(ei.value)
    assert "BuildError" in msg and "log_scale" in msg and "strategy='zero1' or 'ddp'" in msg
    assert fc.new_descendants(before) == []


def test_which_loss_classes_are_seen_owning_parameters():
    """Unconditional ``nn.Parameter`` / ``nn.Linear`` in ``__init__``: refused up front; an optional
    projection (MSELoss's ``projection_dim``) or none: left to the ranks, which see the instance."""
    from sentence_transformers.sentence_transformer import losses

    from stnb.strategies.tensors import loss_classes_with_parameters

    class TemperatureLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t = torch.nn.Parameter(torch.zeros(()))

    seen = {"losses.SoftmaxLoss": losses.SoftmaxLoss, "losses.MSELoss": losses.MSELoss,
            "losses.MultipleNegativesRankingLoss": losses.MultipleNegativesRankingLoss,
            "TemperatureLoss": TemperatureLoss, "MaybeScaledLoss": MaybeScaledLoss,
            "Linear": torch.nn.Linear}  # a module, not a loss
    assert loss_classes_with_parameters(seen) == ["SoftmaxLoss", "TemperatureLoss"]


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A killed JIT build leaves torch's ``lock`` file; every later build would wait on it forever."""
    import os
    import time

    from stnb.strategies import deepspeed_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = deepspeed_ops.build_dir()
    assert folder.startswith(str(tmp_path)) and folder.endswith("deepspeed_shm_comm")
    os.makedirs(folder)
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    said = []
    assert deepspeed_ops.remove_stale_lock(said.append) is False and os.path.exists(lock)  # a build may hold it
    old = time.time() - 10 * deepspeed_ops.STALE_LOCK_S
    os.utime(lock, (old, old))
    assert deepspeed_ops.remove_stale_lock(said.append) is True and not os.path.exists(lock)
    assert said and "stale DeepSpeed build lock" in said[0]


def _foreign_copy_of_the_op(tmp_path, monkeypatch) -> tuple:
    """The real op (built for this environment) copied under $TORCH_EXTENSIONS_DIR=tmp_path, then made
    what another virtualenv's build looks like: its build.ninja names that environment's torch and
    DeepSpeed, ninja's log holds the hashes of that environment's commands, and the .so is newer than
    every source. Returns (the folder, this environment's site-packages)."""
    import os
    import shutil

    import torch

    from stnb.strategies import deepspeed_ops

    assert deepspeed_ops.prebuild(print) in ("built", "was built")  # the real op, for this environment
    real = deepspeed_ops.build_dir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = deepspeed_ops.build_dir()
    shutil.copytree(real, folder, ignore=shutil.ignore_patterns("lock"))  # file times kept
    assert deepspeed_ops.why_not_built() == "", "a copy of this environment's build is built"
    site = os.path.dirname(os.path.dirname(torch.__file__))  # .../site-packages of this environment
    ninja = os.path.join(folder, "build.ninja")
    with open(ninja) as f:
        text = f.read()
    assert site in text
    with open(ninja, "w") as f:
        f.write(text.replace(site, "/opt/another-venv/lib/python3.11/site-packages"))
    # ninja's log keys each output on the hash of the command that built it: another environment's
    # commands (other paths) hash to other values than the ones this environment's build.ninja gives. The
    # link command's hash is made another's; the object files keep this environment's, so the rebuild
    # relinks where a foreign build would also recompile them (about a minute of a compiler, the build
    # make install already runs): what prebuild decides and torch's builder does are the same.
    log = os.path.join(folder, ".ninja_log")
    with open(log) as f:
        lines = f.read().splitlines()
    linked = [i for i, line in enumerate(lines) if line.split("\t")[-2:-1] == ["deepspeed_shm_comm.so"]]
    assert linked, lines
    for i in linked:  # every entry (ninja appends one per build and reads the last)
        lines[i] = lines[i].rsplit("\t", 1)[0] + "\t0123456789abcdef"
    with open(log, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.utime(os.path.join(folder, "deepspeed_shm_comm.so"))  # newer than every source
    return folder, site


def test_an_op_built_for_another_environment_is_not_taken_as_built(tmp_path, monkeypatch):
    """Issue 33: the file-time check took another virtualenv's build as built; torch's builder then writes
    this environment's build.ninja and ninja rebuilds, inside the ranks, where the stall watchdog ended
    the run. The check reads what torch's builder keys on: the build.ninja it would write here."""
    from stnb.strategies import deepspeed_ops

    _foreign_copy_of_the_op(tmp_path, monkeypatch)
    why = deepspeed_ops.why_not_built()
    assert not deepspeed_ops.built() and "another environment" in why and "/opt/another-venv" in why, why


def test_an_op_built_for_another_environment_is_built_again_before_launch(tmp_path, monkeypatch):
    """prebuild() (before every CPU launch) builds it again here, and torch's builder agrees it had to:
    the .so is replaced and the build.ninja names this environment (ninja relinks it: see the copy's log)."""
    import os

    from stnb.strategies import deepspeed_ops

    folder, site = _foreign_copy_of_the_op(tmp_path, monkeypatch)
    so = os.path.join(folder, "deepspeed_shm_comm.so")
    before = os.stat(so).st_mtime_ns
    said = []
    assert deepspeed_ops.prebuild(said.append) == "built"
    assert said and "another environment" in said[0]
    assert os.stat(so).st_mtime_ns != before  # torch's builder agreed: it built the op again
    with open(os.path.join(folder, "build.ninja")) as f:
        assert site in f.read() and deepspeed_ops.why_not_built() == ""


def test_each_environment_builds_the_op_in_a_folder_of_its_own(monkeypatch):
    """Two virtualenvs on one machine shared torch's ``py311_cpu`` folder and rebuilt each other's op in turn,
    inside the ranks (seen in a loaded run: a DeepSpeed run stalled on the build). Unless
    ``$TORCH_EXTENSIONS_DIR`` names a folder, stnb's folder carries the environment's own tag."""
    import os
    import sys

    from stnb.strategies import deepspeed_ops

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    here = deepspeed_ops.build_root()
    monkeypatch.setattr(sys, "prefix", "/opt/another-venv")
    other = deepspeed_ops.build_root()
    assert here != other and os.path.dirname(here) == os.path.dirname(other)
    assert os.path.basename(here).startswith(os.path.basename(other).split("-env")[0] + "-env")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/data/ops")
    assert deepspeed_ops.build_root() == "/data/ops" and deepspeed_ops.build_dir() == "/data/ops/deepspeed_shm_comm"


def _op_with_a_fresh_lock(tmp_path, monkeypatch) -> str:
    """This environment's built op copied to ``$TORCH_EXTENSIONS_DIR=tmp_path/shared``, with the ``lock`` a rank
    stopped while loading it leaves behind (fresh: no clean-up may take it for stale). Returns the lock."""
    import os
    import shutil

    from stnb.strategies import deepspeed_ops

    assert deepspeed_ops.prebuild(print) in ("built", "was built")
    real = deepspeed_ops.build_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "shared"))
    shutil.copytree(real, deepspeed_ops.build_root(), ignore=shutil.ignore_patterns("lock"))
    lock = os.path.join(deepspeed_ops.build_dir(), "lock")
    open(lock, "w").close()
    return lock


def test_a_launch_loads_the_op_from_a_copy_no_lock_left_on_the_machine_holds(tmp_path, monkeypatch):
    """CI: a rank stopped inside torch's builder (which takes the op folder's ``lock`` in every process that
    loads it) left the lock, and the next DeepSpeed run's ranks waited on it until the stall watchdog ended
    the run. A launch's ranks load a copy of their own: torch's builder there finds the op built (nothing
    recompiled or relinked) and no lock, while the machine's folder still holds one."""
    import os
    import subprocess
    import sys

    from stnb.strategies import deepspeed_ops

    lock = _op_with_a_fresh_lock(tmp_path, monkeypatch)
    folder = deepspeed_ops.launch_copy(print)
    op = os.path.join(folder, deepspeed_ops.NAME)
    assert os.path.realpath(folder) != os.path.realpath(deepspeed_ops.build_root()) and not os.path.exists(
        os.path.join(op, "lock"))
    so, log = os.path.join(op, "deepspeed_shm_comm.so"), os.path.join(op, ".ninja_log")
    before = (os.stat(so).st_mtime_ns, open(log).read())
    out = subprocess.run([sys.executable, "-c", deepspeed_ops.BUILD], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_EXTENSIONS_DIR": folder})
    assert out.returncode == 0 and out.stdout.split()[-1] == "built", out.stderr[-2000:]
    assert (os.stat(so).st_mtime_ns, open(log).read()) == before  # loaded as built: ninja did nothing
    assert os.path.exists(lock) and not os.path.exists(os.path.join(op, "lock"))


def test_a_launchs_copy_outlives_the_next_launchs_clean_up_and_a_copy_6_hours_old_does_not(tmp_path, monkeypatch):
    """Seen in a loaded run of the slow tiers: a launch's copy takes the build's file times, its folder's too, so
    the next launch (another test's, another notebook's) took a copy made seconds before for one 6 hours old and
    removed it while its ranks loaded the op; they rebuilt it, past the stall watchdog. A copy's age is now its
    own (``MADE``, written before the copy)."""
    import os
    import shutil
    import time

    from stnb.strategies import deepspeed_ops

    os.remove(_op_with_a_fresh_lock(tmp_path, monkeypatch))
    week = time.time() - 7 * 24 * 3600
    for dirpath, _, files in os.walk(deepspeed_ops.build_root()):  # a build made a week ago, as on a user's machine
        for name in files + [""]:
            os.utime(os.path.join(dirpath, name), (week, week))
    # DeepSpeed's sources here are newer than that (installed since), so prebuild would compile the op again: half
    # a minute idle, past pytest's 600 s in a loaded run of the slow tiers. The copies' clean-up is what this tests.
    monkeypatch.setattr(deepspeed_ops, "prebuild", lambda echo=print: "was built")
    first, second = deepspeed_ops.launch_copy(print), None
    try:
        second = deepspeed_ops.launch_copy(print)
        assert os.path.isfile(os.path.join(first, deepspeed_ops.NAME, "deepspeed_shm_comm.so"))
        old = time.time() - deepspeed_ops.KEEP_LAUNCH_COPY_S - 60
        os.utime(os.path.join(first, deepspeed_ops.MADE), (old, old))
        shutil.rmtree(deepspeed_ops.launch_copy(print))
        assert not os.path.exists(first) and os.path.isdir(second)
    finally:
        for folder in (first, second):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)


def test_a_deepspeed_run_is_not_held_by_a_lock_left_in_the_machines_op_folder(tmp_path, monkeypatch):
    """The CI failure itself, end to end: a fresh lock in the op's folder, then a DeepSpeed run on 2 CPU ranks
    with a 120 s stall watchdog trains and is verified (its ranks built nothing: they load a launch's copy; without
    the copy they wait on the lock until the watchdog ends the run, as in CI with its 60 s)."""
    lock = _op_with_a_fresh_lock(tmp_path, monkeypatch)
    r = stnb.run(TrainConfig(strategy="deepspeed", stage=1, **{**SIDE, "stall_timeout": 120}), echo=False)
    assert r.verified, r.verification.get("problems")
    import os

    assert os.path.exists(lock)
