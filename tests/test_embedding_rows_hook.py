"""stnb.embedding_rows_hook: the embedding-rows DDP hook gives exactly DDP's default all-reduce, with less traffic."""

import pytest

import stnb
import rankfns

SMALL = dict(model="tiny", steps=4, train_size=128, dev_size=32, warmup_steps_excluded=1, evaluate=False,
             per_device_batch_size=4, strategy="ddp", num_processes=2)


@pytest.mark.parametrize("bucket_cap_mb,view,accumulate", [
    (25.0, False, 1),     # embedding, position table and linears in one bucket
    (0.05, False, 1),     # many buckets: the word embedding alone in one of them
    (0.05, True, 2),      # gradients as bucket views, accumulation under no_sync
])
def test_hook_equals_default_allreduce(bucket_cap_mb, view, accumulate):
    out = stnb.launch(rankfns.embedding_rows_exactness, bucket_cap_mb, view, accumulate, num_processes=2, echo=False)
    for r in out:
        assert r["rows"] == r["default"], "the hook changed the result of the all-reduce"
    assert out[0]["rows"] == out[1]["rows"]  # and the ranks agree
    stats = out[0]["stats"]
    assert stats["bucket_calls"] >= 3 and 0.2 < stats["traffic_saved"] < 1.0


def test_trainer_run_with_hook_matches_defaults():
    plain = stnb.run(stnb.TrainConfig(**SMALL), echo=False)
    rows = stnb.run(stnb.TrainConfig(comm_hook="embedding_rows", **SMALL), echo=False)
    assert rows.verified and rows.verification["weights_identical_across_ranks"]
    assert rows.verification["weights_checksums"] == plain.verification["weights_checksums"]
    assert rows.losses == plain.losses
    saved = rows.verification["ranks"][0]["embedding_rows"]
    assert saved["bucket_calls"] >= SMALL["steps"] and saved["traffic_saved"] > 0.5  # tiny: embeddings dominate
    assert "embedding_rows" not in plain.verification["ranks"][0]
    acc_plain = stnb.run(stnb.TrainConfig(gradient_accumulation_steps=2, **SMALL), echo=False)
    acc_rows = stnb.run(stnb.TrainConfig(gradient_accumulation_steps=2, comm_hook="embedding_rows", **SMALL),
                        echo=False)
    assert acc_rows.verification["weights_checksums"] == acc_plain.verification["weights_checksums"]
    assert acc_rows.losses == acc_plain.losses


def test_hook_refused_outside_ddp():
    with pytest.raises(stnb.ConfigError, match="is an option of ddp"):
        stnb.TrainConfig(strategy="single", comm_hook="embedding_rows").validate(check_resources=False)


def test_cli_takes_the_ddp_knobs():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "stnb", "run", "--strategy", "ddp", "--nproc", "2", "--model", "tiny",
                          "--steps", "3", "--batch-size", "4", "--train-size", "64", "--no-eval", "--accumulate", "2",
                          "--comm-hook", "embedding_rows", "--no-broadcast-buffers", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = r["config"]
    assert (cfg["gradient_accumulation_steps"], cfg["comm_hook"], cfg["broadcast_buffers"]) == (2, "embedding_rows", False)
    assert r["verified"] and r["global_batch_size"] == 2 * 4 * 2
    assert r["verification"]["ranks"][0]["embedding_rows"]["bucket_calls"] == 3  # one all-reduce per optimizer step
