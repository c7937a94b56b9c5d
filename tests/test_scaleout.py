"""Scaling out: the same run under torchrun / accelerate launch, on one node or two.

Real processes throughout: two "nodes" are two separate processes on localhost that meet
at a master address and port, exactly as two machines would.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stnb
from stnb import scaleout
from stnb.config import TrainConfig
from stnb.errors import ConfigError
from stnb.processes import free_port
from stnb.results import RunResult, load_results, results_frame
from stnb.strategies import is_distributed, names

STRATEGIES = names()
ONE_PROCESS = tuple(n for n in STRATEGIES if not is_distributed(n))

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = dict(strategy="ddp", model="tiny", steps=3, per_device_batch_size=4, train_size=64, dev_size=16,
            device="cpu", threads_per_rank=1, timeout=120, stall_timeout=60)
CLI_TINY = ["--strategy", "ddp", "--model", "tiny", "--steps", "3", "--batch-size", "4", "--device", "cpu",
            "--no-eval", "--json"]
LAUNCH_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "STNB_LAUNCH", "MASTER_ADDR",
               "MASTER_PORT", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def _run_together(cmds, cwd, timeout=150, env=None):
    """Start every command at once (the nodes), wait for all; kill all on timeout."""
    procs = [subprocess.Popen(c, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for c in cmds]
    deadline = time.time() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return outs


def _run_on_a_free_port(make_cmds, cwd, timeout=150):
    """Run the nodes' commands on a free master port; once more on a new port if another program
    on this machine took the port between choosing it and binding it."""
    for attempt in (1, 2):
        outs = _run_together(make_cmds(free_port()), cwd=cwd, timeout=timeout)
        collided = any(rc != 0 and ("address already in use" in err.lower() or "eaddrinuse" in err.lower())
                       for rc, _, err in outs)
        if not collided:
            break
    return outs


def _failure(i, rc, out, err) -> str:
    return f"node {i} exited with {rc}\n--- stdout ---\n{out[-2000:]}\n--- stderr ---\n{err[-4000:]}"


def _last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, "no output"
    return json.loads(lines[-1])


def _check_run_result(d: dict, launcher: str, world: int) -> RunResult:
    assert d["world_size"] == world, d["verification"]
    assert d["launcher"] == launcher
    assert d["verified"] is True, d["verification"]
    assert d["steps"] == 3
    assert d["verification"]["world_size_seen"] == [world]
    assert d["verification"]["weights_identical_across_ranks"] is True
    rr = RunResult.from_dict(d)
    assert rr.to_dict() == d  # the script's JSON is exactly a RunResult
    return rr


# ---------------------------------------------------------------------------------------
# rank function for the two-node stnb.launch test (runs inside each node's rank)


def two_node_rank(config: stnb.TrainConfig, model_path: str) -> dict:
    import torch
    import torch.distributed as dist

    from stnb.builds import RecipeBuild
    from stnb.training import train_rank

    print(f"hello from global rank {dist.get_rank()}", flush=True)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    trained = train_rank(config, RecipeBuild(model_path))
    ctx = stnb.rank_context()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "allreduce": t.item(),
            "ctx_rank": ctx.rank, "ctx_world": ctx.world_size, "pid": os.getpid(),
            "digests": trained.weight_digests, "seen": trained.verification["world_size_seen"],
            "steps": len(trained.step_times), "losses": trained.losses}


_NODE = """
import json, sys
import stnb, test_scaleout
from stnb.models import resolve_model
node, port, cfg = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
res = stnb.launch(test_scaleout.two_node_rank, stnb.TrainConfig.from_dict(cfg), resolve_model(cfg["model"]), num_processes=1, num_nodes=2,
                  node_rank=node, master_addr="127.0.0.1", master_port=port, device="cpu",
                  threads_per_rank=1, timeout=120)
print(json.dumps(res))
"""


# ---------------------------------------------------------------------------------------
# detection


def test_detects_outside_launchers_but_not_stnb_launch():
    torchrun = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "none"}
    assert scaleout.inside_external_launch(torchrun)
    assert scaleout.launcher_name(torchrun) == "torchrun"
    assert scaleout.external_rank(torchrun) == 1 and not scaleout.is_main_process(torchrun)
    accel = dict(torchrun, RANK="0", ACCELERATE_MIXED_PRECISION="no")
    assert scaleout.launcher_name(accel) == "accelerate" and scaleout.is_main_process(accel)
    own = dict(torchrun, STNB_LAUNCH="1")  # a rank of stnb.launch is not an outside launch
    assert not scaleout.inside_external_launch(own) and scaleout.is_main_process(own)
    assert not scaleout.inside_external_launch({})
    assert scaleout.launcher_name({"WORLD_SIZE": "2", "RANK": "0"}) == "external"


def test_accelerate_launch_cpu_is_one_process_and_stnb_says_so(monkeypatch, capsys):
    """`accelerate launch --cpu --num_processes N` starts ONE process (no MPI hostfile): stnb then
    launches its own ranks, and tells the user once how to get accelerate-started ranks."""
    for k in LAUNCH_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(scaleout, "_NOTED", False)
    assert not scaleout.inside_external_launch()
    assert not scaleout.inside_external_launch()
    err = capsys.readouterr().err
    assert err.count("accelerate launch --multi_gpu --num_processes N") == 1


@pytest.mark.parametrize("case", ["single", "too_many_local", "fsdp_world_1"])
def test_outside_launch_validation_names_the_fix(monkeypatch, case):
    import torch.distributed as dist

    world, local = {"single": (2, 1), "too_many_local": (64, 64), "fsdp_world_1": (1, 1)}[case]
    for k in LAUNCH_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    strategy = {"single": "single", "too_many_local": "ddp", "fsdp_world_1": "fsdp"}[case]
    with pytest.raises(ConfigError) as ei:
        stnb.run(TrainConfig(**dict(TINY, strategy=strategy)))
    msg = str(ei.value)
    expect = {"single": "use --strategy ddp or fsdp", "too_many_local": "--nproc_per_node <= ",
              "fsdp_world_1": "num_processes >= 2"}[case]
    assert expect in msg
    assert not dist.is_initialized()  # refused before any process group


# ---------------------------------------------------------------------------------------
# export


def test_export_script_embeds_config_and_prints_commands(tmp_path, capsys):
    cfg = TrainConfig(**TINY)
    out = tmp_path / "train.py"
    script = stnb.export_script(cfg, out, num_nodes=3, master_addr="10.0.0.1", master_port=29555,
                                results_file="runs.jsonl")
    printed = capsys.readouterr().out
    text = out.read_text()
    tree = ast.parse(text)
    # the sentence-transformers rule: work in main(), called under if __name__ == "__main__"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    guard = [n for n in tree.body if isinstance(n, ast.If)]
    assert guard and ast.unparse(guard[-1].test) == "__name__ == '__main__'"
    top_calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert not top_calls, "nothing but main() may run at import time"
    consts = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    assert consts["CONFIG"] == cfg.to_dict()
    assert TrainConfig.from_dict(consts["CONFIG"]) == cfg
    assert consts["RESULTS_FILE"] == "runs.jsonl"
    assert "Needs stnb installed" in ast.get_docstring(tree)
    assert "stnb.run(" in text and "is_main_process()" in text
    # one node and several nodes, torchrun and accelerate launch, printed and in the header
    assert script.commands["torchrun"] == f"torchrun --standalone --nproc_per_node=2 {out}"
    assert script.commands["accelerate"] == f"accelerate launch --multi_gpu --num_processes=2 {out}"
    nodes = script.node_commands("torchrun")
    assert len(nodes) == 3
    for i, c in enumerate(nodes):
        assert f"--nnodes=3 --nproc_per_node=2 --node_rank={i} --master_addr=10.0.0.1 --master_port=29555" in c
    for i, c in enumerate(script.node_commands("accelerate")):
        assert (f"--num_machines=3 --num_processes=6 --machine_rank={i} --main_process_ip=10.0.0.1 "
                f"--main_process_port=29555") in c
    for c in list(script.commands.values()) + nodes + script.node_commands("accelerate"):
        assert c in printed and c in text
    # never overwrites silently; single-process strategies get no multi-node commands
    with pytest.raises(ConfigError, match="already exists"):
        stnb.export_script(cfg, out)
    single = stnb.export_script(cfg.replace(strategy="single", num_processes=None), out, overwrite=True, echo=False)
    assert single.multi_node == {} and "--nproc_per_node=1" in single.commands["torchrun"]
    with pytest.raises(ConfigError, match="steps"):
        stnb.export_script(cfg.replace(steps=0), tmp_path / "bad.py", echo=False)
    assert not (tmp_path / "bad.py").exists()


def _script_constants(path) -> dict:
    tree = ast.parse(Path(path).read_text())
    return {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exported_script_trains_the_strategy_asked(tmp_path, strategy):
    """Each strategy's script embeds that strategy (an FSDP user never gets a DDP script), with the
    rest of the config unchanged, and the commands fit it: one process, or the config's world size."""
    one_process = strategy in ONE_PROCESS
    cfg = TrainConfig(**dict(TINY, strategy=strategy, num_processes=None if one_process else 2,
                             device="cuda" if strategy == "dp" else "cpu",
                             **({"stage": 2} if strategy == "deepspeed" else {})))
    out = tmp_path / f"{strategy}.py"
    script = stnb.export_script(cfg, out, echo=False)
    config = _script_constants(out)["CONFIG"]
    assert config["strategy"] == strategy
    assert TrainConfig.from_dict(config) == cfg
    assert script.nproc_per_node == (1 if one_process else 2)
    assert (script.multi_node == {}) == one_process


def test_exported_fsdp_script_trains_fsdp(tmp_path):
    """`python train.py` of an exported FSDP config trains FSDP: each rank held a shard, verified."""
    cfg = TrainConfig(**dict(TINY, strategy="fsdp", evaluate=False))
    script = tmp_path / "train.py"
    stnb.export_script(cfg, script, echo=False)
    [(rc, out, err)] = _run_together([[sys.executable, str(script)]], cwd=tmp_path)
    assert rc == 0, _failure(0, rc, out, err)
    d = _last_json(out)
    assert d["config"]["strategy"] == "fsdp" and d["verified"] is True, d["verification"]
    ranks = d["verification"]["ranks"]
    assert len(ranks) == 2 and all(r["wrapper"] != "DistributedDataParallel" for r in ranks)
    assert sum(r["local_param_count"] for r in ranks) == ranks[0]["total_param_count"]


def test_export_cli_takes_the_run_options(tmp_path, capsys):
    from stnb.__main__ import main

    out = tmp_path / "cli_train.py"
    rc = main(["export", *CLI_TINY, "--nproc", "2", "--out", str(out), "--nnodes", "2",
               "--master-addr", "127.0.0.1", "--master-port", "29600"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "--node_rank=1 --master_addr=127.0.0.1 --master_port=29600" in printed
    cfg = ast.literal_eval(out.read_text().split("CONFIG = ", 1)[1].split("\n}\n", 1)[0] + "\n}")
    assert cfg["strategy"] == "ddp" and cfg["model"] == "tiny" and cfg["steps"] == 3 and cfg["evaluate"] is False
    assert main(["export", *CLI_TINY, "--out", str(out)]) == 2  # exists: refused, exit code 2
    assert "already exists" in capsys.readouterr().err


def test_export_cli_defaults_and_the_required_out(tmp_path, capsys):
    """Without --nnodes / --master-addr / --master-port: 2 nodes at $MASTER_ADDR:29500; --nproc-per-node
    is a number; --out is required (argparse's exit 2, naming it)."""
    from stnb.__main__ import main

    out = tmp_path / "defaults.py"
    assert main(["export", *CLI_TINY, "--nproc-per-node", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--nnodes=2 --nproc_per_node=3 --node_rank=1 --master_addr=$MASTER_ADDR --master_port=29500" in printed
    assert "--node_rank=2" not in printed
    with pytest.raises(SystemExit) as e:
        main(["export", *CLI_TINY])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    script = stnb.export_script(TrainConfig(**TINY), tmp_path / "t.py", echo=False)
    assert script.node_commands() == script.node_commands("torchrun") != script.node_commands("accelerate")


def test_exported_script_prints_the_commands_a_user_runs():
    from stnb.export import ExportedScript

    two = ExportedScript(path="train.py", nproc_per_node=2, num_nodes=2, master_addr="10.0.0.1", master_port=29500,
                         commands={"python": "python train.py", "torchrun": "torchrun --standalone train.py"},
                         multi_node={"torchrun": ["torchrun n0", "torchrun n1"], "accelerate": ["acc n0", "acc n1"]})
    assert str(two) == "\n".join([
        "wrote train.py", "", "one node:", "  python train.py", "  torchrun --standalone train.py", "",
        "2 nodes, 2 process(es) each (node 0 at 10.0.0.1; run line i on node i):",
        "  torchrun:", "    node 0: torchrun n0", "    node 1: torchrun n1",
        "  accelerate:", "    node 0: acc n0", "    node 1: acc n1", "",
        "rank 0 prints the RunResult as JSON on its last line (stnb.RunResult.from_dict(json.loads(line)))"])
    one = ExportedScript(path="t.py", nproc_per_node=1, num_nodes=2, master_addr="h", master_port=1,
                         commands={"python": "python t.py"})
    assert "nodes" not in str(one) and str(one).startswith("wrote t.py\n\none node:\n  python t.py\n\nrank 0")


def test_export_cli_passes_every_option_on(tmp_path, capsys):
    from stnb.__main__ import main

    out = tmp_path / "opts.py"
    args = ["export", *CLI_TINY, "--out", str(out), "--results", str(tmp_path / "r.jsonl"), "--nnodes", "3",
            "--nproc-per-node", "3", "--master-addr", "10.1.1.1", "--master-port", "29777"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    assert "--nnodes=3 --nproc_per_node=3 --node_rank=2 --master_addr=10.1.1.1 --master_port=29777" in printed
    assert _script_constants(out)["RESULTS_FILE"] == str(tmp_path / "r.jsonl")
    assert main(args) == 2 and "already exists" in capsys.readouterr().err  # no --force: refused
    assert main(args + ["--force"]) == 0


def test_one_process_commands_for_cpu_and_gpu(tmp_path):
    cpu = stnb.export_script(TrainConfig(**dict(TINY, strategy="single", num_processes=None)), tmp_path / "c.py",
                             echo=False)
    assert cpu.commands == {"python": f"python {tmp_path / 'c.py'}",
                            "torchrun": f"torchrun --standalone --nproc_per_node=1 {tmp_path / 'c.py'}",
                            "accelerate": f"accelerate launch --cpu --num_processes=1 {tmp_path / 'c.py'}"}
    gpu = stnb.export_script(TrainConfig(**dict(TINY, strategy="dp", num_processes=None, device="cuda")),
                             tmp_path / "g.py", echo=False)
    assert gpu.commands["accelerate"] == f"accelerate launch --num_processes=1 {tmp_path / 'g.py'}"


def test_export_cli_help_says_what_each_option_does():
    import argparse

    from stnb.export import add_cli

    sub = argparse.ArgumentParser().add_subparsers()
    add_cli(sub)
    export = sub.choices["export"]
    helps = {a.dest: a.help for a in export._actions if a.dest in ("out", "nnodes", "nproc_per_node", "master_addr",
                                                                   "master_port", "force")}
    assert helps == {
        "out": "the script to write, e.g. train.py",
        "nnodes": "nodes in the printed multi-node commands (default 2)",
        "nproc_per_node": "processes per node in the printed commands (default: --nproc, or the default world size)",
        "master_addr": "node 0's address for the multi-node commands",
        "master_port": None,
        "force": "overwrite --out if it exists"}
    assert [a.help for a in sub._choices_actions] == ["write a standalone training script for torchrun / "
                                                      "accelerate launch"]


# ---------------------------------------------------------------------------------------
# real multi-process runs


def test_launch_two_nodes_on_localhost_form_one_world_and_train(tmp_path):
    """stnb.launch with num_nodes=2: two processes (the nodes), one rank each, one world of 2."""
    import psutil

    cfg = TrainConfig(**dict(TINY, evaluate=False)).to_dict()
    cmd = [sys.executable, "-c", _NODE]
    outs = _run_on_a_free_port(lambda port: [cmd + [str(i), str(port), json.dumps(cfg)] for i in (0, 1)],
                               cwd=tmp_path)
    results = []
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, _failure(i, rc, out, err)
        res = _last_json(out)
        assert len(res) == 1  # one rank on each node
        results.append(res[0])
        assert f"[rank {i}] hello from global rank {i}" in out  # output is prefixed with the global rank
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["ctx_rank"] for r in results] == [0, 1]
    assert {r["world"] for r in results} == {2} and {r["ctx_world"] for r in results} == {2}
    assert {r["allreduce"] for r in results} == {3.0}
    assert all(r["steps"] == 3 and r["seen"] == 2 for r in results)
    assert results[0]["digests"] == results[1]["digests"]  # DDP kept every tensor bit-identical
    assert len(results[0]["losses"]) == 3 and results[0]["losses"] == pytest.approx(results[1]["losses"])
    for r in results:  # no rank process outlives its node
        assert not psutil.pid_exists(r["pid"]) or psutil.Process(r["pid"]).status() == psutil.STATUS_ZOMBIE


def test_cli_under_torchrun_two_nodes(tmp_path):
    """`python -m stnb run` unchanged under torchrun --nnodes=2 (static rendezvous on localhost)."""
    def cmds(port):
        return [[str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={i}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", "--rdzv_backend=static",
                 "-m", "stnb", "run", *CLI_TINY, "--results", str(tmp_path / f"runs{i}.jsonl")] for i in (0, 1)]

    outs = _run_on_a_free_port(cmds, cwd=tmp_path)
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, _failure(i, rc, out, err)
    d = _last_json(outs[0][1])
    rr = _check_run_result(d, "torchrun", 2)
    assert rr.config["num_processes"] == 2 and rr.config["threads_per_rank"] == 1
    assert len(rr.peak_memory_bytes) == 2 and len(rr.verification["ranks"]) == 2
    assert '"world_size"' not in outs[1][1]  # only rank 0 prints the RunResult
    assert len(load_results(tmp_path / "runs0.jsonl", as_frame=False)) == 1  # rank 0 appended it
    assert not (tmp_path / "runs1.jsonl").exists()


def test_exported_script_under_accelerate_launch_matches_a_notebook_run(tmp_path):
    """The exported script under `accelerate launch` gives a RunResult of the notebook's form."""
    cfg = TrainConfig(**TINY)
    script = tmp_path / "train.py"
    stnb.export_script(cfg, script, results_file=str(tmp_path / "runs.jsonl"), echo=False)
    # `accelerate launch --cpu` starts one process unless given an MPI hostfile; --multi_gpu
    # starts N torch-elastic ranks, which run on CPU cores (gloo) here
    [(rc, out, err)] = _run_on_a_free_port(lambda port: [[
        str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
        "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={port}", str(script)]], cwd=tmp_path)
    assert rc == 0, _failure(0, rc, out, err)
    d = _last_json(out)
    script_run = _check_run_result(d, "accelerate", 2)
    assert out.count('"run_id"') == 1  # one JSON line, from rank 0
    assert load_results(tmp_path / "runs.jsonl", as_frame=False)[0]["run_id"] == script_run.run_id

    notebook_run = stnb.run(cfg, echo=False)  # the same config from a "notebook"
    assert notebook_run.launcher == "stnb"
    assert set(d) == set(notebook_run.to_dict())  # same keys, same form
    assert script_run.global_batch_size == notebook_run.global_batch_size == 8
    assert script_run.total_param_count == notebook_run.total_param_count
    assert script_run.losses == pytest.approx(notebook_run.losses, rel=1e-4)  # same seed, same data
    frame = results_frame([notebook_run, d])  # the comparison table takes both
    assert list(frame["launcher"]) == ["stnb", "accelerate"] and list(frame["world_size"]) == [2, 2]
