"""Mutation check: break stnb on purpose in a scratch copy and make sure the test named for the
behaviour goes red.

Each ``Mutation`` is a fault the issue found the suite blind to, written as exact text
replacements in the product (an anchor that is missing, or found more than once, is an error:
a stale mutation must never pass silently), and the narrowest test(s) that must catch it.
``tests/test_mutations.py`` runs every one in CI; by hand:

    python tests/mutations.py                  # every mutation, then a table
    python tests/mutations.py lock in-place    # mutations whose id contains a word
    python tests/mutations.py --baseline       # the named tests on an unmutated copy (must pass)

``pending``: the fault is still present in the code (the check that catches it is being
rewritten elsewhere); the mutation is written against today's code and its test is expected to
survive it until that work lands. ``tests/test_mutations.py`` runs these as strict xfails, so the
moment the suite catches one, the xfail fails and the mark must be removed (re-anchoring the
mutation if the code it names moved).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("stnb", "tests", "pyproject.toml")
PER_TEST_TIMEOUT_S = 240


@dataclass(frozen=True)
class Mutation:
    id: str
    fault: str
    edits: tuple  # ((path, old, new), ...): exact text replacements, each anchor found exactly once
    tests: tuple  # pytest node ids that must fail
    pending: str = ""


NOOP_HOOK = '''            if self.trainer.stnb_config.strategy == "ddp" and args.world_size > 1:
                def _noop(_state, bucket):  # MUTATION: DDP never all-reduces
                    import torch

                    fut = torch.futures.Future()
                    fut.set_result(bucket.buffer())
                    return fut

                self.trainer.model_wrapped.register_comm_hook(None, _noop)
            self.timer.attach(self.trainer, self.comm_hook)  # registers DDP's comm hook, timed
'''

AFTER_TRAIN = "            trainer.train()\n"

MUTATIONS = [
    Mutation(
        "ddp-no-allreduce",
        "a no-op DDP comm hook: each rank trains on its own half batch",
        (("stnb/instruments/timesplit.py",
          "            self.timer.attach(self.trainer, self.comm_hook)  # registers DDP's comm hook, timed\n",
          NOOP_HOOK),),
        ("tests/test_run.py::test_ddp_final_weights_equal_one_big_batch",)),
    Mutation(
        "save-untrained",
        "the untrained model is saved instead of the trained one",
        (("stnb/training.py", 'self.saved = save_checked(final_model, config.save_to, device,',
          'self.saved = save_checked(load_like(final_model, initial_path, device=device, max_seq_length=max_len), '
          'config.save_to, device,'),),
        ("tests/test_run.py::test_ddp_final_weights_equal_one_big_batch",)),
    Mutation(
        "rank1-swaps-embedding-rows",
        "after training, rank 1 swaps two rows of the word embeddings",
        (("stnb/training.py", AFTER_TRAIN, AFTER_TRAIN +
          "            if here.rank == 1:  # MUTATION\n"
          "                with torch.no_grad():\n"
          "                    _w = trainer.model[0].auto_model.embeddings.word_embeddings.weight\n"
          "                    _w[[100, 101]] = _w[[101, 100]].clone()\n"),),
        ("tests/test_run.py::test_ddp_two_ranks_verified",)),
    Mutation(
        "rank1-adds-3e-4",
        "after training, rank 1 adds 3e-4 to one weight",
        (("stnb/training.py", AFTER_TRAIN, AFTER_TRAIN +
          "            if here.rank == 1:  # MUTATION\n"
          "                with torch.no_grad():\n"
          "                    next(trainer.model.parameters()).view(-1)[0] += 3e-4\n"),),
        ("tests/test_run.py::test_ddp_two_ranks_verified",)),
    Mutation(
        "results-thread-lock",
        "the results file lock serialises threads only, not processes",
        (("stnb/results.py", "from .errors import ResultsFileError\n",
          "from .errors import ResultsFileError\nimport threading\n_THREAD_LOCK = threading.Lock()\n"),
         ("stnb/results.py", "    try:\n        fcntl.flock(fd, fcntl.LOCK_EX)\n        yield\n    finally:\n"
                             "        os.close(fd)\n",
          "    try:\n        with _THREAD_LOCK:\n            yield\n    finally:\n        os.close(fd)\n")),
        ("tests/test_results.py::test_two_processes_appending_at_once_lose_no_run",)),
    Mutation(
        "write-in-place",
        "the atomic write truncates and rewrites the file in place",
        (("stnb/files.py",
          '        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=os.path.dirname(target) or ".")\n',
          "        tmp = target\n        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)\n"),),
        ("tests/test_results.py::test_a_reader_never_sees_a_partial_file",)),
    Mutation(
        "cleanup-descendants-only",
        "the launcher finds only processes still below a living rank (no child subreaper)",
        (("stnb/processes/supervise.py", "    was_subreaper = child_subreaper(True)",
          "    was_subreaper = None  # MUTATION"),),
        ("tests/test_faults.py::test_2c_rank_with_child_and_daemon_sigkilled",)),
    Mutation(
        "world-size-compared-with-itself",
        "DDP verification compares the world size a rank sees with itself",
        (("stnb/checks.py", "    if size != requested:\n", "    if size != size:  # MUTATION\n"),
         ("stnb/checks.py", "    if procs != requested:\n", "    if procs != procs:  # MUTATION\n")),
        ("tests/test_run.py::test_verify_compares_the_world_size_with_the_requested_one",),
        ),
    Mutation(
        "memory-grads-counted-from-params",
        "the gradient bytes a rank reports count frozen parameters too",
        (("stnb/memory.py",
          "    grads = sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)\n",
          "    grads = sum(tensor_bytes(p) for p in model.parameters())\n"),),
        ("tests/test_memory.py::test_prediction_matches_a_real_single_process_run",)),
    Mutation(
        "cli-run-exit-0-unverified",
        "`python -m stnb run` exits 0 whatever the result's verification says",
        (("stnb/__main__.py", "    status = 0 if result.verified else 1",
          "    status = 0  # MUTATION: whatever result.verified says"),),
        ("tests/test_verification.py::test_cli_run_exits_nonzero_for_an_unverified_result",)),
    Mutation(
        "launch-on-port-29500",
        "the launcher uses torch's default port 29500 instead of a free one",
        (("stnb/processes/launcher.py", "    port = master_port or free_port(master_addr)\n", "    port = master_port or 29500\n"),),
        ("tests/test_launch.py::test_busy_port_29500_does_not_matter",)),
    Mutation(
        "ranks-see-the-same-data",
        "every DDP rank draws its batches from a different shuffle of the data",
        (("stnb/recipe.py", "        data_seed=config.seed,\n",
          '        data_seed=config.seed + int(__import__("os").environ.get("RANK", "0")),\n'),),
        ("tests/test_run.py::test_ddp_final_weights_equal_one_big_batch",)),
    Mutation(
        "spawn-by-reference",
        "spawned ranks get the launched function by reference (plain pickle), as multiprocessing sends it",
        (("stnb/processes/byvalue.py", "        return cloudpickle.dumps((fn, args, kwargs))\n",
          "        return pickle.dumps((fn, args, kwargs))  # MUTATION\n"),),
        ("tests/test_spawn.py::test_cell_function_runs_in_spawned_ranks",)),
    Mutation(
        "spawn-asked-fork-used",
        "the ranks are forked whatever start method the launch asked for",
        (("stnb/processes/start.py", "monitor_interval=0.1, start_method=opts.start_method,",
          'monitor_interval=0.1, start_method="fork",'),),
        ("tests/test_spawn.py::test_own_training_under_spawn_verified",)),
    Mutation(
        "loss-params-not-synced",
        "the loss's own parameters (SoftmaxLoss's classifier) keep each rank's gradient (no all-reduce)",
        (("stnb/strategies/loss_sync.py", "        dist.all_reduce(flat)\n", "        pass  # MUTATION\n"),),
        ("tests/test_loss_params.py::test_softmax_classifier_identical_on_every_rank",)),
    Mutation(
        "zero1-plain-optimizer",
        "zero1 keeps the trainer's plain optimizer: every rank holds the whole optimizer state",
        (("stnb/strategies/zero1.py", "            if isinstance(built, ZeroRedundancyOptimizer):\n",
          "            if True:  # MUTATION\n"),),
        ("tests/test_zero.py::test_stage_trains_verified[zero1]",)),
    Mutation(
        "zero2-reshards-after-forward",
        "zero2's blocks are sharded with reshard_after_forward=True (ZeRO-3's re-gather in the backward)",
        (("stnb/strategies/fsdp.py", "                               self.reshard_after_forward(config), "
                                     "mixed_precision(trainer.args)))\n",
          "                               True, mixed_precision(trainer.args)))  # MUTATION\n"),),
        ("tests/test_zero.py::test_stage_trains_verified[zero2]",)),
    Mutation(
        "fsdp-root-unsharded",
        "FSDP shards the transformer blocks but not the root: the embeddings stay whole on every rank",
        (("stnb/strategies/fsdp.py", "    fully_shard(model, mesh=mesh, reshard_after_forward=False, "
                                     "mp_policy=mp)\n",
          "    pass  # MUTATION: no fully_shard of the root\n"),),
        ("tests/test_zero.py::test_stage_trains_verified[fsdp]",)),
    # issue 19: faults that survived the whole suite; mutmut (make mutants) cannot make them (a name
    # replaced by a constant, a dict entry overridden), so they are kept here
    Mutation(
        "progress-shows-rank-0-step",
        "the per-rank progress shows rank 0's step for every rank",
        (("stnb/processes/channel.py", "step=int(self._get(r, _STEP))", "step=int(self._get(0, _STEP))"),),
        ("tests/test_launch.py::test_progress_shows_each_rank_its_own_step",)),
    Mutation(
        "export-forces-ddp",
        "the exported script's config says strategy 'ddp' whatever was asked",
        (("stnb/builds.py", "_RECIPE_BODY.format(config=dict_literal(config.to_dict())",
          '_RECIPE_BODY.format(config=dict_literal({**config.to_dict(), "strategy": "ddp"})'),),
        ("tests/test_scaleout.py::test_exported_script_trains_the_strategy_asked[fsdp]",)),
    Mutation(
        "fsdp-shards-unchecked",
        "FSDP verification no longer compares each rank's shards with their exact size",
        (("stnb/strategies/fsdp.py", "        problems += checks.shard_problems(model, world_size)  # exact local size",
          "        pass  # MUTATION"),),
        ("tests/test_verify_in_process.py::test_shard_problems_name_the_mesh_the_size_and_whole_parameters",)),
    Mutation(
        "deepspeed-user-trainer-gets-stage-1",
        "a user's trainer gets a DeepSpeed config for ZeRO stage 1 whatever stage was asked (only the engine's "
        "observed stage can tell: the refusals see no deepspeed=... in the user's arguments)",
        (("stnb/strategies/deepspeed.py", "                   json.dumps(ds_config(config)).encode()).decode()}",
          '                   json.dumps(overlay(ds_config(config), {"zero_optimization": {"stage": 1}})).encode()'
          ').decode()}'),),
        ("tests/test_deepspeed.py::test_a_users_trainer_gets_deepspeed_and_is_verified",)),
    Mutation(
        "deepspeed-partition-measured-whole",
        "the optimizer partitions are measured from the whole model's parameters, not the engine's partition",
        (("stnb/strategies/deepspeed.py", "    partition = sum(f.numel() for f in flats)\n",
          "    partition = trainable  # MUTATION\n"),),
        ("tests/test_deepspeed.py::test_deepspeed_stage_verified_from_the_engine[2]",)),
    Mutation(
        "deepspeed-same-batches-on-every-rank",
        "accelerate's one-process state under DeepSpeed on CPU is left as it is: every rank trains on the same "
        "batches (the weights still agree across ranks)",
        (("stnb/strategies/deepspeed.py",
          '        return {"info": {"data_split": split_data_across_ranks(trainer)}, "overridden": {}}',
          '        return {"info": {}, "overridden": {}}  # MUTATION'),),
        ("tests/test_deepspeed.py::test_deepspeed_stage_verified_from_the_engine[2]",)),
    Mutation(
        "multi-dataset-columns-unchecked",
        "a dict of datasets: a dataset whose loss received other inputs than its columns is not a problem",
        (("stnb/results.py", '                if check["ok"] is False:\n', "                if False:  # MUTATION\n"),),
        ("tests/test_seed_recipe.py::test_a_dict_of_datasets_is_checked_per_dataset",)),
    Mutation(
        "multi-dataset-inputs-recorded-once",
        "a dict of losses: only the first loss that runs records its inputs (the other datasets go unchecked)",
        (("stnb/instruments/loss_inputs.py",
          "            one.register_forward_pre_hook(functools.partial(self._hook, name))\n",
          "            one.register_forward_pre_hook(functools.partial(self._hook, None))  # MUTATION\n"),),
        ("tests/test_seed_recipe.py::test_ddp_trains_one_classifier_across_ranks",)),
]


def apply(root: str, m: Mutation) -> None:
    """Apply ``m``'s edits under ``root``; raise if an anchor is missing or ambiguous."""
    for path, old, new in m.edits:
        full = os.path.join(root, path)
        with open(full) as f:
            text = f.read()
        n = text.count(old)
        if n != 1:
            raise LookupError(f"mutation {m.id!r}: anchor found {n} times in {path} (stale mutation):\n{old}")
        with open(full, "w") as f:
            f.write(text.replace(old, new))


def check_anchors(m: Mutation, root: str = ROOT) -> None:
    for path, old, _ in m.edits:
        with open(os.path.join(root, path)) as f:
            n = f.read().count(old)
        if n != 1:
            raise LookupError(f"mutation {m.id!r}: anchor found {n} times in {path} (stale mutation):\n{old}")


def copy_repo(dst: str) -> str:
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc")
    for name in COPIED:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name), ignore=ignore)
        else:
            shutil.copy2(src, os.path.join(dst, name))
    return dst


@dataclass
class Outcome:
    mutation: Mutation | None
    returncode: int
    failed: list
    output: str
    seconds: float

    @property
    def caught(self) -> bool:
        """pytest exit code 1 (tests ran and failed, no collection error) and only named tests failed."""
        names = {t.split("::")[-1] for t in (self.mutation.tests if self.mutation else ())}
        return self.returncode == 1 and bool(self.failed) and {f.split("::")[-1] for f in self.failed} <= names


def run_tests(root: str, tests, timeout: float = PER_TEST_TIMEOUT_S) -> tuple:
    """Run the named tests in ``root`` with stnb imported from there. Returns (rc, failed ids, output).

    A mutant may leave processes behind (that is what some mutations do): while it runs this process
    is their child subreaper, and every process that appeared is stopped afterwards. Output goes to
    a file, so a leftover process holding a pipe open cannot keep us waiting."""
    import psutil

    from stnb.processes import child_subreaper

    env = dict(os.environ, PYTHONPATH=root, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=-rf",
           "-o", f"timeout={int(timeout)}", "--basetemp", os.path.join(root, ".pytest-tmp"), *tests]
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    was = child_subreaper(True)
    log_path = os.path.join(root, "mutant.log")
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            try:
                rc = proc.wait(timeout + 120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    finally:
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10)
        if was is False:
            child_subreaper(False)
    with open(log_path, errors="replace") as f:
        out = f.read()
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
    return rc, failed, out


def where_stnb_comes_from(root: str) -> str:
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run([sys.executable, "-c", "import stnb; print(stnb.__file__)"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120).stdout.strip()


def run_mutation(m: Mutation | None, tests=None) -> Outcome:
    """Copy the repository, apply ``m`` (None: the baseline), run its tests there."""
    with tempfile.TemporaryDirectory(prefix="stnb-mutant-") as tmp:
        root = copy_repo(os.path.join(tmp, "repo"))
        if m is not None:
            apply(root, m)
        t0 = time.time()
        rc, failed, out = run_tests(root, tests or m.tests)
        return Outcome(m, rc, failed, out, time.time() - t0)


def main(argv) -> int:
    baseline = "--baseline" in argv
    words = [a for a in argv if not a.startswith("--")]
    chosen = [m for m in MUTATIONS if not words or any(w in m.id for w in words)]
    if baseline:
        tests = sorted({t for m in chosen for t in m.tests if not m.pending})
        o = run_mutation(None, tests)
        print(o.output[-3000:])
        print(f"baseline: {len(tests)} named tests, exit code {o.returncode}, {o.seconds:.0f} s")
        return o.returncode
    bad = []
    for m in chosen:
        o = run_mutation(m)
        verdict = "caught" if o.caught else "SURVIVED"
        if m.pending:
            verdict += f" (pending: {m.pending.split(':')[0]})"
        elif not o.caught:
            bad.append(m.id)
        why = next((ln[1:].strip() for ln in o.output.splitlines() if ln.startswith("E ")), "")
        print(f"{m.id:<34} {verdict:<40} {o.seconds:5.0f} s  by {', '.join(o.failed) or '-'} (exit {o.returncode})"
              + (f"\n    {why[:200]}" if why else ""), flush=True)
    if bad:
        print("SURVIVED:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
