"""The exported script's text, as a user reads it: the header's run instructions for each strategy, the
embedded configuration or build function and its options, and the refusals of options no launcher takes.

Fast: ``render_script`` / ``export_script`` only write text (the scripts are run for real in
test_scaleout and test_export_build).
"""

from __future__ import annotations

import ast
import shlex

import pytest

import buildsource_helpers as h
import stnb
from stnb import TrainConfig
from stnb.errors import ConfigError
from stnb.export import render_script
from stnb.hardware import versions
from stnb.strategies import is_distributed, names

TINY = dict(model="tiny", steps=3, per_device_batch_size=4, device="cpu")
READ_BACK = ("Rank 0 prints the RunResult as one JSON object on the last line of its output, the same form\n"
             "as a notebook run: stnb.RunResult.from_dict(json.loads(line)).")


def _docstring(text: str) -> str:
    return ast.get_docstring(ast.parse(text), clean=False)


def _constants(text: str) -> dict:
    return {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(text).body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            and isinstance(n.value, (ast.Constant, ast.Dict))}


def test_a_distributed_scripts_header_says_how_to_run_it_on_one_node_and_on_each_node():
    cfg = TrainConfig(strategy="ddp", num_processes=3, **TINY)
    text, one, multi, nproc = render_script(cfg, script_name="my train.py", num_nodes=2, master_addr="10.0.0.9",
                                            master_port="29601")  # a port as the shell gives it: a string
    q = shlex.quote("my train.py")
    node = [f"torchrun --nnodes=2 --nproc_per_node=3 --node_rank={i} --master_addr=10.0.0.9 --master_port=29601 {q}"
            for i in range(2)]
    acc = [f"accelerate launch --multi_gpu --num_machines=2 --num_processes=6 --machine_rank={i} "
           f"--main_process_ip=10.0.0.9 --main_process_port=29601 {q}" for i in range(2)]
    assert nproc == 3
    assert one == {"python": f"python {q}", "torchrun": f"torchrun --standalone --nproc_per_node=3 {q}",
                   "accelerate": f"accelerate launch --multi_gpu --num_processes=3 {q}"}
    assert multi == {"torchrun": node, "accelerate": acc}
    assert _docstring(text) == "\n".join([
        f"Standalone training script exported by stnb {versions()['stnb']} from a notebook configuration.", "",
        "Needs stnb installed where it runs (pip install stnb, or pip install -e <stnb checkout>):",
        "main() calls stnb's runner, which builds the model, data, loss and sentence-transformers",
        "trainer exactly as the notebook did, verifies the strategy and measures the run.", "",
        "Run it on one node:", *(f"    {c}" for c in one.values()), "",
        "On 2 nodes (3 process(es) each; node 0 is 10.0.0.9; run line i on node i):",
        "  torchrun:", *(f"    {c}" for c in node), "  accelerate:", *(f"    {c}" for c in acc), "",
        "Under torchrun / accelerate launch every process is one rank: stnb trains in place, the",
        "launcher decides the number of processes (WORLD_SIZE replaces num_processes below), and on CPU",
        "each rank uses one thread unless threads_per_rank or OMP_NUM_THREADS says otherwise. With plain",
        "`python`, stnb starts the ranks itself, as in the notebook.", "", READ_BACK, ""])
    assert _constants(text) == {"CONFIG": cfg.to_dict(), "RESULTS_FILE": None}


def test_render_script_defaults_are_train_py_two_nodes_at_master_addr_port_29500():
    text, one, multi, nproc = render_script(TrainConfig(strategy="fsdp", num_processes=2, **TINY))
    assert one["torchrun"] == "torchrun --standalone --nproc_per_node=2 train.py"
    assert multi["torchrun"] == [f"torchrun --nnodes=2 --nproc_per_node=2 --node_rank={i} --master_addr=$MASTER_ADDR "
                                 "--master_port=29500 train.py" for i in range(2)]
    assert "On 2 nodes (2 process(es) each; node 0 is $MASTER_ADDR; run line i on node i):" in text
    assert _constants(text)["CONFIG"]["strategy"] == "fsdp"


@pytest.mark.parametrize("strategy", [n for n in names() if not is_distributed(n)])
def test_a_one_process_scripts_header_points_to_a_distributed_strategy_for_several_nodes(strategy):
    cfg = TrainConfig(strategy=strategy, **dict(TINY, device="cuda" if strategy == "dp" else "cpu"))
    text, one, multi, nproc = render_script(cfg, nproc_per_node=1, num_nodes=3)
    assert (nproc, multi) == (1, {})
    doc = _docstring(text)
    assert ("Run it on one node:\n" + "\n".join(f"    {c}" for c in one.values()) + "\n\n"
            f"strategy {strategy!r} runs in one process: export strategy 'ddp' or 'fsdp' for several nodes.\n\n"
            "Under torchrun") in doc
    assert "nodes (" not in doc and "--nnodes" not in text
    assert _constants(text)["CONFIG"] == cfg.to_dict()


def test_a_build_functions_script_holds_its_source_and_the_options_given():
    text, one, multi, nproc = render_script(h.reads_body_and_comprehension, script_name="own.py",
                                            results_file="runs.jsonl", strategy="fsdp", num_processes=2)
    name = "reads_body_and_comprehension"
    doc = _docstring(text)
    assert doc.startswith(f"Standalone training script exported by stnb {versions()['stnb']} from the build "
                          f"function {name}() of a notebook.\n\n"
                          f"Needs stnb, and every package {name}() imports, installed where it runs. Every rank calls\n"
                          f"{name}() and stnb applies the strategy to the SentenceTransformerTrainer it returns, "
                          "verifies\n"
                          f"it and measures the run, exactly as stnb.run({name}, ...) did in the notebook.\n\n"
                          "Run it on one node:\n    python own.py\n")
    assert _constants(text) == {"SIZE": h.SIZE, "TEXT": h.TEXT, "STNB_RESULTS_FILE": "runs.jsonl",
                                "STNB_OPTIONS": {"strategy": "fsdp", "num_processes": 2}}
    assert f"stnb.run({name}, results_file=STNB_RESULTS_FILE, **STNB_OPTIONS)" in text
    assert "from __future__ import annotations\n" in text and "CONFIG" not in text
    tree = ast.parse(text)
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == [name, "main"]
    assert (nproc, len(multi["torchrun"])) == (2, 2)
    # without options the script passes none (the defaults of stnb.run)
    bare, *_ = render_script(h.reads_body_and_comprehension)
    assert _constants(bare)["STNB_OPTIONS"] == {}


def test_a_dict_config_and_options_are_the_config_exported():
    cfg = TrainConfig(strategy="ddp", num_processes=2, **TINY)
    text, *_ = render_script(cfg.to_dict(), steps=7, strategy="fsdp")
    assert _constants(text)["CONFIG"] == cfg.replace(steps=7, strategy="fsdp").to_dict()


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_nodes=0), "num_nodes must be an integer >= 1, got 0"),
    (dict(num_nodes=True), "num_nodes must be an integer >= 1, got True"),
    (dict(num_nodes=2.0), "num_nodes must be an integer >= 1, got 2.0"),
    (dict(nproc_per_node=0), "nproc_per_node must be an integer >= 1, got 0"),
    (dict(nproc_per_node=True), "nproc_per_node must be an integer >= 1, got True"),
    (dict(nproc_per_node="2"), "nproc_per_node must be an integer >= 1, got '2'"),
])
def test_node_and_process_counts_that_are_not_positive_integers_are_refused(kwargs, message):
    with pytest.raises(ConfigError) as e:
        render_script(TrainConfig(strategy="ddp", num_processes=2, **TINY), **kwargs)
    assert str(e.value) == message


def test_the_counts_asked_for_are_the_commands_and_one_process_strategies_take_only_one():
    text, one, multi, nproc = render_script(TrainConfig(strategy="ddp", num_processes=2, **TINY), nproc_per_node=4,
                                            num_nodes=1)
    assert nproc == 4 and one["torchrun"] == "torchrun --standalone --nproc_per_node=4 train.py"
    assert multi["accelerate"] == ["accelerate launch --multi_gpu --num_machines=1 --num_processes=4 --machine_rank=0 "
                                   "--main_process_ip=$MASTER_ADDR --main_process_port=29500 train.py"]
    with pytest.raises(ConfigError) as e:
        render_script(TrainConfig(strategy="single", **TINY), nproc_per_node=2)
    assert str(e.value) == "strategy 'single' runs in one process; nproc_per_node must be 1"


def test_something_that_is_no_config_is_refused_naming_what_it_got(tmp_path):
    with pytest.raises(ConfigError) as e:
        stnb.export_script(["ddp"], tmp_path / "x.py", echo=False)
    assert str(e.value) == ("export_script needs a TrainConfig, a dict of its fields or a build function, got list")
    with pytest.raises(ConfigError) as e:
        stnb.export_script(TrainConfig(**TINY), tmp_path, echo=False)
    assert str(e.value) == f"{str(tmp_path)!r} is a folder; give the script's file name, e.g. " \
                           f"{str(tmp_path / 'train.py')!r}"
    assert list(tmp_path.iterdir()) == []


def test_the_config_is_one_field_per_line_and_a_value_wraps_past_90_columns():
    at_90, over_90 = {"a": list(range(1, 24))}, {"ab": list(range(1, 24))}  # reprs of 90 and 91 characters
    assert (len(repr(at_90)), len(repr(over_90))) == (90, 91)
    cfg = TrainConfig(strategy="ddp", num_processes=2, columns={"q": "anchor"}, **TINY)
    text, *_ = render_script(cfg.replace(extra=at_90))
    assert "\n    'columns': {'q': 'anchor'},\n" in text and f"\n    'extra': {at_90!r},\n" in text
    text, *_ = render_script(cfg.replace(extra=over_90))
    wrapped = "{'ab': [" + ",\n        ".join(map(str, range(1, 24))) + "]}"  # pprint: one item per line
    assert f"\n    'extra': {wrapped},\n" in text
    assert _constants(text)["CONFIG"] == cfg.replace(extra=over_90).to_dict()


def test_export_script_writes_an_executable_script_with_the_default_node_commands(tmp_path):
    cfg = TrainConfig(strategy="ddp", num_processes=2, **TINY)
    out = stnb.export_script(cfg, tmp_path / "t.py", echo=False)
    assert (out.num_nodes, out.master_addr, out.master_port, out.nproc_per_node) == (2, "$MASTER_ADDR", 29500, 2)
    assert out.node_commands("torchrun") == [
        f"torchrun --nnodes=2 --nproc_per_node=2 --node_rank={i} --master_addr=$MASTER_ADDR --master_port=29500 "
        f"{tmp_path / 't.py'}" for i in range(2)]
    assert (tmp_path / "t.py").stat().st_mode & 0o777 == 0o755  # ./t.py runs it (#!/usr/bin/env python)
    assert (tmp_path / "t.py").read_text().startswith("#!/usr/bin/env python\n")
    custom = stnb.export_script(cfg, tmp_path / "u.py", echo=False, num_nodes=3, master_addr="10.2.0.1",
                                master_port="29700")
    assert (custom.num_nodes, custom.master_addr, custom.master_port) == (3, "10.2.0.1", 29700)


def test_a_script_that_cannot_be_written_is_refused_with_the_folder_to_change(tmp_path):
    cfg = TrainConfig(strategy="ddp", num_processes=2, **TINY)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError) as e:  # its folder cannot be made: a file is in the way
        stnb.export_script(cfg, tmp_path / "a_file" / "t.py", echo=False)
    assert str(e.value).startswith(f"cannot write {str(tmp_path / 'a_file' / 't.py')!r}: [Errno ")
    assert str(e.value).endswith("; choose a writable folder")
    with pytest.raises(ConfigError) as e:  # the folder exists, but no file can be created in it (even by root)
        stnb.export_script(cfg, "/proc/stnb-export-test.py", echo=False)
    assert str(e.value).startswith("cannot write '/proc/stnb-export-test.py': [Errno 2] No such file or directory")
    assert str(e.value).endswith("; choose a writable folder")


def test_a_build_function_without_options_passes_none():
    text, *_ = render_script(h.reads_body_and_comprehension)
    assert "\nSTNB_OPTIONS = {}\n" in text


def test_printed_commands_show_the_script_relative_to_the_working_folder(tmp_path, monkeypatch):
    """A notebook's output shows no machine's folders: the printed commands name the script relative to
    the working folder (or ~/), while ExportedScript.path and .commands keep the absolute path."""
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "exported" / "train.py"   # an absolute path, as tempfile.mkdtemp() gives
    script = stnb.export_script(TrainConfig(strategy="ddp", num_processes=2, model="tiny"), str(target))
    assert script.path == str(target) and str(target) in script.commands["torchrun"]
    text = str(script)
    assert str(tmp_path) not in text, text
    assert text.startswith("wrote exported/train.py") and " exported/train.py" in text, text
