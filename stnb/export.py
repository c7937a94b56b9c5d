"""Export a notebook's training (a configuration, or your build function) as a standalone script
for torchrun / accelerate.

    >>> cfg = stnb.TrainConfig(strategy="ddp", model="minilm", steps=50)
    >>> script = stnb.export_script(cfg, "train.py")      # prints how to run it
    >>> script.commands["torchrun"]                       # one node
    'torchrun --standalone --nproc_per_node=2 train.py'
    >>> script.node_commands("torchrun")                  # several nodes: one line per node
    ['torchrun --nnodes=2 --nproc_per_node=2 --node_rank=0 ...', '... --node_rank=1 ...']

Your own training: ``stnb.export_script(build, "train.py", strategy="ddp", num_processes=2)`` writes
the build function's source and what it needs into the script (``stnb.buildsource``), or refuses
naming what exists only in this kernel.

From a shell: ``python -m stnb export --strategy ddp --model minilm --steps 50 --out train.py``
takes the same options as ``python -m stnb run``.

The script follows the sentence-transformers rule for multi-process training: all work is in
``main()``, called under ``if __name__ == "__main__":``. It embeds the configuration as a
dict and calls ``stnb.run`` (so stnb must be installed where it runs). Started by torchrun or
accelerate launch, ``stnb.run`` sees it is one rank of that launch and trains in place
(``stnb.scaleout``); started with plain ``python train.py`` it launches the ranks itself,
like the notebook. Rank 0 prints the RunResult as one JSON object on its last line, the same
form as a notebook run's result, so ``stnb.RunResult.from_dict(json.loads(line))`` goes into
the same comparison table and plots.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from .config import TrainConfig
from .errors import ConfigError
from .files import write_atomic

__all__ = ["export_script", "ExportedScript", "render_script", "add_cli"]


@dataclass
class ExportedScript:
    """What ``export_script`` wrote and how to run it.

    path: the script.
    nproc_per_node: processes per node used in the commands.
    num_nodes: nodes used in the multi-node commands.
    commands: one-node commands: 'python' (stnb launches the ranks), 'torchrun', 'accelerate'.
    multi_node: {'torchrun': [line for node 0, line for node 1, ...], 'accelerate': [...]}:
        run line i on node i (node 0 is the one at master_addr). Empty for 'single' / 'dp'.
    """

    path: str
    nproc_per_node: int
    num_nodes: int
    master_addr: str
    master_port: int
    commands: dict = field(default_factory=dict)
    multi_node: dict = field(default_factory=dict)

    def node_commands(self, launcher: str = "torchrun") -> list:
        """The multi-node command lines for ``launcher`` ('torchrun' or 'accelerate'), by node rank."""
        return list(self.multi_node[launcher])

    def __str__(self) -> str:
        """The commands as printed: the script's path relative to the working directory (or ``~/``), so a
        notebook's output shows no machine's layout (``commands`` keep the absolute path)."""
        from .files import shown

        return self._text().replace(self.path, shown(self.path))

    def _text(self) -> str:
        lines = [f"wrote {self.path}", "", "one node:"]
        lines += [f"  {c}" for c in self.commands.values()]
        if self.multi_node:
            lines += ["", f"{self.num_nodes} nodes, {self.nproc_per_node} process(es) each "
                          f"(node 0 at {self.master_addr}; run line i on node i):"]
        for launcher, cmds in self.multi_node.items():
            lines.append(f"  {launcher}:")
            lines += [f"    node {i}: {c}" for i, c in enumerate(cmds)]
        lines += ["", "rank 0 prints the RunResult as JSON on its last line "
                      "(stnb.RunResult.from_dict(json.loads(line)))"]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython shows the commands, not the dataclass
        p.text(str(self))


def _commands(script: str, nproc: int, num_nodes: int, master_addr: str, master_port: int,
              device: str, multi_node: bool = True) -> tuple[dict, dict]:
    s = shlex.quote(script)
    # `accelerate launch --cpu` starts ONE process unless given an MPI hostfile; --multi_gpu
    # starts N torch-elastic ranks, on GPUs or (gloo) on CPU cores.
    acc = "accelerate launch --multi_gpu"
    one = {
        "python": f"python {s}",
        "torchrun": f"torchrun --standalone --nproc_per_node={nproc} {s}",
        "accelerate": f"{acc} --num_processes={nproc} {s}" if nproc > 1 else
        f"accelerate launch{' --cpu' if device == 'cpu' else ''} --num_processes=1 {s}",
    }
    multi = {"torchrun": [], "accelerate": []}
    if not multi_node:
        return one, {}
    for node in range(num_nodes):
        multi["torchrun"].append(
            f"torchrun --nnodes={num_nodes} --nproc_per_node={nproc} --node_rank={node} "
            f"--master_addr={master_addr} --master_port={master_port} {s}")
        multi["accelerate"].append(
            f"{acc} --num_machines={num_nodes} --num_processes={num_nodes * nproc} --machine_rank={node} "
            f"--main_process_ip={master_addr} --main_process_port={master_port} {s}")
    return one, multi


_HEADER = '''\
#!/usr/bin/env python
"""Standalone training script exported by stnb {version} from {source}.

{needs}

Run it on one node:
{one_node}

{multi_node}

Under torchrun / accelerate launch every process is one rank: stnb trains in place, the
launcher decides the number of processes (WORLD_SIZE replaces num_processes below), and on CPU
each rank uses one thread unless threads_per_rank or OMP_NUM_THREADS says otherwise. With plain
`python`, stnb starts the ranks itself, as in the notebook.

Rank 0 prints the RunResult as one JSON object on the last line of its output, the same form
as a notebook run: stnb.RunResult.from_dict(json.loads(line)).
"""
'''


def render_script(config, *, script_name: str = "train.py", results_file=None,
                  nproc_per_node: int | None = None, num_nodes: int = 2, master_addr: str = "$MASTER_ADDR",
                  master_port: int = 29500, **options) -> tuple[str, dict, dict, int]:
    """(script text, one-node commands, multi-node commands, nproc per node) for ``config`` (a
    TrainConfig, a dict of its fields, or a build function with ``stnb.run``'s options); writes nothing."""
    from .builds import RecipeBuild, UserBuild, check_build
    from .hardware import versions

    if callable(config) and not isinstance(config, (TrainConfig, dict)):
        build = UserBuild(check_build(config))
        config = TrainConfig.for_build(**options)
    else:
        build = RecipeBuild()
        if isinstance(config, dict):
            config = TrainConfig.from_dict(config)
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"export_script needs a TrainConfig, a dict of its fields or a build function, "
                              f"got {type(config).__name__}")
        config = config.replace(**options) if options else config
    build.check(config)  # the options its kind of training takes
    # the script may run on another machine: check the config itself, not this machine's hardware
    config.validate(check_resources=False)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
    if nproc_per_node is not None and (isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int)
                                       or nproc_per_node < 1):
        raise ConfigError(f"nproc_per_node must be an integer >= 1, got {nproc_per_node!r}")
    if not config.strategy_object().distributed:
        if nproc_per_node not in (None, 1):
            raise ConfigError(f"strategy {config.strategy!r} runs in one process; nproc_per_node must be 1")
        nproc = 1
    else:
        nproc = nproc_per_node or config.world_size()
    distributed = config.strategy_object().distributed
    one, multi = _commands(script_name, nproc, num_nodes, master_addr, int(master_port),
                           config.resolved_device(), multi_node=distributed)
    if distributed:
        multi_text = (f"On {num_nodes} nodes ({nproc} process(es) each; node 0 is {master_addr}; "
                      "run line i on node i):\n" + "\n".join(f"  {name}:\n" + "\n".join(f"    {c}" for c in cmds)
                                                   for name, cmds in multi.items()))
    else:
        multi_text = f"strategy {config.strategy!r} runs in one process: export strategy 'ddp' or 'fsdp' for several nodes."
    results_file = None if results_file is None else os.fspath(results_file)
    script = build.script(config, options, results_file)  # how the script describes and embeds what it trains
    header = _HEADER.format(version=versions()["stnb"], source=script["source"], needs=script["needs"],
                            one_node="\n".join(f"    {c}" for c in one.values()), multi_node=multi_text)
    text = header + script["body"]
    return text, one, multi, nproc


def export_script(config, path, *, results_file=None, nproc_per_node: int | None = None,
                  num_nodes: int = 2, master_addr: str = "$MASTER_ADDR", master_port: int = 29500,
                  overwrite: bool = False, echo: bool = True, **options) -> ExportedScript:
    """Write a standalone training script for ``config`` to ``path`` and print how to run it.

    config: a TrainConfig (or a dict of its fields): the script embeds it as a dict. Or your build
        function with the options you give ``stnb.run``:
        ``export_script(build, "train.py", strategy="fsdp", num_processes=2)``: the script holds the
        function's source and what it reads (imports, literals, helper functions from the notebook;
        ``stnb.buildsource``), or ConfigError names what exists only in this kernel (a closure over a
        local, a dataset or model built in the notebook, a lambda, a function made by exec) and the fix.
    The script calls ``stnb.run`` in ``main()`` under ``if __name__ == "__main__":`` (stnb must be
    installed where it runs). Under torchrun or accelerate launch each process trains as one rank;
    rank 0 prints the RunResult JSON on its last line (and appends it to ``results_file`` when given).

    nproc_per_node: processes per node in the printed commands (default: the config's world size).
    num_nodes / master_addr / master_port: for the multi-node commands (one line per node;
        ``master_addr`` is node 0's address as the other nodes reach it).
    overwrite: replace an existing file (otherwise ConfigError: stnb never overwrites silently).
    echo: print the commands (they are also in the returned ``ExportedScript``).
    """
    path = os.fspath(path)
    target = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(target):
        raise ConfigError(f"{path!r} is a folder; give the script's file name, e.g. {os.path.join(path, 'train.py')!r}")
    if os.path.exists(target) and not overwrite:
        raise ConfigError(f"{path!r} already exists; choose another name or pass overwrite=True (--force)")
    text, one, multi, nproc = render_script(config, script_name=path, results_file=results_file,
                                            nproc_per_node=nproc_per_node, num_nodes=num_nodes,
                                            master_addr=master_addr, master_port=master_port, **options)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write {path!r}: {e}; choose a writable folder") from e
    write_atomic(target, text, 0o755, on_open_error=lambda e: ConfigError(
        f"cannot write {path!r}: {e}; choose a writable folder"))
    out = ExportedScript(path=path, nproc_per_node=nproc, num_nodes=num_nodes, master_addr=master_addr,
                         master_port=int(master_port), commands=one, multi_node=multi)
    if echo:
        print(out)
    return out


# ---------------------------------------------------------------------------------------
# CLI: python -m stnb export ... --out train.py


def add_cli(subparsers) -> None:
    from .cli_options import add_run_options

    p = subparsers.add_parser("export", help="write a standalone training script for torchrun / accelerate launch")
    add_run_options(p)
    p.add_argument("--out", required=True, help="the script to write, e.g. train.py")
    p.add_argument("--nnodes", type=int, default=2, help="nodes in the printed multi-node commands (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes per node in the printed commands (default: --nproc, or the default world size)")
    p.add_argument("--master-addr", default="$MASTER_ADDR", help="node 0's address for the multi-node commands")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=cmd_export)


def cmd_export(a) -> int:
    from .cli_options import config_from_args

    export_script(config_from_args(a), a.out, results_file=a.results, nproc_per_node=a.nproc_per_node,
                  num_nodes=a.nnodes, master_addr=a.master_addr, master_port=a.master_port,
                  overwrite=a.force, echo=True)
    return 0
