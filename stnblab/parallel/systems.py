"""The seeds' other systems: for each, what it splits, whether it ran here, and what in stnb does the job.

Each row records what happened when it was tried on this project's CPU machine (torch 2.13.0+cpu,
Python 3.11, 2 cores, gloo), with the command and the error quoted as printed. ``table()`` adds
whether the package is importable in the environment running it now, so a reader with another
setup sees the difference.
"""

from __future__ import annotations

import importlib.util

TRIED_ON = "2026-11-24, Linux x86_64, 2 CPU cores, torch 2.13.0+cpu, Python 3.11, no GPU"

SYSTEMS = [
    dict(system="Horovod 0.28.1", splits="data (ring all-reduce of gradients)", outcome="not run: does not build",
         tried="HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 pip install --no-build-isolation "
               "--no-deps --target ./hvd horovod==0.28.1",
         result="its torch extension (horovod/torch/mpi_ops_v2.cc) is compiled as C++14; torch 2.13's headers "
                "stop it: 'torch/csrc/api/include/torch/all.h:5:2: error: #error C++17 or later compatible "
                "compiler is required to use PyTorch.' 0.28.1 (2023) is Horovod's last release.",
         module="horovod", stnb="strategy 'ddp': DDP's bucketed all-reduce is the same ring all-reduce; stnb.launch plays "
                           "horovodrun's part"),
    dict(system="Megatron-LM (megatron-core 0.16.1)", splits="tensor (column/row), pipeline, sequence, context",
         outcome="not run: its layers need CUDA",
         tried="pip install --no-deps --target ./mc megatron-core; on 2 gloo ranks: "
               "parallel_state.initialize_model_parallel(tensor_model_parallel_size=2), then "
               "ColumnParallelLinear(384, 1536, config=ModelParallelConfig(..., use_cpu_initialization=True), "
               "gather_output=True) and a forward",
         result="installs (pure Python); the process groups initialise on gloo and the layer is built on the CPU, "
                "but the forward fails in megatron/core/tensor_parallel/mappings.py:91 (torch.empty(..., "
                "device=torch.cuda.current_device())): 'AssertionError: Torch not compiled with CUDA enabled'",
         module="megatron.core", stnb="stnblab.parallel.tensor_parallel: the same column/row layout (Megatron's), "
                                      "applied with torch's parallelize_module"),
    dict(system="FlexFlow 25.2.1", splits="searches a split per operator (sample, operator, attribute, parameter)",
         outcome="not run: GPU-only build",
         tried="pip install --no-deps --target ./fft flexflow==25.2.1 (a source distribution built with CMake)",
         result="CMake configures the CUDA backend (FF_GPU_BACKEND=cuda; the other is ROCm, there is no CPU one) "
                "and stops: 'CMake Error at cmake/cudnn.cmake:40 (message): CUDNN package not found -> specify "
                "search path via CUDNN_DIR variable'",
         module="flexflow", stnb="none automatic: the measured TP / PP / DDP costs and the guide in notebook 08 are "
                                 "the by-hand version of its search"),
    dict(system="DeepSpeed 0.19.8: pipeline engine", splits="layers into stages (deepspeed.pipe)",
         outcome="ran here (a toy model)",
         tried="on 2 gloo ranks (stnb.launch): deepspeed.init_distributed('gloo'); PipelineModule(4 x Linear(16, 16), "
               "num_stages=2, loss_fn=MSELoss()); deepspeed.initialize(train_batch_size=8, micro batch 2, 4 "
               "accumulation steps, SGD); engine.train_batch() 3 times",
         result="trained; both ranks reported the same 3 losses. On CPU DeepSpeed first compiles its shared-memory "
                "comm op with the system C++ compiler (minutes on 2 cores); a lock left in "
                "~/.cache/torch_extensions by an interrupted build makes every later start wait forever "
                "(TORCH_EXTENSIONS_DIR=<empty folder> avoids it)",
         module="deepspeed", stnb="stnblab.parallel.pipeline_parallel: torch.distributed.pipelining, on the encoder, "
                                  "checked against one process"),
    dict(system="DeepSpeed 0.19.8: ZeRO-Offload", splits="optimizer state and step moved to host memory / CPU",
         outcome="ran here (a toy model; nothing to offload from)",
         tried="on 2 gloo ranks: deepspeed.initialize with zero_optimization stage 2, offload_optimizer "
               "{'device': 'cpu'}, AdamW; 3 steps",
         result="trained; the optimizer became DeepSpeedZeroOptimizer over DeepSpeedCPUAdam (a C++ op compiled at "
                "start). On a CPU-only machine the model already lives in host memory: offload saves GPU memory, "
                "so it only pays with a GPU",
         module="deepspeed", stnb="none yet (FSDP2's CPUOffloadPolicy is torch's equivalent)"),
    dict(system="DP + PP", splits="pipelines side by side, gradients averaged across them",
         outcome="ran here, oversubscribed",
         tried="stnblab.parallel.pipeline_parallel(model, stages=2, data_parallel=2): 4 ranks",
         result="stnb.launch refuses 4 gloo ranks on 2 cores (one core per rank); with oversubscribe=True "
                "(torchrun, ranks sharing cores) it matches the single process (tests/test_parallel.py)",
         module=None, stnb="stnblab.parallel.pipeline_parallel(data_parallel=...)"),
    dict(system="DP + PP + TP (3D)", splits="replicas x stages x tensor shards",
         outcome="ran here, oversubscribed",
         tried="stnblab.parallel.pipeline_parallel(model, stages=2, data_parallel=2, tensor_parallel=2, "
               "oversubscribe=True): 8 ranks on 2 cores",
         result="matches the single process (tests/test_parallel.py); the timings are meaningless with 8 ranks "
                "taking turns on 2 cores",
         module=None, stnb="stnblab.parallel.pipeline_parallel(data_parallel=..., tensor_parallel=...)"),
]


def importable(name: str | None) -> bool | None:
    if name is None:  # not a package: a layout stnb runs
        return None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        return False


def table():
    """The systems as a DataFrame, with 'importable now' checked in this environment."""
    import pandas as pd

    rows = [dict(row, importable_now=importable(row["module"])) for row in SYSTEMS]
    return pd.DataFrame(rows).drop(columns="module")
