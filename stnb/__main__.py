"""Command line: python -m stnb {run,hardware,bench,export,gpu-check} ..."""

from __future__ import annotations

import argparse
import json
import sys


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="ddp", help="single, dp, ddp or fsdp (default ddp)")
    p.add_argument("--nproc", "--num-processes", dest="nproc", type=int, default=None,
                   help="processes for ddp/fsdp (default: 2 on CPU, all GPUs). Under torchrun, whose own "
                        "--nproc_per_node makes --nproc ambiguous, use --num-processes or leave it out")
    p.add_argument("--model", default="minilm", help="minilm, tiny, a hub id or a local path")
    p.add_argument("--data", default="synthetic", help="synthetic, a .csv/.jsonl file or a hub dataset")
    p.add_argument("--loss", default="cosine", help="cosine or mnrl")
    p.add_argument("--gather-across-devices", action="store_true", help="mnrl: in-batch negatives from all ranks")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="per-device batch size")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-seq-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-size", type=int, default=2000, help="training pairs (synthetic data: generated)")
    p.add_argument("--dev-size", type=int, default=200, help="dev pairs for the Spearman evaluation")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads-per-rank", type=int, default=None)
    p.add_argument("--mixed-precision", default="no", help="no, bf16 or fp16")
    p.add_argument("--no-eval", action="store_true", help="skip the Spearman evaluation")
    p.add_argument("--save-to", default=None, help="folder for the trained model (must not exist)")
    p.add_argument("--results", default=None, help="append the RunResult to this JSONL file")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--stall-timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true", help="print the RunResult as one JSON object on the last line")
    g = p.add_argument_group("DDP knobs (TrainConfig fields of the same names)")
    g.add_argument("--accumulate", type=int, default=1, dest="gradient_accumulation_steps",
                   help="micro-batches per optimizer step; one all-reduce per step (no_sync)")
    g.add_argument("--comm-hook", default="none", help="none, fp16, bf16 (NCCL) or embedding_rows (exact)")
    g.add_argument("--bucket-cap-mb", type=float, default=None)
    g.add_argument("--gradient-as-bucket-view", action="store_true")
    g.add_argument("--static-graph", action="store_true")
    g.add_argument("--no-broadcast-buffers", dest="broadcast_buffers", action="store_false",
                   help="skip DDP's buffer broadcast at every forward (safe when buffers never change)")
    g.add_argument("--no-reuse-freed-memory", dest="reuse_freed_memory", action="store_false",
                   help="CPU: keep glibc's default allocator in the training processes")


def config_from_args(a):
    from .config import TrainConfig

    return TrainConfig(strategy=a.strategy, num_processes=a.nproc, model=a.model, data=a.data, loss=a.loss,
                       gather_across_devices=a.gather_across_devices, steps=a.steps,
                       per_device_batch_size=a.batch_size, learning_rate=a.lr, max_seq_length=a.max_seq_length,
                       seed=a.seed, train_size=a.train_size, dev_size=a.dev_size, device=a.device, threads_per_rank=a.threads_per_rank,
                       mixed_precision=a.mixed_precision, evaluate=not a.no_eval, save_to=a.save_to,
                       timeout=a.timeout, stall_timeout=a.stall_timeout,
                       gradient_accumulation_steps=a.gradient_accumulation_steps, comm_hook=a.comm_hook,
                       bucket_cap_mb=a.bucket_cap_mb, gradient_as_bucket_view=a.gradient_as_bucket_view,
                       static_graph=a.static_graph, broadcast_buffers=a.broadcast_buffers,
                       reuse_freed_memory=a.reuse_freed_memory)


def cmd_run(a) -> int:
    from .runner import run

    cfg = config_from_args(a)
    result = run(cfg, results_file=a.results, echo=not a.json)
    from .scaleout import is_main_process

    status = 0 if result.verified else 1  # every rank exits the same way; only rank 0 reports
    if not is_main_process():  # under torchrun / accelerate launch
        return status
    if a.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_summary(result)
    if status:
        print(f"error: the run finished, but {result.reason or 'it is not verified (no reason recorded)'}",
              file=sys.stderr)
    return status


def _print_summary(result) -> None:
    sps = f"{result.samples_per_second:.1f}" if result.samples_per_second else "n/a"
    print(f"strategy {result.strategy}  world_size {result.world_size}  global batch {result.global_batch_size}  "
          f"steps {result.steps}")
    print(f"samples/s {sps}  final loss {result.losses[-1] if result.losses else 'n/a'}  verified {result.verified}")
    if result.spearman_before is not None:
        print(f"spearman dev: before {result.spearman_before:.4f}  after {result.spearman_after:.4f}")


def cmd_hardware(a) -> int:
    from .hardware import report

    rep = report()
    print(json.dumps(rep.to_dict()) if a.json else rep)
    return 0


def main(argv=None) -> int:
    from .errors import StnbError

    parser = argparse.ArgumentParser(prog="python -m stnb", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="train once and print the RunResult")
    _add_run_args(p_run)
    p_run.set_defaults(func=cmd_run)
    p_hw = sub.add_parser("hardware", help="what this machine has and which strategies run here")
    p_hw.add_argument("--json", action="store_true")
    p_hw.set_defaults(func=cmd_hardware)
    for extra in _extra_commands():
        extra(sub)
    a = parser.parse_args(argv)
    try:
        return a.func(a)
    except StnbError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _extra_commands():
    """Sub-commands defined in other modules (bench, export, gpucheck) register themselves here."""
    out = []
    for modname in ("bench", "export", "gpucheck"):
        try:
            mod = __import__(f"stnb.{modname}", fromlist=["add_cli"])
        except ImportError:
            continue
        if hasattr(mod, "add_cli"):
            out.append(mod.add_cli)
    return out


if __name__ == "__main__":
    sys.exit(main())
