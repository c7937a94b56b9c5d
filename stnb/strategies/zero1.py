"""zero1 (ZeRO stage 1): optimizer state sharded, under DDP.

torch's ``ZeroRedundancyOptimizer`` wraps the trainer's optimizer: each rank keeps the optimizer state
(AdamW's two moments) of only its partition of the parameters, updates that partition, and broadcasts
it to the others; gradients are all-reduced by DDP as usual. Verified: the DDP wrapper, weights identical
across ranks (as for DDP), and the optimizer state, measured from each rank's local optimizer tensors,
covering a disjoint partition of the trainable parameters of about 1/N each that together is all of them.
"""

from __future__ import annotations

from .base import Strategy, load_scheduler, rebuild_optimizer, save_scheduler, torch_optimizer
from .ddp import TakesDDPOptions, apply_ddp, check_ddp_wrapper, ddp_step
from .stepcost import step

# optimizers whose update is elementwise per parameter, so a rank can update its own partition alone
ZERO_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adam", "adamw", "sgd", "adagrad", "rmsprop")


class Zero1(TakesDDPOptions, Strategy):
    name = "zero1"
    label = "ZeRO-1"
    aka = "ZeRO stage 1"
    summary = "DDP + ZeroRedundancyOptimizer: optimizer state sharded, parameters and gradients whole"
    color = "#9467bd"
    ddp_buckets = True
    sharded = frozenset({"optimizer_state"})
    order = 40

    def step_time(self, m, fab, n, host_fraction=None):
        """DDP's all-reduce, the optimizer on 1/n of the parameters, then every rank's updated shard sent to
        the others (torch's ZeroRedundancyOptimizer: an all-gather of the parameters), exposed."""
        r = ddp_step(m, fab, n)
        gather = fab.all_gather(m.param_bytes, n)
        return step(r["step"] - m.optimizer + m.optimizer / n + gather, r["comm"] + gather,
                    r["comm_exposed"] + gather)

    def validate(self, config):
        from ..errors import ConfigError

        if config.comm_hook == "embedding_rows":
            raise ConfigError("comm_hook='embedding_rows' sends sparse embedding gradients, which "
                              "ZeroRedundancyOptimizer's partition cannot take; use strategy='ddp' for it")

    def refusals(self, trainer, config):
        optim = str(getattr(trainer.args.optim, "value", trainer.args.optim))
        problems = []
        if trainer.optimizer is not None:
            problems.append(f"your trainer came with a ready optimizer ({type(trainer.optimizer).__name__}); "
                            "zero1 builds the optimizer itself to shard its state: pass optim=... in the "
                            "training arguments instead of optimizers=(...)")
        if optim not in ZERO_OPTIMIZERS:
            problems.append(f"optim={optim!r}: ZeroRedundancyOptimizer shards an elementwise torch optimizer "
                            f"({', '.join(ZERO_OPTIMIZERS)}); use one of them, or strategy='ddp'")
        return problems

    checkpoint_format = "zero1-shards"

    def saving(self, trainer):
        """Each rank writes and reads its own partition of the optimizer state (``optimizer.rank<r>-of-<n>.pt``):
        ZeroRedundancyOptimizer's whole state dict would need a consolidation on rank 0, the whole state in one
        process. The model, the scheduler and the RNG states are the trainer's own files."""
        import os

        import torch

        from .layouts import optimizer_names, write_names

        def shard(folder, what="pt"):
            return os.path.join(folder, self.shard_name(trainer.args.process_index, trainer.args.world_size, what))

        def save(output_dir):
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.local_optimizer(trainer).state_dict(), shard(output_dir))
            names = optimizer_names(trainer, self.local_optimizer(trainer))
            if names is not None:  # what another number of ranks reads the partition by (stnb.strategies.layouts)
                write_names(shard(output_dir, "names.json"), names)
            save_scheduler(trainer, output_dir)

        def load(checkpoint):
            if checkpoint is None:
                return
            local = self.local_optimizer(trainer)
            local.load_state_dict(torch.load(shard(checkpoint), map_location="cpu", weights_only=True))
            # ZeroRedundancyOptimizer copies its own groups' hyperparameters (the scheduled learning rate) into
            # the local optimizer at every step: they come from the checkpoint too
            for whole, mine in zip(torch_optimizer(trainer).param_groups, local.param_groups):
                whole.update({k: v for k, v in mine.items() if k != "params"})
            load_scheduler(trainer, checkpoint)

        trainer._save_optimizer_and_scheduler, trainer._load_optimizer_and_scheduler = save, load
        super().saving(trainer)  # a checkpoint of another layout (stnb.strategies.layouts)

    @staticmethod
    def shard_name(rank: int, world: int, what: str = "pt") -> str:
        """A rank's file of its optimizer partition ('pt'), or of the names of its parameters ('names.json')."""
        return f"optimizer.rank{rank}-of-{world}.{what}"

    def local_optimizer(self, trainer):
        return torch_optimizer(trainer).optim  # this rank's partition: the optimizer ZeroRedundancyOptimizer wraps

    def unreadable(self, path, written):
        import os

        n = written.get("world_size") or 0
        missing = [r for r in range(n) if not os.path.isfile(os.path.join(path, self.shard_name(r, n, "names.json")))]
        if not missing:
            return ""
        return (f"its optimizer partitions are numbered, without the names of their parameters (written by stnb "
                "since resuming on another layout exists, and only when the model owns every parameter the "
                f"optimizer updates); resume it with strategy={written.get('strategy')!r} and num_processes={n}")

    def read_optimizer(self, checkpoint):
        """Every rank's partition, by parameter name, merged into the whole optimizer state."""
        import os

        import torch

        from ..files import manifest
        from .layouts import by_name, merged, read_names

        n = manifest(checkpoint)["world_size"]
        parts = []
        for r in range(n):
            saved = torch.load(os.path.join(checkpoint, self.shard_name(r, n)), map_location="cpu", weights_only=True)
            parts.append(by_name(saved, read_names(os.path.join(checkpoint, self.shard_name(r, n, "names.json")))))
        return merged(parts)

    def prepare(self, trainer, config, device_type, world):
        kw, overridden = apply_ddp(trainer, config)

        def shard_state(built, defaults):
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if isinstance(built, ZeroRedundancyOptimizer):
                return built
            groups = [dict(g) for g in built.param_groups if g["params"]]
            return ZeroRedundancyOptimizer(groups, optimizer_class=type(built), **defaults)

        rebuild_optimizer(trainer, shard_state)
        accelerator, prepare_optimizer = trainer.accelerator, trainer.accelerator.prepare_optimizer

        def prepare_zero(optimizer, device_placement=None):
            # accelerate moves an optimizer's state by a state_dict round trip, which ZeRO refuses before it
            # consolidates; its state is empty here and lives where its parameters do already
            from torch.distributed.optim import ZeroRedundancyOptimizer

            if isinstance(optimizer, ZeroRedundancyOptimizer):
                device_placement = False
            return prepare_optimizer(optimizer, device_placement=device_placement)

        accelerator.prepare_optimizer = prepare_zero
        return {"info": {"ddp_asked": dict(kw), "optimizer": "ZeroRedundancyOptimizer"}, "overridden": overridden}

    def check_prepared(self, trainer, world_size):
        return check_ddp_wrapper(trainer)

    def check_step(self, trainer, world_size):
        """After the first optimizer step: the local optimizer holds state for this rank's partition only."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = torch_optimizer(trainer)
        if not isinstance(opt, ZeroRedundancyOptimizer):
            return {}, [f"the trainer's optimizer is {type(opt).__name__}, not a ZeroRedundancyOptimizer"]
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        local = [p for g in opt.optim.param_groups for p in g["params"]]
        with_state = [p for p in local if opt.optim.state.get(p)]
        return {"optimizer_partition": sorted(names.get(id(p), "?") for p in local),
                "optimizer_partition_numel": sum(p.numel() for p in local),
                "optimizer_state_params": len(with_state),
                "largest_param_numel": max((p.numel() for g in opt.param_groups for p in g["params"]), default=0),
                "optimizer_all_numel": sum(p.numel() for g in opt.param_groups for p in g["params"])}, []

    def check_ranks(self, rank_results, world_size):
        ranks = [r.verification for r in rank_results]
        parts = [set(v.get("optimizer_partition") or []) for v in ranks]
        total = ranks[0].get("optimizer_all_numel") or 0
        held = [v.get("optimizer_partition_numel") or 0 for v in ranks]
        problems = []
        union = set().union(*parts) if parts else set()
        overlap = sum(len(p) for p in parts) - len(union)
        if overlap:
            problems.append(f"{overlap} parameter(s) are in the optimizer partition of more than one rank")
        if sum(held) != total:
            problems.append(f"the ranks' optimizer partitions cover {sum(held)} parameter values, the optimizer "
                            f"updates {total}")
        biggest = max((v.get("largest_param_numel") or 0) for v in ranks) if ranks else 0
        ideal = total / max(1, world_size)
        if total and max(held) > ideal + biggest + 1:
            problems.append(f"a rank's optimizer partition holds {max(held)} of {total} values; over {world_size} "
                            f"ranks it should hold about {ideal:.0f}")
        if any(not v.get("optimizer_state_params") for v in ranks):
            problems.append("a rank holds no optimizer state after the first step")
        return {"optimizer_partition_fractions": [h / total if total else None for h in held]}, problems
