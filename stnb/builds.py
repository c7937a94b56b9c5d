"""What a run trains: stnb's recipe or a user's build function, as one kind of object the run asks.

stnb's recipe is the build function it would have been written as (``RecipeBuild``); a user's function is
wrapped as one (``UserBuild``). A run's ``launchers.Plan`` always carries one, and everything that differs
between the two is a method of it, asked by one caller each:

    check(config)           before launch: the options this kind of training takes (a launcher's check)
    check_inputs(config)    before launch: the recipe's model resolved, its data checked and its predicted model
                            state held against the memory budget (the user's are its own: checked in the rank)
    build(config, ...)      in every rank: the trainer (``training.train_rank``)
    initial_path, frozen    in the rank: the untrained model's path; what stnb froze in it
    facts(trainer)          in the rank: RankReport's ``build`` and ``training``
    clean_up(trainer)       in the rank: what stnb made for the trainer
    result_config(...)      the RunResult's ``config`` (``results.merge``)
    unavailable_row(config) a 'not runnable here' row's batch, model and config (``RunResult.unavailable``)
    script(...)             how an exported script describes and embeds it (``export.render_script``)
    panel_mode(...)         the Panel's controls for it (``widgets.modes``)
"""

from __future__ import annotations

import pprint
import shutil

from .config import TrainConfig, launch_fields
from .errors import ConfigError


class RecipeBuild:
    """stnb's recipe (``stnb.recipe``) for the run's ``TrainConfig.recipe``: the model resolved before launch (its
    path travels with this object to the ranks), the trainer built in each rank, its unused pooler frozen
    (``strategies.freeze_unused_pooler``: it never gets a gradient, so DDP need not search the graph)."""

    name = None  # RunResult.build: None, the run's TrainConfig says it all

    def __init__(self, model_path: str | None = None):
        self.model_path = model_path
        self.frozen: list = []
        self.scratch = True  # the trainer's output_dir is a scratch folder (not checkpoint_dir): removed after

    # ---- before launch -------------------------------------------------------------
    def check(self, config: TrainConfig) -> None:
        config.check_recipe_options()  # options only a user's build function takes, refused

    def check_inputs(self, config: TrainConfig) -> None:
        from .budget import refuse, shape_from_files

        self.model_path = config.recipe.check_inputs()  # resolved once here ('tiny' is built here)
        # a memory budget below the model state it predicts, from the model folder's tensor headers (not loaded)
        refuse(config, shape_from_files(self.model_path), config.world_size(), config.resolved_device())

    def checkpoints(self, config: TrainConfig) -> bool | None:
        """Whether the run writes checkpoints (None: only its trainer knows, in the ranks)."""
        return bool(config.checkpoint_every)

    # ---- in a rank -----------------------------------------------------------------
    @property
    def initial_path(self) -> str | None:
        return self.model_path  # the untrained model, to rebuild an unsharded copy and check a save

    def build(self, config: TrainConfig, device: str, distributed: bool):
        from .models import resolve_model
        from .recipe import build_trainer
        from .strategies import freeze_unused_pooler

        # resolved by the launcher's check (check_inputs); here only when train_rank was handed RecipeBuild()
        self.model_path = self.model_path or resolve_model(config.model)
        trainer = build_trainer(config, self.model_path, device, device != "cpu", distributed)
        self.scratch = not config.checkpoint_dir
        self.frozen = freeze_unused_pooler(trainer.model)
        return trainer

    def clean_up(self, trainer) -> None:
        if self.scratch:
            shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # the recipe's scratch folder (not checkpoints)

    def facts(self, trainer) -> dict:
        """RankReport's ``build`` and ``training``: None for stnb's recipe (its TrainConfig says it all)."""
        return {"build": None, "training": None}

    # ---- what a result and an export say ---------------------------------------------
    def result_config(self, config: TrainConfig, training: dict) -> dict:
        return config.to_dict()

    def unavailable_row(self, config: TrainConfig) -> dict:
        """A 'not runnable here' row's batch, model and config."""
        return {"per_device_batch_size": config.per_device_batch_size, "global_batch_size": config.global_batch_size(),
                "model": config.model, "config": config.to_dict(), "build": None}

    def script(self, config: TrainConfig, options: dict, results_file) -> dict:
        """An exported script's source line, what it needs, and its body."""
        return {"source": "a notebook configuration", "needs": _RECIPE_NEEDS,
                "body": _RECIPE_BODY.format(config=dict_literal(config.to_dict()), results_file=results_file)}

    def panel_mode(self, modes, profile, overrides: dict):
        return modes.recipe(profile, overrides)


class UserBuild:
    """A user's function returning a SentenceTransformerTrainer (``stnb.run(build, ...)``), checked by
    ``check_build``: each rank calls it (``prepare.call_build``: checked, or BuildError naming the fix)."""

    initial_path = None  # the untrained model: saved by the rank where it is needed (train_rank)
    frozen: list = []    # stnb freezes nothing in a user's model

    def __init__(self, fn):
        from .prepare import describe

        self.fn, self.name = fn, describe(fn)

    def check(self, config: TrainConfig) -> None:
        """ConfigError when ``config``'s strategy cannot train what the function reads (``Strategy.build_refusal``)."""
        from .buildsource import read_objects

        problem = config.strategy_object().build_refusal(read_objects(self.fn))
        if problem:
            raise ConfigError(f"strategy {config.strategy!r}: {problem}")

    def check_inputs(self, config: TrainConfig) -> None:
        pass  # the function's model and data are its own

    def checkpoints(self, config: TrainConfig) -> bool | None:
        return None  # its trainer's save_strategy says, once built in a rank

    def build(self, config: TrainConfig, device: str, distributed: bool):
        from .prepare import call_build

        return call_build(self.fn)

    def clean_up(self, trainer) -> None:
        pass  # the trainer's folders are the user's

    def facts(self, trainer) -> dict:
        """RankReport's ``build`` (the function's name) and ``training``: what the user's trainer trains
        with, for the result's config (its TrainConfig recipe fields do not apply)."""
        from .prepare import training_facts

        return {"build": self.name, "training": training_facts(trainer)}

    def result_config(self, config: TrainConfig, training: dict) -> dict:
        """The run options it was given, what its trainer trains with, and the function's name."""
        takes = launch_fields()
        return {**{k: v for k, v in config.to_dict().items() if k in takes},
                **training, "build": self.name}

    def unavailable_row(self, config: TrainConfig) -> dict:
        """A 'not runnable here' row names the function instead of the recipe's model; its batch is the
        override's when one was given (else unknown, 0)."""
        batch = config.arg_overrides().get("per_device_train_batch_size", (0, ""))[0]
        return {"per_device_batch_size": batch, "global_batch_size": batch * config.world_size(),
                "model": self.name, "config": self.result_config(config, {}), "build": self.name}

    def script(self, config: TrainConfig, options: dict, results_file) -> dict:
        """The function's source goes in as it is (never through str.format: it has braces of its own)."""
        from .buildsource import build_source

        source = build_source(self.fn)  # ConfigError naming what stays in this kernel
        return {"source": f"the build function {source.name}() of a notebook",
                "needs": _BUILD_NEEDS.format(name=source.name),
                "body": "\nfrom __future__ import annotations\n\n" + source.text
                + _BUILD_MAIN.format(name=source.name, options=dict_literal(options) if options else "{}",
                                     results_file=results_file)}

    def panel_mode(self, modes, profile, overrides: dict):
        return modes.build(self, profile, overrides)


def check_build(build):
    """``build`` is a function stnb can call with no arguments in every rank (ConfigError otherwise)."""
    import inspect

    try:
        from transformers import Trainer

        if isinstance(build, Trainer):
            raise ConfigError("stnb.run got a trainer built in this process; pass the function that builds it "
                              "instead (stnb.run(build, ...), not stnb.run(build())): each rank builds its own "
                              "trainer, and a trainer made here holds state forked ranks cannot use")
    except ImportError:  # pragma: no cover
        pass
    if not callable(build):
        raise ConfigError(f"stnb.run takes a TrainConfig or a function returning a SentenceTransformerTrainer; "
                          f"got {type(build).__name__}")
    if inspect.iscoroutinefunction(build) or inspect.isgeneratorfunction(build):
        raise ConfigError("the build function must return the trainer (not be async or a generator)")
    try:
        sig = inspect.signature(build)
    except (TypeError, ValueError):
        return build
    required = [p.name for p in sig.parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise ConfigError(f"stnb calls your build function with no arguments, but {getattr(build, '__name__', build)}"
                          f"() requires {', '.join(required)}; give them defaults, or bind them with "
                          f"functools.partial(build, {required[0]}=...)")
    from .buildsource import global_objects
    from .model_types import trainer_problem

    problem = trainer_problem(global_objects(build))
    if problem:
        raise ConfigError(problem)
    return build


def build_of(fn=None):
    """The build object of a user's optional function (the Panel's ``build=``): ``UserBuild`` of it, checked
    (``check_build``), else stnb's recipe."""
    return RecipeBuild() if fn is None else UserBuild(check_build(fn))


def dict_literal(d: dict) -> str:
    """A readable Python literal, one field per line (ast.literal_eval gives ``d`` back)."""
    return "{\n" + "".join(f"    {k!r}: {pprint.pformat(v, width=90)},\n" for k, v in d.items()) + "}"


_RECIPE_NEEDS = """\
Needs stnb installed where it runs (pip install stnb, or pip install -e <stnb checkout>):
main() calls stnb's runner, which builds the model, data, loss and sentence-transformers
trainer exactly as the notebook did, verifies the strategy and measures the run."""

_BUILD_NEEDS = """\
Needs stnb, and every package {name}() imports, installed where it runs. Every rank calls
{name}() and stnb applies the strategy to the SentenceTransformerTrainer it returns, verifies
it and measures the run, exactly as stnb.run({name}, ...) did in the notebook."""

_RECIPE_BODY = """
import json

CONFIG = {config}

# a JSONL file rank 0 appends the RunResult to (stnb.load_results reads it), or None
RESULTS_FILE = {results_file!r}


def main():
    import stnb
    from stnb.scaleout import is_main_process

    result = stnb.run(stnb.TrainConfig.from_dict(CONFIG), results_file=RESULTS_FILE)
    if is_main_process():
        print(json.dumps(result.to_dict()), flush=True)


if __name__ == "__main__":
    main()
"""

_BUILD_MAIN = """

# the options given to stnb.run({name}, ...) in the notebook
STNB_OPTIONS = {options}

# a JSONL file rank 0 appends the RunResult to (stnb.load_results reads it), or None
STNB_RESULTS_FILE = {results_file!r}


def main():
    import json

    import stnb
    from stnb.scaleout import is_main_process

    result = stnb.run({name}, results_file=STNB_RESULTS_FILE, **STNB_OPTIONS)
    if is_main_process():
        print(json.dumps(result.to_dict()), flush=True)


if __name__ == "__main__":
    main()
"""


