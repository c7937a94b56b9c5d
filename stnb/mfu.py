"""Model FLOPs utilisation (MFU): the FLOPs training needs, over what the device could do.

FLOPs of one training pass (forward + backward) over a batch of ``b`` sequences padded to ``T``
tokens, for an encoder with ``L`` layers of width ``d`` (PaLM, Chowdhery et al. 2022, appendix B):

    6 * N * b * T  +  12 * L * d * b * T**2

* ``N``: the weights of the matrix multiplications outside the embeddings, i.e. every
  ``nn.Linear`` weight except those under ``embeddings`` and the unused ``pooler``. Each weight is
  one multiply-add (2 FLOPs) per token forward and two backward (gradients of input and weight):
  6 FLOPs. Embedding look-ups, biases, LayerNorm, softmax and pooling are not matrix products and
  are left out (they are < 0.2 % of mpnet-base's count).
* ``12 L d T`` per token: attention's two products (Q K^T and the weighted sum of V), 2 FLOPs
  per multiply-add, forward + backward (x3), full (bidirectional) attention.
* ``T`` is the padded length the GPU really computed: each batch is padded to its longest text
  (at most ``max_seq_length``), so a short-sentence data set at ``max_seq_length=384`` runs at
  ~20-30 tokens, not 384. The counts come from the input ids each training forward received
  (``FlopMeter``): every text column of the loss (two sentences per pair), every micro-batch.

MFU = achieved FLOP/s / peak FLOP/s. The peak is the vendor's dense (no sparsity) tensor-core
figure for the run's precision from ``PEAK_TFLOPS``, or, for a GPU not in the table, measured
with a large matrix multiplication (``measure_peak``), which says so in ``peak_source``.
Precision: bf16 / fp16 mixed precision use the bf16 / fp16 peak; fp32 runs use the fp32 peak, or
the tf32 one when torch is allowed to use TF32 for float32 matmuls.
"""

from __future__ import annotations

import re
import threading

# dense TFLOP/s per GPU (vendor datasheets; "with sparsity" figures halved). None: no tensor cores
# for that precision (bf16 on T4 / V100 is emulated; those GPUs have no tf32).
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "T4": {"bf16": None, "fp16": 65.0, "tf32": None, "fp32": 8.1},
    "V100 SXM2": {"bf16": None, "fp16": 125.0, "tf32": None, "fp32": 15.7},
    "V100 PCIe": {"bf16": None, "fp16": 112.0, "tf32": None, "fp32": 14.0},
}
# device name (as torch / nvidia-smi print it) -> table row; first match wins
_NAME_RULES = (
    (r"H200.*NVL", "H200 NVL"),     # the PCIe card: lower clocks than the SXM part
    (r"H200", "H200"),
    (r"H100.*NVL", "H100 NVL"),
    (r"H100.*PCIE", "H100 PCIe"),
    (r"H100", "H100 SXM"),          # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"A100", "A100"),
    (r"\bL4\b", "L4"),              # not L40 / L40S
    (r"\bT4\b", "T4"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100 SXM2"),
)
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def known_gpu(name: str) -> str | None:
    """The PEAK_TFLOPS row for a device name ('NVIDIA H100 80GB HBM3' -> 'H100 SXM'), or None. A MIG
    slice ('... MIG 1g.10gb') has a fraction of its GPU's SMs: None, so its peak is measured."""
    if re.search(r"\bMIG\b", name or ""):
        return None
    for pattern, row in _NAME_RULES:
        if re.search(pattern, name or "", re.IGNORECASE):
            return row
    return None


def table_peak(name: str, precision: str) -> float | None:
    """Peak FLOP/s of a known GPU at ``precision`` (bf16, fp16, tf32, fp32); None when unknown."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    row = known_gpu(name)
    tflops = PEAK_TFLOPS[row][precision] if row else None
    return None if tflops is None else tflops * 1e12


def matmul_precision(mixed_precision: str) -> str:
    """The precision training matmuls run at: 'bf16' / 'fp16' under mixed precision, else fp32 or tf32."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    import torch

    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def measure_peak(device: str, precision: str, n: int = 4096, iters: int = 20) -> float:
    """FLOP/s of an n x n x n matrix multiplication at ``precision`` on ``device`` (best of 3 timings)."""
    import time

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 * iters / best


def device_peak(device: str, mixed_precision: str) -> dict | None:
    """Inside a rank: this GPU's peak for the run's precision (table, else measured). None on CPU."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    precision = matmul_precision(mixed_precision)
    name = torch.cuda.get_device_name(torch.cuda.current_device())
    peak = table_peak(name, precision)
    source = f"datasheet ({known_gpu(name)}, {precision} dense)"
    if peak is None:
        peak = measure_peak(device, precision)
        why = "a MIG slice" if " MIG " in f" {name} " else "not in stnb.mfu.PEAK_TFLOPS"
        source = f"measured: {precision} 4096^3 matmul on this GPU ({name}: {why})"
    return {"gpu": name, "precision": precision, "flops_per_s": peak, "source": source}


# ---- the model's shape and FLOPs ----------------------------------------------------------------

def flops_shape(model) -> dict:
    """{'layers', 'hidden', 'matmul_params'} of a SentenceTransformer (or any module holding a HF model)."""
    import torch

    layers = hidden = None
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "num_hidden_layers", None) and getattr(cfg, "hidden_size", None):
            layers, hidden = int(cfg.num_hidden_layers), int(cfg.hidden_size)
            break
    if layers is None:
        raise ValueError(f"no Hugging Face config with num_hidden_layers / hidden_size in {type(model).__name__}")
    skip = set()  # modules inside the embeddings (lookups, not matmuls) and BERT's unused pooler
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("embeddings", "pooler"):
            skip |= {id(sub) for sub in m.modules()}
    n = 0
    for m in model.modules():
        # every matmul counts, a head whose weight is tied to the embeddings too (a sparse encoder's MLM
        # decoder: vocabulary x hidden per token, the largest matmul of the model)
        if isinstance(m, torch.nn.Linear) and id(m) not in skip:
            n += m.weight.numel()  # a DTensor's numel is the global one
    return {"layers": layers, "hidden": hidden, "matmul_params": n}


def train_flops(shape: dict, batch: int, seq_len: int) -> float:
    """FLOPs of forward + backward over ``batch`` sequences padded to ``seq_len`` (module docstring)."""
    tokens = batch * seq_len
    return 6.0 * shape["matmul_params"] * tokens + 12.0 * shape["layers"] * shape["hidden"] * batch * seq_len ** 2


class FlopMeter:
    """Counts the training FLOPs of every forward the model's first module (the Transformer) runs.

    ``start_step()`` at the beginning of an optimizer step (forgets evaluation forwards in between),
    ``end_step()`` at its end: ``per_step`` gets that step's FLOPs, ``tokens`` the padded token count.
    Thread-safe (DataParallel runs the replicas' forwards in threads).
    """

    def __init__(self, model):
        self.shape = flops_shape(model)
        self.per_step: list = []
        self.tokens: list = []
        self._flops = 0.0
        self._tokens = 0
        self._lock = threading.Lock()
        self._handle = model[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        features = args[0] if args else kwargs.get("features", kwargs)
        ids = features.get("input_ids") if hasattr(features, "get") else None  # a dict or a BatchEncoding (CrossEncoder)
        if ids is None or ids.dim() != 2:
            return
        b, t = int(ids.shape[0]), int(ids.shape[1])
        with self._lock:
            self._flops += train_flops(self.shape, b, t)
            self._tokens += b * t

    def start_step(self) -> None:
        with self._lock:
            self._flops, self._tokens = 0.0, 0

    def end_step(self) -> None:
        with self._lock:
            self.per_step.append(self._flops)
            self.tokens.append(self._tokens)
            self._flops, self._tokens = 0.0, 0

    def remove(self) -> None:
        self._handle.remove()


def summarize(rank_results: list, warm: int, n_steps: int, span: float, samples: int, devices: int) -> dict | None:
    """MFU over the measured steps, from every rank's ``train_flops`` and ``peak`` (results.merge; the
    ranks' ``rankreport.RankReport``s).

    ``devices``: GPUs each rank drives (DataParallel: all of them; otherwise 1). ``mfu`` is None on
    CPU (no peak) and where a rank measured nothing."""
    if not span or span <= 0 or not samples or any(not r.train_flops for r in rank_results):
        return None
    flops = sum(sum(r.train_flops[warm:n_steps]) for r in rank_results)
    tokens = sum(sum(r.train_tokens[warm:n_steps]) for r in rank_results)
    achieved = flops / span
    peaks = [r.peak for r in rank_results]
    out = {"achieved_tflops": achieved / 1e12, "flops_per_sample": flops / samples,
           "tokens_per_sample": tokens / samples, "shape": rank_results[0].flops_shape,
           "mfu": None, "peak_tflops": None, "peak_source": None, "gpu": None, "precision": None}
    if all(peaks):
        total = sum(p["flops_per_s"] for p in peaks) * devices
        out.update(mfu=achieved / total, peak_tflops=total / 1e12, peak_source=peaks[0]["source"],
                   gpu=peaks[0]["gpu"], precision=peaks[0]["precision"])
    else:
        out["peak_source"] = "none: CPU run (MFU is reported for GPU runs)"
    return out
