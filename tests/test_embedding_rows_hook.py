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


# ---- host synchronisation: what the hook costs on CUDA, counted on CPU -------------------------------

def _sync_ops():
    """aten ops that make the host wait for a CUDA device (their output size or value is data the host
    must read): nonzero, item (_local_scalar_dense), masked_select, unique, boolean-mask indexing."""
    import torch

    a = torch.ops.aten
    return {a.nonzero.default, a._local_scalar_dense.default, a.masked_select.default, a.is_nonzero.default,
            a._unique2.default, a.unique_dim.default, a.unique_consecutive.default, a.equal.default}


def _hook_sync_counts(bucket_cap_mb: float) -> dict:
    """A toy DDP model with three 32-wide embeddings (words, positions, types) and a 48-wide one, trained
    3 steps with the embedding_rows hook; every aten op the hook runs during backward passes through a
    dispatch mode that counts the syncing ones. Per bucket call: (step, syncs, embedding widths)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from stnb import embedding_rows_hook

    sync_ops = _sync_ops()

    class SyncCounter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in sync_ops or (func is torch.ops.aten.index.Tensor
                                    and any(getattr(i, "dtype", None) == torch.bool for i in args[1])):
                self.count += 1
            return func(*args, **(kwargs or {}))

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.words, self.pos = torch.nn.Embedding(3000, 32), torch.nn.Embedding(16, 32)
            self.types, self.tags = torch.nn.Embedding(2, 32), torch.nn.Embedding(50, 48)
            self.mix, self.out = torch.nn.Linear(32, 48), torch.nn.Linear(48, 1)

        def forward(self, ids):
            h = self.words(ids) + self.pos(torch.arange(ids.shape[1])) + self.types(ids % 2)
            return self.out(torch.tanh(self.mix(h)) + self.tags(ids % 50)).mean()

    torch.manual_seed(0)
    model = Toy()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    widths = {p.data_ptr(): p.shape[1] for p in embedding_rows_hook.embedding_weights(model)}
    state = embedding_rows_hook.RowSyncState(None, set(widths))
    calls, step = [], [0]

    def counted(st, bucket):
        with SyncCounter() as c:
            fut = embedding_rows_hook.embedding_rows_hook(st, bucket)
        calls.append((step[0], c.count, sorted({widths[p.data_ptr()] for p in bucket.parameters()
                                                 if p.data_ptr() in widths})))
        return fut

    ddp.register_comm_hook(state, counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step[0] in range(3):
        ddp(torch.randint(0, 3000, (4, 16), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    return {"calls": calls, "stats": state.stats()}


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.05])
def test_hook_host_syncs_one_per_embedding_width_in_a_bucket(bucket_cap_mb):
    """On CUDA each syncing op in the hook stops the host mid-backward until the GPU catches up. The hook
    picked each embedding matrix's rows with its own nonzero(); it now picks every row of one width in a
    bucket with one (4 embeddings of 2 widths: at most 2 syncs per bucket, was 4), and counts them. Those
    buckets are the last ones of each backward pass (the embeddings' gradients are computed last), so no
    backward compute is left to overlap with: the cost is the host's wait, once per such bucket."""
    out = stnb.launch(_hook_sync_counts, bucket_cap_mb, num_processes=2, echo=False)
    for r in out:
        calls = r["calls"]
        assert {s for s, _, _ in calls} == {0, 1, 2}
        assert any(w for _, _, w in calls)
        for step, syncs, widths in calls:
            assert syncs == len(widths), (step, syncs, widths)
        assert r["stats"]["host_syncs"] == sum(s for _, s, _ in calls)
        for step in range(3):
            order = [bool(w) for s, _, w in calls if s == step]
            assert order == sorted(order), f"a bucket without embeddings was reduced after one with: {order}"
