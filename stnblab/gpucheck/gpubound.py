"""The GPU-bound rows (issue 47): work that keeps the GPU busy, and two ranks sharing one GPU.

- **Long texts** (``long_pairs_file``): stnb's synthetic pairs joined into texts of ``words`` words, so
  every sequence fills ``max_seq_length`` (the GPU-bound ratio row and the MFU row train on them).
- **The MFU row** (``check_mfu``): the plain sentence-transformers script on those texts, once per
  variant of what the stack offers (``MFU_VARIANTS``: the attention kernel, ``torch.compile``, and
  mpnet-base's shape against BERT-base's, whose attention can use SDPA), each with its MFU against
  the chip's peak. It measures; it passes when every variant trained (finite loss, an MFU).
- **Ranks sharing a GPU** (``check_shared``): ``python -m stnblab.gpucheck.shared`` (its own process:
  this one never starts CUDA) asks NCCL and gloo for two ranks on one device, and (``--stnb``) stnb.parity
  of every strategy with two ranks sharing it (``share_gpus=True``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

from .report import Outcome

#: the source checkout the plain script and the sharing probe run in (python -m finds stnblab there)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: the GPU-bound ratio and MFU rows: mpnet-base's shape, seq 256 (every text is longer, so no padding),
#: 64 pairs a step (128 sequences of 256 tokens: 32,768 tokens, ~1.8e13 FLOPs a step)
GPU_BOUND = dict(model="mpnet-base-random", per_device_batch_size=64, max_seq_length=256, steps=60,
                 warmup_steps_excluded=10, train_size=640, dev_size=64, timeout=300.0, stall_timeout=120.0,
                 evaluate=False, long_words=240)
#: the MFU row's variants: (name, model, plain-script arguments)
MFU_VARIANTS = (("mpnet-base, eager attention (the default)", "mpnet-base-random", []),
                ("bert-base shape, SDPA", "bert-base-random", ["--attn", "sdpa"]),
                ("bert-base shape, eager attention", "bert-base-random", ["--attn", "eager"]),
                ("bert-base shape, SDPA + torch.compile", "bert-base-random", ["--attn", "sdpa", "--compile"]),
                ("mpnet-base, torch.compile", "mpnet-base-random", ["--compile"]),
                # tokenizing off the training loop (the H200 of 2026-11-30: the collator took 52 ms of a 258 ms step)
                ("mpnet-base, tokenizing in 2 dataloader workers", "mpnet-base-random", ["--workers", "2"]))
#: the MFU row reads the loss every 10 steps (a host sync each time; the ratio row logs every step, as stnb's recipe)
MFU_LOGGING_STEPS = 10
#: BERT-base's shape (bert-base-uncased: 12 layers, hidden 768, 12 heads), random weights, MiniLM's tokenizer
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)


def long_texts(sentences: list, words: int) -> list:
    """Consecutive ``sentences`` joined until each text has at least ``words`` words (the last, short
    remainder is dropped); deterministic."""
    out, cur, n = [], [], 0
    for s in sentences:
        cur.append(s)
        n += len(s.split())
        if n >= words:
            out.append(" ".join(cur))
            cur, n = [], 0
    return out


def long_pairs_file(folder: str, pairs: int, words: int, seed: int = 0) -> str:
    """A .jsonl of ``pairs`` (sentence1, sentence2, score) rows whose texts have >= ``words`` words each:
    stnb's synthetic pairs joined (``long_texts``), the score the mean of the joined pairs' scores."""
    from stnb.data import synthetic_pairs

    per = 1
    while True:  # enough synthetic pairs for `pairs` long ones (a synthetic sentence has ~8-12 words)
        ds = synthetic_pairs(pairs * per, seed)
        a, b = long_texts(ds["sentence1"], words), long_texts(ds["sentence2"], words)
        if min(len(a), len(b)) >= pairs:
            break
        per *= 2
    # the score of a joined pair: the mean over the synthetic pairs its first text joined
    k = max(1, len(ds) // max(len(a), 1))
    scores = [sum(ds["score"][i * k:(i + 1) * k]) / k for i in range(pairs)]
    path = os.path.join(folder, f"long-pairs-{pairs}x{words}w.jsonl")
    with open(path, "w") as f:
        for s1, s2, sc in zip(a[:pairs], b[:pairs], scores):
            f.write(json.dumps({"sentence1": s1, "sentence2": s2, "score": round(sc, 4)}) + "\n")
    return path


def model_path(name: str, folder: str) -> str:
    """A model folder: stnb's own names through ``stnb.models.resolve_model``; 'bert-base-random' built here."""
    from stnb.models import resolve_model

    if name != "bert-base-random":
        return resolve_model(name)
    from transformers import BertConfig, BertModel

    from stnb.models import build_random

    target = os.path.join(folder, "bert-base-random")
    if not os.path.isdir(target):
        build_random(target, os.path.join(folder, "bert-base-scratch"), lambda: BertModel(BertConfig(**BERT_BASE)),
                      512, normalize=False)
    return target


def mfu_verdict(rows: list) -> tuple:
    """(status, error) of the MFU row: passed when every variant trained to a finite loss and measured an
    MFU on the GPU (an MFU above 1 is a counting error, never a pass)."""
    bad = []
    for r in rows:
        if r.get("error"):
            bad.append(f"{r['variant']}: {r['error']}")
        elif r.get("final_loss") is None or not math.isfinite(r["final_loss"]):
            bad.append(f"{r['variant']}: loss {r.get('final_loss')}")
        elif r.get("mfu") is None or not 0 < r["mfu"] <= 1:
            bad.append(f"{r['variant']}: MFU {r.get('mfu')}")
    return ("failed", "; ".join(bad)) if bad or not rows else ("passed", "")


def check_mfu(check, machine) -> Outcome:
    """The plain script once per ``MFU_VARIANTS`` entry on the same long texts; MFU and samples/s of each."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="stnb-gpucheck-mfu-") as tmp:
        p = dict(check.params, data=long_pairs_file(tmp, check.params["train_size"] + check.params["dev_size"],
                                                    check.params["long_words"]))
        for name, model, extra in p.get("variants", MFU_VARIANTS):
            try:
                rows.append(dict(plain_run(p, model_path(model, tmp), MFU_LOGGING_STEPS, extra), variant=name))
            except Exception as e:  # noqa: BLE001 - a variant that fails is a row of the table, not a crash
                rows.append({"variant": name, "error": f"{type(e).__name__}: {e}".strip()[-400:]})
            if p.get("echo"):  # each variant as it ends (a run stopped from outside keeps them)
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "step_times"}), flush=True)
    status, error = mfu_verdict(rows)
    best = max((r for r in rows if r.get("mfu")), key=lambda r: r["mfu"], default=None)
    detail = "; ".join(f"{r['variant']}: " + (f"MFU {r['mfu']:.1%}, {r['samples_per_second']:.0f} samples/s"
                                              if r.get("mfu") else "failed") for r in rows)
    return Outcome(check.name, check.kind, status, detail=detail, error=error,
                   metrics={"variants": rows, "mfu": best["mfu"] if best else None,
                            "samples_per_second": best["samples_per_second"] if best else None,
                            "best_variant": best["variant"] if best else None})


def check_shared(check, machine) -> Outcome:
    """Two ranks on one GPU, asked of NCCL and of gloo on CUDA tensors (``shared.main``), in a child process."""
    cmd = [sys.executable, "-m", "stnblab.gpucheck.shared", "--device", check.params.get("device", "cuda")]
    cmd += ["--stnb"] if check.params.get("stnb") else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=check.params.get("timeout", 240),
                         env=plain_env(check.params.get("device", "cuda")), cwd=ROOT)
    try:
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return Outcome(check.name, check.kind, "failed",
                       error=f"exit {out.returncode}, no report: {out.stderr.strip()[-600:]}")
    status, error = shared_verdict(found)
    return Outcome(check.name, check.kind, status, metrics=found, error=error,
                   detail="; ".join(f"{k}: {v.get('summary', v)}" for k, v in found.items() if isinstance(v, dict)))


def shared_verdict(found: dict) -> tuple:
    """(status, error): passed when gloo's all_reduce of CUDA tensors summed right, DDP over gloo gave both
    ranks the gradient one device computes on the whole batch and (asked with ``--stnb``) stnb.parity passed every
    strategy with 2 ranks sharing the GPU; NCCL's answer is reported, not judged."""
    bad = []
    g = found.get("gloo_allreduce") or {}
    if not g.get("ok"):
        bad.append(f"gloo all_reduce on CUDA tensors: {g.get('summary') or g}")
    d = found.get("gloo_ddp") or {}
    if not d.get("ok"):
        bad.append(f"DDP over gloo on one GPU: {d.get('summary') or d}")
    own = found.get("stnb_parity")
    if own is not None and not own.get("ok"):
        bad.append(f"stnb's strategies, 2 ranks sharing one GPU (share_gpus): {own.get('summary') or own}")
    return ("failed", "; ".join(bad)) if bad else ("passed", "")


def plain_env(device: str) -> dict:
    """The plain script's environment: pinned to the GPU stnb.run(strategy='single') uses
    (``hardware.single_gpu_env``: the first entry of CUDA_VISIBLE_DEVICES as the user wrote it, not
    the renumbered visible ordinal, which names another GPU when CUDA_VISIBLE_DEVICES=3)."""
    from stnb.hardware import single_gpu_env

    pin = single_gpu_env() if device == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", **pin)


def plain_run(p: dict, model_path: str, logging_steps: int | None = None, extra=()) -> dict:
    """One run of the plain script with the row's params ``p`` (logging as often as stnb's recipe unless
    ``logging_steps`` says otherwise; ``extra``: more of its arguments); its JSON line."""
    from stnb.recipe import LOGGING_STEPS

    device = p.get("device", "cuda")
    env = plain_env(device)
    cmd = [sys.executable, "-m", "stnblab.gpucheck.plain", "--model", model_path, "--data", p.get("data", "synthetic"),
           "--batch-size",
           str(p["per_device_batch_size"]), "--steps", str(p["steps"]), "--warmup", str(p["warmup_steps_excluded"]),
           "--max-seq-length", str(p["max_seq_length"]), "--mixed-precision", p["mixed_precision"],
           "--train-size", str(p["train_size"]), "--dev-size", str(p["dev_size"]),
           "--logging-steps", str(logging_steps or LOGGING_STEPS), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=p["timeout"], env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the plain script exited {out.returncode}: {out.stderr[-1500:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if data["device"] != device:
        raise RuntimeError(f"the plain script ran on {data['device']}, not {device}")
    return data
