"""Beyond data parallelism: tensor (TP) and pipeline (PP) parallelism on a sentence encoder.

    plans   what may be split, checked from config.json before any process starts
    single  batches, the MNRL loss and the single-process reference every run is compared with
    tp      inside a rank: shard each layer (parallelize_module), check the shards, count collectives
    pp      inside a rank: one pipeline stage, GPipe / 1F1B, timing of every microbatch
    runs    from a notebook cell: tensor_parallel(...), pipeline_parallel(...)
    systems the other systems (Horovod, Megatron-LM, ...): what was tried here, and what happened
"""

from . import plans, pp, single, systems, tp
from .runs import PP_RUNS, TOLERANCE, PPResult, TPResult, pipeline_parallel, tensor_parallel

__all__ = ["plans", "pp", "single", "systems", "tp", "PP_RUNS", "TOLERANCE", "PPResult", "TPResult", "pipeline_parallel", "tensor_parallel"]
