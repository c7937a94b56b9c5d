"""The checks that keep each notebook honest, out of the reader's way.

GitHub's notebook view shows every code cell, hidden or not (it ignores ``source_hidden`` and the
``hide-input`` tag), so a notebook holds no ``assert``: the checks live here. Under nbval (``make test``,
or ``pytest --nbval-lax --nbval-current-env notebooks/05_compare_strategies.ipynb``) the repository's
``conftest.py`` runs each one in the notebook's own kernel right after the cell it checks, so it sees
that cell's variables, as the hidden cells did.

``CHECKS[notebook]`` lists ``(anchor, source)``: the anchor is how the checked code cell starts (the
shortest start no other code cell of the notebook has); a check whose anchor matches no cell, or more
than one, fails the collection: a cell edited past recognition cannot drop its checks silently.
Numbers of the committed workshop run (05's parity table) are checked from the committed outputs by
``tests/test_notebook_outputs.py``.
"""

from __future__ import annotations

CHECKS = {
    "00_setup_and_hardware.ipynb": [
        ('hw = stnb.hardware_report()',
         """assert hw.cpu_cores >= 1
assert hw.backend == ("nccl" if hw.device == "cuda" else "gloo")
assert hw.max_processes == (len(hw.gpus) if hw.device == "cuda" else hw.cpu_cores)"""),
        ('import pandas as pd',
         """assert list(hw.strategies) == list(stnb.strategies.names())       # every registered strategy answers
assert {"single", "dp", "ddp", "zero1", "zero2", "fsdp"} <= set(hw.strategies)
assert hw.runnable("single")
assert hw.runnable("dp") == (len(hw.gpus) >= 2)          # DataParallel needs 2+ GPUs
assert hw.runnable("ddp") == hw.runnable("fsdp") == (hw.max_processes >= 2)
assert all(info["reason"] for info in hw.strategies.values())   # every answer has a reason"""),
        ('import os',
         """assert [h["rank"] for h in hellos] == list(range(N))
assert {h["world_size"] for h in hellos} == {N}
assert len({h["pid"] for h in hellos}) == N              # N separate processes...
assert os.getpid() not in {h["pid"] for h in hellos}     # ...none of them the notebook itself"""),
        ('info = stnb.last_launch()',
         """assert all(f"hello from rank {r} of {N}" in info.logs[r] for r in range(N))"""),
        ('for s in sums:',
         """assert all(s["sum"] == s["expected"] == N * (N + 1) / 2 for s in sums)"""),
        ('try:\n    stnb.launch(examples.fail_on, num_processes=N, device=device, rank_to_fail=1, echo=False)',
         """assert error.rank == 1 and "ValueError" in error.rank_traceback"""),
        ('print(f"spawned: {stnb.last_launch().wall_time_s:.1f} s (the fork launches above: well under that)")',
         """assert greetings == [f"hi from rank {r}, started by spawn" for r in range(N)]  # observed in each rank"""),
    ],
    "01_single_device_baseline.ipynb": [
        ('import torch\nfrom sentence_transformers import SentenceTransformer',
         """assert len(losses) == 4 and losses[-1] < losses[0]        # the same batch, four steps: its loss fell
assert all(p.grad is None for p in model.parameters())     # zero_grad() cleared what backward() filled
from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss
model.eval()                                               # no dropout: the two losses see the same embeddings
with torch.no_grad():                                      # the cell's loss is CosineSimilarityLoss's
    a, b = (model(model.preprocess(batch[c]))["sentence_embedding"] for c in ("sentence1", "sentence2"))
    ours = torch.nn.functional.mse_loss(torch.cosine_similarity(a, b), target).item()
    theirs = CosineSimilarityLoss(model)([model.preprocess(batch[c]) for c in ("sentence1", "sentence2")], target)
assert abs(ours - theirs.item()) < 1e-6 * max(1.0, abs(ours)), (ours, theirs)"""),
        ('print(f"Spearman on {cfg.dev_size} held-out dev pairs, by step:")',
         """steps = [s for s, _ in result.dev_curve]
assert steps[0] == 0 and steps[-1] == cfg.steps and 3 <= len(steps) <= 5 and steps == sorted(set(steps))
assert (result.dev_curve[0][1], result.dev_curve[-1][1]) == (result.spearman_before, result.spearman_after)"""),
        ('scores = train["score"]',
         """assert len(train) == cfg.train_size and len(dev) == cfg.dev_size
assert 0.0 <= min(scores) and max(scores) <= 1.0
assert set(train.column_names) == {"sentence1", "sentence2", "score"}"""),
        ('print(f"{result.samples_per_second:.1f} samples/s over {result.steps} steps "',
         """assert result.verified and result.status == "ok"
assert (result.world_size, result.global_batch_size) == (1, cfg.per_device_batch_size)
assert result.steps == cfg.steps == len(result.step_times)
assert result.samples_per_second > 0 and all(t > 0 for t in result.step_times)"""),
        ('parts = mem.set_index("component")',
         """assert result.memory_breakdown[0]["params"] == 4 * result.total_param_count     # fp32 weights
for part in ("params", "grads", "optimizer_state"):
    assert 0.99 < parts.loc[part, "measured_over_predicted"] < 1.01, part"""),
        ('df = stnb.results_frame([result])',
         """import math

assert len(result.losses) == result.steps
assert all(math.isfinite(loss) and loss >= 0 for loss in result.losses)"""),
        ('import tempfile',
         """assert len(table) == 1 and table.loc[0, "run_id"] == result.run_id
assert table.loc[0, "samples_per_second"] == result.samples_per_second"""),
    ],
    "02_data_parallel.ipynb": [
        ('hw = stnb.hardware_report()',
         """assert dp["runnable"] == (len(hw.gpus) >= 2)"""),
        ('def nbytes(tensors):',
         """assert grad_bytes < param_bytes <= 4 * n_params + nbytes(model.buffers())"""),
        ('input_bytes = nbytes(features.values())',
         """assert output_bytes > embedding_bytes > 0 and input_bytes > 0"""),
        ('for n in sorted({N, 4}):',
         """assert all(sum(dp_traffic(n).values()) > sum(ddp_traffic(n).values()) for n in (N, 4))"""),
        ('if dp["runnable"]:',
         """if dp["runnable"]:
    assert result.verified and len(result.verification["ranks"][0]["device_ids"]) >= 2
    assert 3 <= len(result.dev_curve) <= 5 and result.dev_curve[-1][1] == result.spearman_after"""),
        ('row = stnb.results_frame([result])',
         """assert result.strategy == "dp"
if result.status == "not runnable here":
    assert result.samples_per_second is None and result.steps == 0 and result.reason
else:
    assert result.status == "ok" and result.samples_per_second > 0"""),
    ],
    "03_ddp_from_a_notebook.ipynb": [
        ('import pandas as pd',
         """assert [r["rank"] for r in ranks] == list(range(N)) and {r["world_size"] for r in ranks} == {N}
assert len({r["pid"] for r in ranks}) == N
assert {r["backend"] for r in ranks} == {"nccl" if device == "cuda" else "gloo"}"""),
        ('hand = stnb.launch(by_hand',
         """local = [h["local"] for h in hand]
assert not torch.equal(local[0], local[1])                     # own data: different gradients
assert all(torch.equal(h["synced"], hand[0]["synced"]) for h in hand)   # after the all-reduce: one gradient
assert torch.allclose(hand[0]["synced"], sum(local) / N)      # the average of the local ones"""),
        ('from stnblab import exercises',
         """assert not verdict.passed                                     # the neighbour swap is no ring...
assert verdict.lines[0].startswith("2 ranks, lengths 7, 11: every rank holds the sum")   # ...though right on 2
assert verdict.lines[1].startswith("3 ranks: rank ") and "torch.distributed.all_reduce gives" in verdict.lines[1]"""),
        ('def ddp_broadcast():',
         """assert broadcast[0]["weight[0,0] before DDP()"] != broadcast[1]["weight[0,0] before DDP()"]   # seeded apart
assert all(b["after DDP()"] == broadcast[0]["weight[0,0] before DDP()"] for b in broadcast)   # rank 0's everywhere"""),
        ('hooked = stnb.launch(one_backward',
         """assert all(h["all-reduces"] >= 1 and h["bytes all-reduced"] == h["gradient bytes"] for h in hooked)"""),
        ('def accumulate():',
         """assert all(s["all-reduces in no_sync"] == 0 and s["all-reduces after"] >= 1 for s in steps)
assert all(s["bytes all-reduced"] == hooked[0]["gradient bytes"] for s in steps)   # once per optimizer step
assert torch.equal(steps[0]["weights after the step"], steps[1]["weights after the step"])"""),
        ('for name, res in (("without gather", alone), ("with gather", gathered)):',
         """assert all(r["negatives_per_anchor"] == 4 - 1 for r in alone)
assert all(r["negatives_per_anchor"] == 4 * N - 1 for r in gathered)"""),
        ('checks = result.verification',
         """assert result.verified and result.world_size == N
assert all(r["wrapper"] == "DistributedDataParallel" for r in checks["ranks"])
assert checks["world_size_seen"] == [N]
assert checks["weights_identical_across_ranks"] is True
assert result.global_batch_size == cfg.global_batch_size()"""),
        ('print(f"{result.dev_metric} on {cfg.dev_size} held-out dev pairs, by step:")',
         """assert result.dev_metric == "dev_spearman_cosine" and len(result.losses) == result.steps
assert result.dev_curve[0] == (0, result.dev_metric_before)
assert result.dev_curve[-1] == (result.steps, result.dev_metric_after)
between = [step for step, _ in result.dev_curve[1:-1]]   # the trainer's eval_steps, below the last step
assert 2 <= len(between) <= 3 and between == [k * mnrl.dev_eval_steps() for k in range(1, len(between) + 1)]"""),
    ],
    "04_zero_ladder.ipynb": [
        ('def one_process():',
         """assert (reference - init()).abs().max() > 1e-2              # training moved the weights"""),
        ('def all_reduce_slice(full, rank):',
         """assert list(zero1["rank"]) == list(range(N)) and (zero1["max diff from one process"] < 1e-6).all()
assert (zero1["params held"] == P).all() and (zero1["grads held"] == P).all()       # stage 1: full params, grads
assert (zero1["AdamW state covers"] == P // N).all()                                # ... optimizer state sharded"""),
        ('def reduce_scatter_slice(full, rank):',
         """assert list(zero2["rank"]) == list(range(N)) and (zero2["max diff from one process"] < 1e-6).all()
assert (zero2["params held"] == P).all() and (zero2["grads held"] == P // N).all()  # stage 2: + gradients
assert (zero2["AdamW state covers"] == P // N).all()"""),
        ('zero3 = pd.DataFrame(stnb.launch(zero3_by_hand',
         """assert list(zero3["rank"]) == list(range(N)) and (zero3["max diff from one process"] < 1e-6).all()
assert (zero3[["params held", "grads held", "AdamW state covers"]] == P // N).all().all()   # stage 3: all of it"""),
        ('import tempfile',
         """assert list(runs) == stages and all(r.verified for r in runs.values()), {s: r.reason for s, r in runs.items()}"""),
        ('stnb.plots.memory(stnb.results_frame(list(runs.values())))',
         """frac = {(r.strategy, r.part): r.measured_fraction for r in table.itertuples()}
assert all(frac[("ddp", part)] > 0.99 for part in ("params", "grads", "optimizer_state"))
assert frac[("zero1", "optimizer_state")] < 1 and frac[("zero1", "grads")] > 0.99   # stage 1: optimizer only
assert frac[("zero2", "grads")] < 0.51 and frac[("fsdp", "params")] < 0.51        # stage 2: gradients; 3: parameters
pred = {(r.strategy, r.part): r.predicted_fraction for r in table.itertuples()}
assert all(abs(frac[k] - pred[k]) < 0.01 for k in frac if k[0] != "zero1")        # the prediction holds"""),
        ('for name, r in runs.items():\n    print(f"{name:<6}',
         """for r in runs.values():
    every = base.dev_eval_steps()
    assert [s for s, _ in r.dev_curve] == [0, *range(every, base.steps, every), base.steps]
    assert r.dev_curve[0][1] == r.dev_metric_before and r.dev_curve[-1][1] == r.dev_metric_after
    assert r.dev_metric_after > r.dev_metric_before              # the held-out metric improves
for name in stages:          # every stage: DDP's learning, step by step
    assert max(abs(a[1] - b[1]) for a, b in zip(runs[name].dev_curve, runs["ddp"].dev_curve)) < 0.01, name"""),
        ('from sentence_transformers import SentenceTransformer',
         """saved = fsdp.verification["saved_model"]
assert saved["ok"] and saved["equals_trained"] and saved["differs_from_initial"]
assert sum(p.numel() for p in model.parameters()) == fsdp.total_param_count   # all of it, unsharded
import os

assert not os.path.exists(scratch.name)          # the saved model's folder is removed once it is read"""),
        ('probe = stnb.run(',
         """assert probe.verified and 0 <= runtime < budget
assert all(r["memory_budget"]["limit_bytes"] == 64 * 2**30 for r in probe.verification["ranks"])"""),
        ('big = prof.config(',
         """rows = fit.set_index("strategy")
said = (fit.attrs["trials"], fit.attrs["errors"])
assert list(fit.strategy) == stages and fit.attrs["trials"]["ddp"] == {1: "out of memory"}, said   # DDP: no step
sharded = ["zero1", "zero2", "fsdp"]
assert all(fit.attrs["trials"][s] == {1: "trained"} for s in sharded), said                   # every rung trains
assert (rows.loc[sharded, "held_mib"] <= budget * 1024).all()                    # ... inside the budget
assert rows.loc["zero1", "state_mib"] > rows.loc["zero2", "state_mib"] >= rows.loc["fsdp", "state_mib"]
assert rows.loc["zero1", "held_mib"] > rows.loc["fsdp", "held_mib"]              # what a rank held falls"""),
    ],
    "05_compare_strategies.ipynb": [
        ('df = stnb.load_results(results_file)',
         """assert list(df.strategy) == list(configs)
assert set(ok.strategy) == {s for s in configs if hw.strategies[s]["runnable"]}
assert ok.verified.all() and (ok.global_batch_size == G).all()
assert (ok.samples_per_second > 0).all()
assert (df[df.status != "ok"].status == "not runnable here").all()"""),
        ('import stnblab',
         """sps = base.samples_per_second                   # measured here (05 measures; 06 and 08 reuse it)
assert base.source.startswith("measured now") and base.notebook == "05" and all(v > 0 for v in sps.values())
assert "ddp defaults" in sps and ("whole machine" in base.name if device == "cpu" else base.name == "single 1 GPU")
assert len(sps) == (4 if device == "cpu" else 2)   # + the whole machine and N single runs at once on CPU
assert base.table.loc[base.name, "vs_baseline"] == 1.0"""),
        ('local = ok.set_index("strategy").local_param_fraction',
         """assert all(local[s] == 1.0 for s in ("single", "dp", "ddp") if s in local)   # full copies
if "fsdp" in local:
    assert abs(local["fsdp"] - 1 / N) < 0.05                   # FSDP: each rank holds ~1/N"""),
        ('runs = [stnb.RunResult.from_dict(r) for r in stnb.load_results(results_file, as_frame=False)',
         """from stnb.memsplit import SPLIT

for r in runs:                  # the parts add up to the measured peak of every rank
    assert all(sum(s[k] for k in SPLIT) == peak for s, peak in zip(r.memory_split, r.peak_memory_bytes))
state = {r.strategy: sum(r.memory_split[0][k] for k in ("params", "grads", "optimizer_state")) for r in runs}
if {"ddp", "fsdp"} <= set(state):
    assert 0.4 < state["fsdp"] / state["ddp"] < 0.6"""),
        ('for _, r in ok.iterrows():',
         """assert all(3 <= len(c) <= 5 and c[0][1] == b and c[-1][1] == a     # before, up to 3 during, after
           for c, b, a in zip(ok.dev_curve, ok.spearman_before, ok.spearman_after))
assert ok.spearman_before.notna().all() and ok.spearman_after.notna().all()
assert ok.spearman_before.max() - ok.spearman_before.min() < 1e-3   # the same model before training, whatever the strategy
import numpy as np

losses = {r.strategy: np.array(r.losses) for _, r in ok.iterrows()}   # the loss curves plotted above
assert all(len(c) == prof.bench_steps and np.isfinite(c).all() for c in losses.values())
if {"ddp", "fsdp"} <= set(losses):                # same ranks, same seeds: even the dropout masks agree
    assert np.allclose(losses["ddp"], losses["fsdp"], rtol=1e-4, atol=1e-6)"""),
        ('strategies = [s for s in ("ddp", "zero1", "zero2", "fsdp")',
         """assert off.passed, off                          # dropout off: single = DDP = ZeRO-1 = ZeRO-2 = FSDP
rows = off.table[off.table.role == "strategy"]
assert list(rows.strategy) == strategies and rows.verified.all()
assert (rows.overall < 0.01).all() and (rows.over_tolerance == 0).all()   # < 1 % of the weight movement"""),
        ('kept = stnb.parity(same, strategies=["ddp"], num_processes=N, dropout="keep")',
         """kept_ddp = kept.table[kept.table.strategy == "ddp"].iloc[0]
assert kept_ddp.verified                           # the ranks agree with each other...
if dropout > 0:                                    # ...and, with dropout, not with one device: other masks
    assert not kept.passed and kept_ddp.overall > 10 * rows[rows.strategy == "ddp"].overall.iloc[0]
else:                                              # nothing random in the model (the ci profile's tiny one)
    assert kept_ddp.overall < 0.01"""),
    ],
    "06_scaling_out.ipynb": [
        ('hw = stnb.hardware_report()',
         'assert here.verified and here.launcher == "stnb"'),
        ('import json',
         """assert proc.returncode == 0"""),
        ('import numpy as np',
         """assert there.launcher == "torchrun" and there.verified
assert there.verification["weights_identical_across_ranks"] is True
assert (there.world_size, there.global_batch_size) == (here.world_size, here.global_batch_size)
assert np.allclose(there.losses, here.losses, rtol=1e-4, atol=1e-6)   # same training, same numbers"""),
        ('from pathlib import Path\n\nscript = stnb.export_script(',
         """assert Path(script.path).exists() and script.nproc_per_node == N
assert len(script.node_commands("torchrun")) == 2
for node, command in enumerate(script.node_commands("torchrun")):
    assert f"--node_rank={node}" in command and "--nnodes=2" in command"""),
        ('if job is not None:',
         """if job is not None:
    assert on_slurm.verified and on_slurm.launcher == "slurm" and on_slurm.world_size == here.world_size
    assert on_slurm.global_batch_size == here.global_batch_size"""),
        ('import tempfile\n\nscratch = ',
         """every, end = fsdp.checkpoint_every, fsdp.steps
assert never.verified and len(never.losses) == end
assert [c["step"] for c in never.checkpoints] == list(range(every, end + 1, every))
assert [s for s, _ in stnb.checkpoints.complete(runs_dir / "never")] == list(range(every, end + 1, every))[-2:]  # keep=2"""),
        ('stopped = fsdp.replace(',
         """import psutil

assert isinstance(interrupted, KeyboardInterrupt) and "all ranks were stopped" in str(interrupted)
assert stnb.last_launch().error == "interrupted"
kernel, ranks = psutil.Process(), []            # no rank left running (the ranks are forks of this kernel)
for p in kernel.children(recursive=True):
    try:
        if p.name() == kernel.name() and p.status() != psutil.STATUS_ZOMBIE:
            ranks.append(p)
    except psutil.NoSuchProcess:
        pass
assert not ranks, ranks"""),
        ('step, path = stnb.checkpoints.complete(stopped.checkpoint_dir)[-1]',
         """assert step % every == 0 and every <= step < end      # stopped after a checkpoint, before the end
assert written["step"] == step and written["strategy"] == "fsdp" and written["world_size"] == N
assert max(written["bytes_written"]) < 0.7 * sum(written["bytes_written"])   # each rank wrote its shards only
assert stnb.checkpoints.partial(stopped.checkpoint_dir) == []
assert [h["step"] for h in logged] == list(range(1, step + 1))
assert [h["loss"] for h in logged] == never.losses[:step]      # the same run, up to its checkpoint"""),
        ('resumed = stnb.run(stopped.replace(resume="latest"',
         """assert resumed.verified and r["step"] == r["started_at_step"] == step
assert r["written_strategy"] == "fsdp" and r["written_by"] == N and Path(r["path"]).name == f"checkpoint-{step}"
assert len(resumed.losses) == end - step and resumed.checkpoints[-1]["step"] == end"""),
        ('from sentence_transformers import SentenceTransformer\n\nresumed_model',
         """assert a.keys() == b.keys()
if device == "cpu":              # deterministic: the run that never stopped, bit for bit
    assert max_diff == 0.0 and resumed.losses == never.losses[step:]"""),
        ('opened = stnb.checkpoints.to_model(',
         """assert o.keys() == b.keys() and largest == 0.0   # every rank's shards, read into one model: the saved one"""),
        ('steps, values = zip(*one.dev_curve)',
         """assert 3 <= len(steps) <= 5 and steps[0] == 0 and steps[-1] == prof.steps and list(steps) == sorted(set(steps))
assert (values[0], values[-1]) == (one.spearman_before, one.spearman_after)"""),
        ("import stnblab  # stnb's lab: notebook 05's baseline",
         """sps = base.samples_per_second                   # 05's baseline, reused (or measured here when 06 runs alone)
assert "ddp defaults" in sps and base.name in sps and all(v > 0 for v in sps.values())
assert base.source.startswith(("measured in notebook ", "measured now")) and predicted > 0  # 05's or an earlier run's"""),
        ('split, alone = stnb.timesplit.table(here), stnb.timesplit.table(one)',
         """parts = ["data_ms", "forward_ms", "backward_compute_ms", "comm_exposed_ms", "wait_ms", "optimizer_ms", "other_ms"]
if not split.empty:
    assert ((split[parts].sum(axis=1) - split["step_ms"]).abs() < 1e-6 * split["step_ms"]).all()
    assert (split["other_ms"] < 0.1 * split["step_ms"]).all()   # the measured parts explain the step
assert pred.row("ddp", 2)["samples_per_second"] > 0 and -1 < check["error"] < 3
assert set(pred.table.strategy) >= {"single", "ddp", "fsdp"} and pred.assumptions"""),
    ],
    "07_bring_your_own_training.ipynb": [
        ('TRIPLETS = triplets(SCENES[32:], 120, seed=1)',
         """about = lambda rows: {text for row in rows for text in row[:2]}   # the anchors and positives
assert len(TRIPLETS) == 120 and len(HELD_OUT) == 24 and not about(TRIPLETS) & about(HELD_OUT)
assert all(len(set(row)) == 3 for row in TRIPLETS + HELD_OUT)       # a paraphrase, never a copy"""),
        ('df = stnb.load_results(results_file)',
         """assert df.verified.all() and list(df.strategy) == list(runs)
assert all(r.world_size == (2 if s in ("ddp", "fsdp") else 1) for s, r in runs.items())
assert all(r.dev_metric == "held_out_cosine_ndcg@10" and r.dev_metric_after is not None for r in runs.values())
assert all(r.dev_metric_after > r.dev_metric_before for r in runs.values())   # it learned what carries over"""),
        ('for strategy, r in runs.items():\n    print(f"{strategy:<6} {r.dev_metric}: "',
         """for r in runs.values():    # the held-out questions: before, every EVAL_EVERY steps, after
    assert [s for s, _ in r.dev_curve] == [0, *range(EVAL_EVERY, STEPS, EVAL_EVERY), STEPS]
    assert r.dev_curve[0][1] == r.dev_metric_before and r.dev_curve[-1][1] == r.dev_metric_after
    assert len(r.losses) == STEPS"""),
        ('panel = stnb.widgets.Panel(build=build, results_file=results_file)',
         """assert len(panel.results) == len(runs) and panel.batch.disabled"""),
        ('rerank_file = results_file.with_name("reranker.jsonl")',
         """assert rdf.verified.all() and list(rdf.strategy) == ["single", "ddp"]
assert [r.world_size for r in reranker.values()] == [1, 2]
assert all(r.dev_metric.startswith("held_out_") and r.dev_metric_before is not None and r.dev_metric_after is not None
           for r in reranker.values())
assert reranker["ddp"].overridden_args["ddp_find_unused_parameters"]["to"] is False
assert reranker["ddp"].verification["loss_received_all_columns"] is True"""),
        ('def plain_sentence_transformers():',
         """assert len(plain) == 2 and plain[0] != plain[1]   # the upstream drift, reproduced"""),
        ('import pandas as pd',
         """assert fixed.verified and fixed.world_size == 2
assert [seen["world_size_seen"] for seen in v["ranks"]] == [2, 2]
assert [seen["trained_parameters"]["loss"] for seen in v["ranks"]] == [["loss.log_scale"]] * 2
assert all(seen["trained_parameters"]["loss_parameters_synced"] for seen in v["ranks"])
assert v["weights_identical_across_ranks"] is True and len(set(v["weights_checksums"])) == 1"""),
    ],
    "08_tuning_ddp.ipynb": [
        ("import stnblab  # stnb's lab: the baseline and the bench",
         """sps = base.samples_per_second                   # 05's baseline, reused (or measured here when 08 runs alone)
assert "ddp defaults" in sps and base.name in sps and all(v > 0 for v in sps.values())
assert base.source.startswith(("measured in notebook ", "measured now"))  # 05's, or this one's earlier run"""),
        ('now = base.remeasured(knob_df)',
         """assert len(ddp_rows) == len(knob_names) and best.samples_per_second == ddp_rows.samples_per_second.max()
assert now.name == base.name and now.samples_per_second[now.name] == knob_df.set_index("variant").samples_per_second[now.name]
assert now.source == "measured now, beside these runs" and set(now.samples_per_second) <= set(base.samples_per_second)"""),
        ('tuned = stnb.run(',
         """assert tuned.verified and tuned.config["comm_hook"] == "embedding_rows"
assert [st for st, _ in tuned.dev_curve][0] == 0 and [st for st, _ in tuned.dev_curve][-1] == prof.steps
assert 3 <= len(tuned.dev_curve) <= 5 and (tuned.dev_curve[0][1], tuned.dev_curve[-1][1]) == (tuned.spearman_before,
                                                                                       tuned.spearman_after)"""),
        ('knob_names = [',
         """import os

assert not os.path.exists(scratch)               # the bench's results files are removed once it returned"""),
        ('ddp_rows = knob_df[knob_df.variant.str.startswith("ddp ")]',
         """assert knob_report.failed == 0
assert ddp_rows.verified.all()                     # DDP weights identical across ranks in every variant
assert set(knob_names) == {v.removeprefix("ddp ") for v in ddp_rows.variant}
assert (ddp_rows.efficiency > 0).all()             # each compared with its matching single-device run"""),
        ('runs = knob_report.frame.set_index("variant")',
         """assert rows.verification["weights_checksums"] == runs.loc["ddp defaults"].verification["weights_checksums"]
assert rows.losses == runs.loc["ddp defaults"].losses"""),
    ],
    "09_zero_in_depth_and_deepspeed.ipynb": [
        ('sharded = stnb.launch(fsdp_step',
         """assert all(s["placements"] == "(Shard(dim=0),)" for s in sharded)
assert all(s["local shape"] == (64 // N, 16) and s["shape in forward"] == s["full shape"] == (64, 16) for s in sharded)
assert all(s["grad"] == "DTensor" and s["grad local shape"] == s["local shape"] for s in sharded)"""),
        ("ring = (N - 1) / N                     # the share of a collective's tensor each rank sends in a ring",
         """names = [n for n, _ in sharded[0]["log"]]
assert names.count("all_gather_single") == 4 and names.count("reduce_scatter_single") == 2   # 2 blocks: forward, backward
assert ddp_bytes == 4 * sum(p.numel() for p in small_model().parameters())
assert abs(per_step["fsdp"] / per_step["ddp"] - 1.5) < 1e-9"""),
        ('def zero1_by_hand():',
         """assert zero1["optimizer state covers"].sum() == zero1["parameters"].iloc[0]   # the partitions add up to the model
assert (zero1["optimizer state covers"] < zero1["parameters"]).all()           # and each rank keeps only its part"""),
        ('import torch\nfrom stnblab import exercises',
         """assert not verdict.passed and len(verdict.lines) == 2
assert all("one AdamW step on the full parameters gives" in line for line in verdict.lines)   # the values differ"""),
        ('zero2 = pd.DataFrame(stnb.launch(zero2_by_hand',
         """assert zero2["weight whole after forward"].all() and (zero2["gradient"] == "DTensor").all()
assert zero2["sharded after backward"].all()                  # between steps: a shard again, unlike DeepSpeed's stage 2
assert all(2 * held[0] == whole[0] for held, whole in zip(zero2["this rank holds"], zero2["global shape"]))"""),
        ('for name, r in runs.items():\n    print(f"{name:<12} "',
         """assert all(r.verified for r in runs.values()), {s: r.reason for s, r in runs.items()}
for r in runs.values():
    every = base.dev_eval_steps()
    assert [s for s, _ in r.dev_curve] == [0, *range(every, base.steps, every), base.steps]
    assert r.dev_curve[0][1] == r.dev_metric_before and r.dev_curve[-1][1] == r.dev_metric_after
    assert r.dev_metric_after > r.dev_metric_before
for name in runs:            # native and DeepSpeed: the same learning, step by step
    assert max(abs(a[1] - b[1]) for a, b in zip(runs[name].dev_curve, runs["zero1"].dev_curve)) < 0.01, name"""),
    ],
    "10_beyond_data_parallelism.ipynb": [
        ('def shard_layer_0(path):',
         """# Checks that keep this notebook honest: each rank holds half of every planned weight, on the planned dimension.
for rank in held:
    assert [w["weight"].rsplit(".", 1)[0] for w in rank] == list(layer0)
    for w, style in zip(rank, layer0.values()):
        dim = 0 if style == "colwise" else 1
        assert w["placement"] == f"Shard(dim={dim})" and 2 * w["this rank holds"][dim] == w["global shape"][dim]"""),
        ('by_hand = pd.DataFrame(stnb.launch(linear_by_hand',
         """assert list(by_hand["rank"]) == [0, 1]   # both ranks: the whole product from chunks, cut as the prose says
assert (by_hand["column-wise holds"] == (4, 3)).all() and (by_hand["row-wise holds"] == (4, 6)).all()
assert (by_hand["column-wise error"] < 1e-5).all() and (by_hand["row-wise error"] < 1e-5).all()"""),
        ('out = stnb.launch(two_stages_by_hand',
         """assert out[0] is None and out[1] < 1e-6   # stage 1 ends where one process does"""),
        ('TOL = stnblab.parallel.TOLERANCE',
         """assert all(diffs[k] <= TOL[k] for k in diffs)                     # the same numbers as one process
assert all(r["local_params"] < r["total_params"] for r in tp.ranks)  # and each rank holds less than the model
assert all(r["grads_compared"] == len(tp.reference["grads"]) for r in tp.ranks)"""),
        ('from statistics import median',
         """assert comm["counts"] == {"all_reduce": 6 * shape.layers}   # 2 forward + 4 backward per layer
assert cost["ms / step"][0] > 0 and cost["MiB into collectives / step"][0] > 0"""),
        ('caught = None',
         """assert caught and "layer 1 attention.self.query: not sharded" in caught"""),
        ('pp = stnblab.parallel.pipeline_parallel(prof.model, stages=2, pairs=pairs, steps=steps)',
         """assert (runs.loss_diff <= TOL["loss"]).all() and (runs.grad_diff <= TOL["grads"]).all()
assert (runs.embedding_diff <= TOL["embeddings"]).all()
assert all(r["grads_compared"] == r["grads_expected"] for r in pp.runs)  # every parameter has a stage
assert ((runs.idle_stage0 > 0) & (runs.idle_stage1 < 1)).all()"""),
        ('small = stnblab.parallel.pipeline_parallel(prof.model, stages=2, runs=[("gpipe", 4)], pairs=pairs, steps=1,',
         """assert small.runs[0]["loss_diff"] <= TOL["loss"] and small.runs[0]["grad_diff"] <= TOL["grads"]
assert small.references[4]["losses"][0] < small.references[1]["losses"][0]   # fewer negatives: an easier loss"""),
    ],
}


def anchored(name: str, sources: list) -> list:
    """``[(index of the code cell a check follows, check source)]`` for notebook ``name`` whose code
    cells' sources are ``sources``, in order; ValueError when an anchor matches no cell or several."""
    out = []
    for anchor, check in CHECKS.get(name, []):
        hits = [i for i, s in enumerate(sources) if s.startswith(anchor)]
        if len(hits) != 1:
            raise ValueError(f"{name}: the check after the cell starting {anchor!r} matches {len(hits)} code cells "
                             "(one expected): update tests/notebook_checks.py with the cell")
        out.append((hits[0], check))
    return sorted(out, key=lambda hit: hit[0])
