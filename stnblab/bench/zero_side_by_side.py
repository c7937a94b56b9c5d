"""DeepSpeed's ZeRO stages next to stnb's native ones, run the same way: losses, memory per rank, speed.

    python -m stnblab.bench.zero_side_by_side                 # stages 1 2 3, the tiny model, 2 CPU ranks
    python -m stnblab.bench.zero_side_by_side --stages 2 --model minilm --steps 20

For each stage, the native strategy of that stage (the registered one whose ``aka`` is "ZeRO stage N":
zero1, zero2, fsdp) and ``deepspeed`` with ``stage=N`` train the same recipe (same seed, data, batch,
torch AdamW). Printed: the largest relative difference of their per-step losses, samples per second
(steps after the warm-up), and what rank 0 measured it holds after the first optimizer step
(parameters, gradients, optimizer state in MiB; DeepSpeed's optimizer state includes its fp32 master
partition) and its peak. Nothing is asserted: timings vary, the numbers are printed.
"""

from __future__ import annotations

import argparse


def native_of(stage: int) -> str:
    """The native strategy of a ZeRO stage, asked of the registry."""
    from stnb import strategies

    return next(s.name for s in strategies.all_strategies() if s.aka == f"ZeRO stage {stage}")


def engine() -> str:
    """The strategy that hands the run to DeepSpeed's engine (``owns_deepspeed``), asked of the registry."""
    from stnb import strategies

    return next(s.name for s in strategies.all_strategies() if s.owns_deepspeed)


def compare(stage: int, **options) -> list:
    """[(label, RunResult)] for the native stage and deepspeed's."""
    import stnb

    base = stnb.TrainConfig(**options)
    return [(native_of(stage), stnb.run(base.replace(strategy=native_of(stage)), echo=False)),
            (f"{engine()} stage {stage}", stnb.run(base.replace(strategy=engine(), stage=stage), echo=False))]


def rows(stage: int, pair: list) -> list:
    (_, ref), _ = pair
    out = []
    for label, r in pair:
        mb, mib = r.memory_breakdown[0], 2**20
        apart = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, ref.losses))
        out.append(f"{stage:>5}  {label:<18} {r.verified!s:<8} {apart:>9.1e} {r.losses[-1]:>10.5f} "
                   f"{r.samples_per_second:>9.1f} {mb['params'] / mib:>8.2f} {mb['grads'] / mib:>8.2f} "
                   f"{mb['optimizer_state'] / mib:>8.2f} {r.peak_memory_bytes[0] / mib:>9.1f}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stnblab.bench.zero_side_by_side", description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    options = dict(model=a.model, steps=a.steps, per_device_batch_size=a.batch_size, learning_rate=a.lr,
                   num_processes=a.nproc, device=a.device, train_size=max(64, a.steps * a.batch_size * a.nproc),
                   evaluate=False, stall_timeout=300)
    print(f"model {a.model}, {a.nproc} ranks on {a.device}, {a.steps} steps, batch {a.batch_size} per rank, "
          f"lr {a.lr}; memory: rank 0, MiB")
    print("stage  strategy           verified loss_apart final_loss samples/s   params    grads optimizer peak_MiB")
    for stage in a.stages:
        for line in rows(stage, compare(stage, **options)):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
