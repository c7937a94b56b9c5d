"""stnb.export_script(build, ...): a notebook's build function as a standalone torchrun script.

The exported script is run for real with ``torchrun --nproc_per_node=2`` on CPU (gloo) and must
print a verified RunResult; functions that hold kernel-only objects are refused, naming them.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from datasets import Dataset
from sentence_transformers.sentence_transformer import losses

import stnb
from stnb.models import tiny_path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCH_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "STNB_LAUNCH", "MASTER_ADDR",
               "MASTER_PORT", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID")

# globals the build function reads: literals go into the script as they are
TOPICS = ["cats purr softly", "rockets reach orbit", "bread rises slowly", "rivers cut valleys",
          "chess needs patience", "violins need rosin", "glaciers move slowly", "bees make honey"]
STEPS = 3
# a dataset built in this "kernel": a function that reads it cannot be exported
KERNEL_DATA = Dataset.from_dict({"anchor": ["a", "b"], "positive": ["c", "d"]})
model = object()  # a kernel-only global that shares its name with an attribute the function uses


def build_for_script():
    """MNRL with hard negatives and the user's IR evaluator, written as in a notebook cell."""
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer import evaluation

    st = SentenceTransformer(tiny_path(), device="cpu")
    n = 32
    train = Dataset.from_dict({"anchor": [f"what about {TOPICS[i % 8]} {i}" for i in range(n)],
                               "positive": [f"{TOPICS[i % 8]} {i}" for i in range(n)],
                               "negative": [f"{TOPICS[(i + 3) % 8]} {i}" for i in range(n)]})
    ir = evaluation.InformationRetrievalEvaluator(
        {f"q{i}": train[i]["anchor"] for i in range(8)}, {f"d{i}": train[i]["positive"] for i in range(8)},
        {f"q{i}": {f"d{i}"} for i in range(8)}, name="mine", show_progress_bar=False, write_csv=False)
    args = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="byo-script-"), per_device_train_batch_size=4, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=7)
    trainer = SentenceTransformerTrainer(model=st, args=args, train_dataset=train,
                                         loss=losses.MultipleNegativesRankingLoss(st), evaluator=ir)
    assert trainer.model is st  # `trainer.model` is an attribute, not the global `model`
    return trainer


def build_from_kernel_data():
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    st = SentenceTransformer(tiny_path(), device="cpu")
    return SentenceTransformerTrainer(model=st, train_dataset=KERNEL_DATA, loss=losses.MultipleNegativesRankingLoss(st))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    return env


def test_exported_build_function_runs_under_torchrun_and_returns_a_verified_result(tmp_path):
    script = tmp_path / "train_own.py"
    results = tmp_path / "runs.jsonl"
    out = stnb.export_script(build_for_script, script, results_file=str(results), strategy="ddp", num_processes=2,
                             override_args={"per_device_train_batch_size": 2}, echo=False)
    assert out.commands["torchrun"] == f"torchrun --standalone --nproc_per_node=2 {script}"
    text = script.read_text()
    tree = ast.parse(text)
    # the function's own source, the imports and literals it reads, and main() under the guard
    defs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert defs == ["build_for_script", "main"]
    assert "from stnb.models import tiny_path" in text and "from datasets import Dataset" in text
    assert "from sentence_transformers.sentence_transformer import losses" in text
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    assert consts["TOPICS"] == TOPICS and consts["STEPS"] == STEPS
    assert consts["STNB_OPTIONS"] == {"strategy": "ddp", "num_processes": 2,
                                      "override_args": {"per_device_train_batch_size": 2}}
    assert "KERNEL_DATA" not in text and "model = " not in text
    assert "stnb.run(build_for_script, results_file=STNB_RESULTS_FILE, **STNB_OPTIONS)" in text

    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    d = json.loads(lines[-1])
    assert proc.stdout.count('"run_id"') == 1  # printed once, by rank 0
    res = stnb.RunResult.from_dict(d)
    assert res.verified, res.reason
    assert res.launcher == "torchrun" and res.world_size == 2 and res.verification["world_size_seen"] == [2]
    assert res.verification["weights_identical_across_ranks"]
    assert res.build == "build_for_script" and res.config["loss"] == "MultipleNegativesRankingLoss"
    assert res.verification["data_columns"] == ["anchor", "positive", "negative"]
    assert res.dev_metric == "mine_cosine_ndcg@10" and res.dev_metric_after is not None
    # the option given to export_script reached every rank, overriding the function's own batch
    assert res.overridden_args["per_device_train_batch_size"]["from"] == 4
    assert res.overridden_args["per_device_train_batch_size"]["to"] == 2
    assert res.per_device_batch_size == 2 and res.global_batch_size == 4 and len(res.losses) == STEPS
    assert [r["batch_override"]["first_batch_rows"] for r in res.verification["ranks"]] == [2, 2]
    assert stnb.load_results(results, as_frame=False)[0]["run_id"] == res.run_id


def test_a_partial_with_literal_arguments_is_exported_with_its_arguments(tmp_path):
    def_text = stnb.export_script(functools.partial(build_for_script), tmp_path / "a.py", echo=False,
                                  strategy="single")
    assert def_text.nproc_per_node == 1
    script = tmp_path / "b.py"
    stnb.export_script(functools.partial(_batch_of, 4), script, echo=False, strategy="single")
    tree = ast.parse(script.read_text())
    assert "build = functools.partial(_batch_of, 4)" in script.read_text()
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == ["_batch_of", "main"]


def _batch_of(n):  # a function with an argument, bound with functools.partial
    return build_for_script() if n else None


def _written(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_a_closure_over_a_local_object_is_refused_naming_it(tmp_path):
    train_set = Dataset.from_dict({"anchor": ["a"], "positive": ["b"]})

    def build():
        trainer = build_for_script()
        trainer.train_dataset = train_set
        return trainer

    with pytest.raises(stnb.ConfigError, match=r"build\(\) closes over train_set, local variable"):
        stnb.export_script(build, tmp_path / "x.py", echo=False)
    assert _written(tmp_path) == []


def test_a_global_dataset_built_in_the_kernel_is_refused_naming_it(tmp_path):
    with pytest.raises(stnb.ConfigError, match=r"KERNEL_DATA \(a datasets\.arrow_dataset\.Dataset object built in "
                                               r"the notebook\).*build these objects inside the function"):
        stnb.export_script(build_from_kernel_data, tmp_path / "x.py", echo=False)
    assert _written(tmp_path) == []


def test_a_lambda_and_a_function_without_source_are_refused(tmp_path):
    with pytest.raises(stnb.ConfigError, match="a lambda has no name or source"):
        stnb.export_script(lambda: build_for_script(), tmp_path / "x.py", echo=False)
    ns = {}
    exec("def made_by_exec():\n    return None\n", ns)
    with pytest.raises(stnb.ConfigError, match=r"the source of made_by_exec\(\) cannot be found"):
        stnb.export_script(ns["made_by_exec"], tmp_path / "y.py", echo=False)
    with pytest.raises(stnb.ConfigError, match="steps: max_steps in your SentenceTransformerTrainingArguments"):
        stnb.export_script(build_for_script, tmp_path / "z.py", echo=False, steps=5)
    with pytest.raises(stnb.ConfigError, match="override_args cannot set 'learning_rate'"):
        stnb.export_script(build_for_script, tmp_path / "z.py", echo=False, override_args={"learning_rate": 1})
    assert _written(tmp_path) == []


def test_override_args_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(stnb.ConfigError, match="stnb's recipe takes per_device_batch_size"):
        stnb.run(stnb.TrainConfig(model="tiny", override_args={"per_device_train_batch_size": 2}), echo=False)
    with pytest.raises(stnb.ConfigError, match="stnb's recipe takes per_device_batch_size"):
        stnb.export_script(stnb.TrainConfig(override_args={"per_device_train_batch_size": 2}), tmp_path / "r.py")
    with pytest.raises(stnb.ConfigError, match=r"override_args\['per_device_train_batch_size'\] must be >= 1"):
        stnb.run(build_for_script, override_args={"per_device_train_batch_size": 0}, echo=False)
    with pytest.raises(stnb.ConfigError, match="must be a value or \\(value, why\\)"):
        stnb.run(build_for_script, override_args={"per_device_train_batch_size": (2, 3, 4)}, echo=False)
    assert _written(tmp_path) == []
