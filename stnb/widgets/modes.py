"""The Panel's two ways to train, kept apart: stnb's recipe, or a user's build function.

The run's build object picks one (``stnb.builds``: ``panel_mode(MODES, ...)``). Both build the same controls
(model, steps, per-device batch, the batch's "override" box) and answer
the same questions: which controls a run locks, the TrainConfig they describe, the line saying what
will run, the progress bars' length until the ranks report theirs, and how to start the run.

- ``RecipeMode``: stnb's recipe; the model, steps and batch widgets make the run.
- ``BuildMode``: the user's function builds the trainer, so the model and steps are in it (their
  widgets hidden and disabled) and the batch is its ``per_device_train_batch_size`` unless "override"
  is ticked: then the Panel's batch replaces it in every rank (``override_args``, "set in the Panel").
"""

from __future__ import annotations

from types import SimpleNamespace

from ..config import TrainConfig
from .controls import batch_controls, recipe_controls
from .view import build_info, build_ready, recipe_ready

OVERRIDE = "per_device_train_batch_size"


class RecipeMode:
    """stnb's recipe: the Panel's model, steps and batch, over the profile's sizes."""

    build = build_name = None
    info = ""

    def __init__(self, profile, overrides: dict):
        self.base = profile.config(**overrides)
        self.model, self.steps = recipe_controls(self.base)
        self.batch, self.batch_override = batch_controls(self.base.per_device_batch_size, False,
                                                                  show_override=False)

    def inputs(self) -> tuple:
        """The controls a change of which re-validates the settings."""
        return (self.batch, self.steps, self.model)

    def refresh(self, running: bool) -> None:
        for w in self.inputs():
            w.disabled = running

    def config(self, launch: dict) -> TrainConfig:
        model = (self.model.value or "").strip() or self.base.model
        return self.base.replace(**launch, per_device_batch_size=int(self.batch.value), steps=int(self.steps.value),
                                 model=model)

    def ready(self, config) -> str:
        return recipe_ready(config)

    def expected_steps(self) -> int:
        return max(1, int(self.steps.value or 1))

    def start(self, config, **kw):
        from ..runner import run

        return run(config, **kw)


class BuildMode:
    """A user's build function: the launch fields and the strategies' knobs apply; the batch only when
    overridden; the recipe's model and steps are hidden and disabled."""

    def __init__(self, source, profile, overrides: dict):
        self.build, self.build_name = source.fn, source.name  # a builds.UserBuild: the function, checked
        self.base = TrainConfig.for_build(**overrides)
        self.info = build_info(self.build_name)
        self.model, self.steps = recipe_controls(self.base)
        for w in (self.model, self.steps):  # in the user's function
            w.layout.display = "none"
            w.disabled = True
        own = self.base.arg_overrides().get(OVERRIDE)
        self.batch, self.batch_override = batch_controls(own[0] if own else profile.per_device_batch_size,
                                                                  bool(own), show_override=True)

    def inputs(self) -> tuple:
        return (self.batch, self.batch_override)

    def refresh(self, running: bool) -> None:
        ticked = self.batch_override.value
        self.batch_override.disabled = running
        self.batch.disabled = running or not ticked
        self.batch.tooltip = ("replaces per_device_train_batch_size in your training arguments for this run"
                              if ticked else
                              "your build function's per_device_train_batch_size applies (change it in "
                              "your SentenceTransformerTrainingArguments, or tick override)")

    def config(self, launch: dict) -> TrainConfig:
        overrides = dict(self.base.override_args or {})
        overrides.pop(OVERRIDE, None)
        if self.batch_override.value:
            overrides[OVERRIDE] = (int(self.batch.value), "set in the Panel")
        return self.base.replace(**launch, override_args=overrides or None)

    def ready(self, config) -> str:
        return build_ready(config, self.build_name, int(self.batch.value) if self.batch_override.value else None)

    def expected_steps(self) -> int:
        return 1  # the function's max_steps: the ranks report it

    def start(self, config, **kw):
        from ..runner import run

        return run(self.build, **kw, **vars(config.run_options))


#: the Panel's modes, for the build object to pick from (``builds.RecipeBuild.panel_mode`` / ``UserBuild.panel_mode``)
MODES = SimpleNamespace(recipe=RecipeMode, build=BuildMode)
