"""Two ranks on one GPU: what NCCL and gloo say (issue 47). Run by gpu-check's 'shared' row in its own process.

    python -m stnblab.gpucheck.shared [--device cuda] [--stnb]

Three probes, each in two fresh (spawned) processes that both use ``cuda:0``:

- ``nccl``: an all_reduce over NCCL. NCCL is expected to refuse two ranks on one device; its words are kept.
- ``gloo_allreduce``: an all_reduce of CUDA tensors over gloo (gloo copies them through host memory).
- ``gloo_ddp``: ``DistributedDataParallel`` of a small CUDA model over gloo, each rank half of a batch; both
  ranks' gradients must equal the one-device gradient of the whole batch.

``--stnb`` adds what stnb itself does with two ranks on that GPU (``share_gpus=True``: rank i on GPU
i % GPUs, gloo, since NCCL wants a GPU per rank): ``stnb.parity`` trains every strategy runnable there
against one device.
Prints one JSON line: {probe: {ok, summary, ...}}. ``--device cpu`` runs the gloo probes on CPU tensors (tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback


def _rank(rank: int, probe: str, device: str, init: str, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if probe == "nccl" else "gloo"
    result = {"rank": rank}
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if probe in ("nccl", "gloo_allreduce"):
            t = torch.full((1 << 16,), float(rank + 1), device=dev)
            dist.all_reduce(t)
            result.update(ok=bool((t == 3.0).all().item()), device=str(t.device), value=float(t[0].item()))
        else:  # gloo_ddp
            from torch.nn.parallel import DistributedDataParallel as DDP

            torch.manual_seed(0)
            make = lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
            ref, net = make().to(dev), None
            torch.manual_seed(0)
            net = make().to(dev)
            ddp = DDP(net, device_ids=[0] if device == "cuda" else None)
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 32, generator=g).to(dev), torch.randn(8, 1, generator=g).to(dev)
            torch.nn.functional.mse_loss(ddp(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
            result.update(ok=diff < 1e-5, max_grad_difference=diff, device=str(next(net.parameters()).device))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - what the backend says is the result
        result.update(ok=False, error=f"{type(e).__name__}: {e}".strip()[:600])
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def probe(name: str, device: str, timeout: float = 90.0) -> dict:
    """Run one probe on two spawned ranks; {ok, summary, ranks}. A probe that hangs is stopped at ``timeout``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="stnb-shared-") as tmp:
        out = os.path.join(tmp, "rank")
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        t0 = time.time()
        ctx = mp.start_processes(_rank, args=(name, device, init, out), nprocs=2, join=False, start_method="spawn")
        while not ctx.join(timeout=1):
            if time.time() - t0 > timeout:
                for p in ctx.processes:
                    p.kill()
                return {"ok": False, "summary": f"no answer within {timeout:g} s (stopped)"}
        ranks = []
        for r in range(2):
            try:
                with open(f"{out}.{r}") as f:
                    ranks.append(json.load(f))
            except OSError:
                ranks.append({"rank": r, "ok": False, "error": "wrote no result"})
    ok = all(r.get("ok") for r in ranks)
    errors = sorted({r["error"] for r in ranks if r.get("error")})
    summary = ("works" if ok else "refused: " + " | ".join(errors) if errors else "wrong result") + \
        f" ({time.time() - t0:.1f} s)"
    return {"ok": ok, "summary": summary, "ranks": ranks}


def stnb_on_one_gpu(device: str) -> dict:
    """stnb.parity of every strategy runnable here with 2 ranks sharing one GPU over gloo (``share_gpus=True``),
    against one device. ``main`` shows this process one GPU, so two ranks share it even on a box with more."""
    from stnb import parity
    from stnb.config import TrainConfig

    cfg = TrainConfig(model="tiny", per_device_batch_size=8, max_seq_length=32, steps=6, warmup_steps_excluded=1,
                      train_size=128, dev_size=16, device=device, mixed_precision="no", evaluate=False,
                      share_gpus=device == "cuda")
    t0 = time.time()
    try:
        res = parity(cfg, num_processes=2, device=device, timeout=300, echo=False)  # every runnable one
    except Exception as e:  # noqa: BLE001 - the refusal or failure is the finding
        return {"ok": False, "summary": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-1500:]}
    table = res.table.to_dict(orient="records") if hasattr(res.table, "to_dict") else str(res.table)
    backends = sorted({str(v.get("backend")) for r in res.results.values() if r is not None
                       for v in (r.verification or {}).get("ranks", []) if v.get("backend")})
    return {"ok": bool(res.passed), "summary": f"parity {'passed' if res.passed else 'FAILED'} over "
            f"{'/'.join(backends)} ({time.time() - t0:.0f} s)", "table": table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stnblab.gpucheck.shared")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--stnb", action="store_true", help="also stnb.parity of the sharded strategies on that GPU")
    a = p.parse_args(argv)
    if a.device == "cuda":  # one GPU for every probe: its ranks share it (set before anything starts CUDA)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
        os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0].strip() or "0"
    found = {}
    for name in (["nccl"] if a.device == "cuda" else []) + ["gloo_allreduce", "gloo_ddp"]:
        found[name] = probe(name, a.device)
    if a.stnb:
        found["stnb_parity"] = stnb_on_one_gpu(a.device)
    print(json.dumps(found, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
