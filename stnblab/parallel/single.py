"""The single-process side every parallel run is compared with: batches, the loss, the reference run.

A batch is B (anchor, positive) pairs tokenized together: rows 0..B-1 are the anchors, rows B..2B-1
their positives, padded to the longest sentence of the batch (so pipeline microbatches share one
shape). The loss is sentence-transformers' MultipleNegativesRankingLoss (MNRL): scaled cosine
similarities of every anchor with every positive, cross-entropy against the diagonal; the other
positives of the batch are the negatives.

Dropout is switched off (``model.eval()``) on both sides so a parallel run and the reference do the
same arithmetic; gradients flow as in training.
"""

from __future__ import annotations

import time

import torch

MNRL_SCALE = 20.0  # MultipleNegativesRankingLoss's default


def mnrl(anchors: torch.Tensor, positives: torch.Tensor, scale: float = MNRL_SCALE) -> torch.Tensor:
    """MultipleNegativesRankingLoss on embeddings: cross-entropy of scaled cos-similarities vs the diagonal."""
    a = torch.nn.functional.normalize(anchors, p=2, dim=1)
    p = torch.nn.functional.normalize(positives, p=2, dim=1)
    scores = a @ p.T * scale
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(a), device=scores.device))


def mnrl_per_microbatch(embeddings: torch.Tensor, pairs: int, microbatches: int) -> torch.Tensor:
    """MNRL inside each microbatch only (its own pairs are the only negatives), averaged over microbatches."""
    a, p = embeddings[:pairs], embeddings[pairs:]
    return torch.stack([mnrl(x, y) for x, y in zip(a.chunk(microbatches), p.chunk(microbatches))]).mean()


def load(path: str):
    """The model at ``path`` on the CPU, dropout off."""
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in every rank and cell
    try:
        return SentenceTransformer(path, device="cpu").eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def make_batches(path: str, pairs: int, steps: int, seed: int = 0) -> list[dict]:
    """``steps`` batches of ``pairs`` synthetic (anchor, positive) pairs, tokenized (anchors then positives),
    all padded to one length (a pipeline stage's buffers keep the shape of its first step)."""
    from stnb.data import synthetic_positives

    ds = synthetic_positives(pairs * steps, seed=seed)
    tok = load(path)
    out = []
    for s in range(steps):
        rows = ds[s * pairs:(s + 1) * pairs]
        features = tok.preprocess(list(rows["anchor"]) + list(rows["positive"]))
        out.append({k: v for k, v in features.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
    length = max(b["input_ids"].shape[1] for b in out)
    pad = {"input_ids": tok.tokenizer.pad_token_id}
    return [{k: torch.nn.functional.pad(v, (0, length - v.shape[1]), value=pad.get(k, 0)) for k, v in b.items()}
            for b in out]


def encode(model, features: dict) -> torch.Tensor:
    return model(dict(features))["sentence_embedding"]


def reference(path: str, batches: list[dict], lr: float, microbatches: int = 1, threads: int | None = None) -> dict:
    """Train the plain model one step per batch in this process: the loss of every step, the first
    step's embeddings and gradients (by parameter name), and the time of a step.

    microbatches > 1: the loss is MNRL within each microbatch (what a per-microbatch pipeline loss computes).
    threads: torch threads while timing (a rank of a 2-rank launch on 2 cores gets 1).
    """
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model = load(path)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
        losses, step_s, first = [], [], {}
        for i, features in enumerate(batches):
            t0 = time.perf_counter()
            emb = encode(model, features)
            pairs = len(emb) // 2
            loss = mnrl_per_microbatch(emb, pairs, microbatches)
            loss.backward()
            step_s.append(time.perf_counter() - t0)
            if i == 0:
                first = dict(embeddings=emb.detach().clone(),
                             grads={n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return dict(losses=losses, step_s=step_s, **first)
    finally:
        torch.set_num_threads(before)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()
