"""stnb's own recipe, inside a rank: a TrainConfig -> a SentenceTransformerTrainer.

The model (a bundled name, a path or a hub id), the data (synthetic, a file or a hub dataset, holding exactly
the columns the loss reads), the loss ('cosine', 'mnrl', or 'softmax+cosine': the seed's NLI + STS multi-dataset recipe,
``stnb.seed_recipe``), the dev evaluator and the training
arguments. ``stnb.builds.RecipeBuild`` is the recipe as the build function a rank trains: ``stnb.training.train_rank``
asks it what it asks a user's function (``builds.UserBuild``), and applies the strategy to its trainer
exactly as to the trainer a user's own build function returns.
"""

from __future__ import annotations

import functools

from .config import TrainConfig
from .processes import scratch_folder

#: the trainer logs every step: RunResult.losses holds each step's loss (one .item() per step). A
#: baseline that stnb's speed is held to logs as often (gpucheck's plain script is given this)
LOGGING_STEPS = 1


def build_trainer(config: TrainConfig, model_path: str, device: str, use_cuda: bool, distributed: bool):
    """The trainer of stnb's recipe for ``config`` (the model already on ``device``)."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from . import seed_recipe
    from .data import load_pairs
    from .models import load_model

    model = load_model(model_path, device=device, max_seq_length=config.max_seq_length)
    load = seed_recipe.load if config.loss == seed_recipe.NAME else functools.partial(load_pairs, loss=config.loss)
    # train holds exactly the columns the loss reads (a DatasetDict, one dataset per loss, for softmax+cosine)
    train, dev = load(config.data, config.train_size, config.dev_size, config.seed, columns=config.columns)
    args = dict(
        output_dir=output_dir(config),
        per_device_train_batch_size=config.per_device_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=LOGGING_STEPS,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=config.seed,
        data_seed=config.seed,
        dataloader_num_workers=0,
        dataloader_drop_last=distributed,
        dataloader_pin_memory=use_cuda,
        use_cpu=not use_cuda,
        bf16=config.mixed_precision == "bf16",
        fp16=config.mixed_precision == "fp16",
        # stnb freezes the unused pooler (strategies.freeze_unused_pooler), so DDP need not search the graph
        ddp_find_unused_parameters=bool(config.extra.get("find_unused_parameters", False)),
    )
    if config.checkpoint_every:  # stnb.checkpoints: into checkpoint_dir, each one complete or absent
        args.update(save_strategy="steps", save_steps=config.checkpoint_every, save_total_limit=config.keep)
    if config.evaluate and config.dev_points:  # the dev curve: the trainer evaluates on every rank, into log_history
        args.update(eval_strategy="steps", eval_steps=config.dev_eval_steps())
    args.update(config.strategy_object().trainer_arguments(config, device.split(":")[0]))  # deepspeed=...
    return SentenceTransformerTrainer(model=model, args=SentenceTransformerTrainingArguments(**args),
                                      train_dataset=train, loss=make_loss(config, model),
                                      evaluator=dev_evaluator(dev) if config.evaluate else None,
                                      callbacks=[evaluated_after()] if config.dev_points else None)


def output_dir(config: TrainConfig) -> str:
    """The trainer's folder: ``checkpoint_dir`` (kept) when the run checkpoints or resumes, else a scratch folder
    (``builds.RecipeBuild.clean_up`` removes it)."""
    import os

    if config.checkpoint_dir:
        return os.path.abspath(os.path.expanduser(config.checkpoint_dir))
    return scratch_folder("stnb-trainer-")


def evaluated_after():
    """A TrainerCallback that keeps the recipe's trainer from evaluating at its last step (transformers evaluates
    there under eval_strategy='steps'): the trained model is evaluated once after training, on rank 0, whole and
    in full precision (``training.Outcome``: dev_metric_after, the dev curve's last point)."""
    from transformers import TrainerCallback

    class TrainedModelEvaluatedAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= state.max_steps:
                control.should_evaluate = False

    return TrainedModelEvaluatedAfter()


def make_loss(config: TrainConfig, model):
    """The loss of ``config.loss``; for 'softmax+cosine' a dict {dataset: its loss} (stnb.seed_recipe)."""
    from sentence_transformers.sentence_transformer import losses

    from . import seed_recipe

    if config.loss == seed_recipe.NAME:
        return seed_recipe.make_losses(model)
    if config.loss == "cosine":
        return losses.CosineSimilarityLoss(model)
    return losses.MultipleNegativesRankingLoss(model, gather_across_devices=config.gather_across_devices)


def dev_evaluator(dev, name="dev"):
    """The dev evaluator that fits the dev rows: scored pairs -> Spearman (EmbeddingSimilarityEvaluator),
    (anchor, positive, negative...) -> TripletEvaluator accuracy (one triplet per negative),
    unscored pairs -> InformationRetrievalEvaluator NDCG@10 (each anchor's own positive among all)."""
    from .columns import text_columns
    from .data import has_scores

    if dev is None or len(dev) == 0:
        return None
    from sentence_transformers.sentence_transformer import evaluation

    texts = text_columns(dev)
    col = {c: list(dev[c]) for c in dev.column_names}
    if has_scores(dev):
        return evaluation.EmbeddingSimilarityEvaluator(col[texts[0]], col[texts[1]], col["score"], name=name,
                                                       show_progress_bar=False)
    if len(texts) > 2:
        anchors, positives = col[texts[0]], col[texts[1]]
        negatives = [col[c] for c in texts[2:]]
        return evaluation.TripletEvaluator(anchors * len(negatives), positives * len(negatives),
                                           [n for col in negatives for n in col], name=name,
                                           show_progress_bar=False, write_csv=False)
    queries = {f"q{i}": q for i, q in enumerate(col[texts[0]])}
    corpus = {f"d{i}": d for i, d in enumerate(col[texts[1]])}
    return evaluation.InformationRetrievalEvaluator(queries, corpus, {f"q{i}": {f"d{i}"} for i in range(len(dev))},
                                                    name=name, show_progress_bar=False, write_csv=False)
