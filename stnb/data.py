"""Training data: built-in synthetic pairs, local .csv/.jsonl/.json/.parquet files, or hub datasets.

Every loader returns ``datasets.Dataset`` objects holding exactly the columns the loss reads, in the
order it reads them (see ``stnb.columns``): text columns, then ``score`` when the loss takes one.

Column names in files / hub datasets (other names are mapped with ``columns={'question': 'anchor'}``
or dropped explicitly with ``{'id': None}``; anything else is refused, never dropped silently):
    sentence1, sentence2 [, score]                  (STS style; loss='cosine' needs the score)
    anchor, positive [, negative | negative_1..n]   (loss='mnrl'; negatives are hard negatives)
Scores on the STS 0-5 scale (any score > 1, none < 0 or > 5) are divided by 5 into [0, 1].
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import warnings

from .columns import ColumnPlan, check_mapping, loss_inputs, plan_columns
from .errors import ConfigError

SYNTHETIC = "synthetic"
FILE_SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
SCORE_COLUMN = "score"
_FIX_DATA = ("use data='synthetic', or a .csv/.jsonl/.parquet file with columns sentence1,sentence2[,score] "
             "or anchor,positive[,negative]")


# ---- synthetic data ----------------------------------------------------------------------------

# Each slot has several concepts; each concept has synonymous surface forms.
_SUBJECTS = [
    ["a man", "a guy", "a gentleman"],
    ["a woman", "a lady"],
    ["a child", "a kid", "a youngster"],
    ["a dog", "a puppy", "a hound"],
    ["a cat", "a kitten"],
    ["an old man", "an elderly man", "a grandfather"],
    ["a girl", "a young girl"],
    ["a boy", "a young boy", "a lad"],
    ["a chef", "a cook"],
    ["a student", "a pupil"],
    ["a police officer", "a cop", "a policeman"],
    ["a doctor", "a physician"],
]
_VERBS = [
    ["is eating", "is consuming", "is having"],
    ["is carrying", "is holding", "is transporting"],
    ["is cleaning", "is washing", "is scrubbing"],
    ["is looking at", "is watching", "is observing"],
    ["is painting", "is drawing"],
    ["is buying", "is purchasing"],
    ["is repairing", "is fixing", "is mending"],
    ["is throwing", "is tossing"],
    ["is selling", "is offering"],
    ["is photographing", "is taking a picture of"],
]
_OBJECTS = [
    ["an apple", "a piece of fruit"],
    ["a bicycle", "a bike"],
    ["a car", "an automobile", "a vehicle"],
    ["a guitar", "a stringed instrument"],
    ["a book", "a novel"],
    ["a ball", "a football"],
    ["a box", "a crate", "a carton"],
    ["a sandwich", "a sub"],
    ["a chair", "a seat"],
    ["a phone", "a mobile phone", "a cellphone"],
    ["a boat", "a small ship"],
    ["a lamp", "a light"],
]
_PLACES = [
    ["in the park", "in a public garden"],
    ["in the kitchen", "at the stove"],
    ["on the beach", "by the sea", "at the seaside"],
    ["in the street", "on the road"],
    ["at the market", "in the bazaar"],
    ["in the garage", "in the workshop"],
    ["in a classroom", "at school"],
    ["in the office", "at work"],
    ["on a mountain", "on a hill"],
    ["at home", "in the house"],
]
_SLOTS = (_SUBJECTS, _VERBS, _OBJECTS, _PLACES)
# How much agreement on each slot (subject, verb, object, place) adds to the score; sums to 1.
_SLOT_WEIGHTS = (0.3, 0.3, 0.25, 0.15)


def _sentence(rng: random.Random, concepts: tuple[int, ...]) -> str:
    s, v, o, p = (rng.choice(slot[c]) for slot, c in zip(_SLOTS, concepts))
    form = rng.randrange(3)
    if form == 0:
        text = f"{s} {v} {o} {p}"
    elif form == 1:
        text = f"{p}, {s} {v} {o}"
    else:
        text = f"{s} {p} {v} {o}"
    return text[0].upper() + text[1:] + "."


def synthetic_pairs(n: int, seed: int = 0):
    """SYNTHETIC STS-style sentence pairs made from templates (no real corpus).

    Each sentence fills four slots (subject, verb, object, place) with a concept, written with
    one of its synonyms in one of three word orders ("A man is eating an apple in the park.",
    "In a public garden, a guy is consuming a piece of fruit."). For each pair, k of the four
    slots (k uniform in 0..4) keep the same concept in sentence2 and the others change concept.
    ``score = 0.05 + 0.9 * (weight of agreeing slots) + noise`` with slot weights
    subject 0.3, verb 0.3, object 0.25, place 0.15 and Gaussian noise (sd 0.03), clipped to
    [0, 1]: paraphrases (all slots agree, different synonyms/word order) score ~0.9-1.0,
    partial overlaps land in the middle and unrelated pairs ~0.0-0.15. The task is learnable:
    a model must learn which words are synonyms and which slot differs.

    Deterministic: the same ``n`` and ``seed`` give identical rows (pure ``random.Random(seed)``,
    no global random state); a different seed gives different rows.

    Returns a ``datasets.Dataset`` with columns sentence1 (str), sentence2 (str), score (float).
    """
    import datasets

    rows = _synthetic_rows(n, seed)
    return datasets.Dataset.from_dict({"sentence1": [r[0] for r in rows], "sentence2": [r[1] for r in rows],
                                       "score": [r[2] for r in rows]})


def _synthetic_rows(n: int, seed: int) -> list[tuple[str, str, float, int]]:
    """(sentence1, sentence2, score, number of agreeing slots 0..4) for synthetic_pairs."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"synthetic_pairs needs a number of pairs n >= 0, got {n!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a = tuple(rng.randrange(len(slot)) for slot in _SLOTS)
        k = rng.randrange(5)
        same = set(rng.sample(range(4), k))
        b = tuple(a[i] if i in same else _other(rng, len(_SLOTS[i]), a[i]) for i in range(4))
        agreement = sum(_SLOT_WEIGHTS[i] for i in same)
        score = 0.05 + 0.9 * agreement + rng.gauss(0.0, 0.03)
        rows.append((_sentence(rng, a), _sentence(rng, b), round(min(1.0, max(0.0, score)), 4), k))
    return rows


def _other(rng: random.Random, n: int, avoid: int) -> int:
    c = rng.randrange(n - 1)
    return c + 1 if c >= avoid else c


def synthetic_positives(n: int, seed: int = 0):
    """SYNTHETIC (anchor, positive) paraphrase pairs, the training rows for in-batch-negative losses.

    Both sentences of a row describe the same four concepts (subject, verb, object, place) with
    independently drawn synonyms and word order, e.g. "A man is eating an apple in the park." and
    "In a public garden, a guy is consuming a piece of fruit."; the other rows of a batch are the
    negatives. ``synthetic_pairs`` rows cannot serve here: most of them are not paraphrases (their
    score says so), and MultipleNegativesRankingLoss would train every row as a positive pair.

    Deterministic per ``(n, seed)``, prefix-stable, independent of ``synthetic_pairs``' stream.
    Returns a ``datasets.Dataset`` with columns anchor (str), positive (str).
    """
    import datasets

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"synthetic_positives needs a number of pairs n >= 0, got {n!r}")
    rng = random.Random(f"positives:{seed}")
    anchors, positives = [], []
    for _ in range(n):
        concepts = tuple(rng.randrange(len(slot)) for slot in _SLOTS)
        a = _sentence(rng, concepts)
        b = _sentence(rng, concepts)
        for _ in range(8):  # reword: a copy teaches nothing
            if b != a:
                break
            b = _sentence(rng, concepts)
        anchors.append(a)
        positives.append(b)
    return datasets.Dataset.from_dict({"anchor": anchors, "positive": positives})


# ---- loading -----------------------------------------------------------------------------------

def _is_file_spec(spec: str) -> bool:
    return spec.lower().endswith(FILE_SUFFIXES)


_OTHER_FILE_SUFFIXES = (".tsv", ".txt", ".arrow", ".xlsx", ".xls", ".gz", ".zip")


def _looks_local(spec: str) -> bool:
    return (spec.startswith(("/", ".", "~")) or spec.lower().endswith(_OTHER_FILE_SUFFIXES)
            or os.path.exists(os.path.expanduser(spec)))


def load_pairs(spec: str, train_size: int, dev_size: int, seed: int, loss: str | None = None,
               columns: dict | None = None):
    """Load (train, dev) datasets holding the columns ``loss`` reads (see ``stnb.columns``).

    spec:
        'synthetic': ``synthetic_pairs(train_size + dev_size, seed)``; the first train_size rows
            are train, the rest dev. With loss='mnrl' train is ``synthetic_positives(train_size,
            seed)`` instead (every row a paraphrase pair); dev stays the scored pairs.
        a path ending in .csv, .jsonl, .json or .parquet: the first train_size rows are train and
            the next dev_size rows dev. If the file has fewer rows, dev keeps min(dev_size, 10% of
            the rows, at least 1) and train the rest, with a warning.
        anything else: a Hugging Face hub dataset, ``'name'`` or ``'name:config'`` (e.g.
            ``'sentence-transformers/stsb'``). Train comes from the 'train' split (else the first
            split), dev from a 'validation'/'dev' split when there is one, otherwise from the rows
            after train.
    loss: 'cosine' / 'mnrl' (the columns must be exactly what it reads), or None (names only).
    columns: renames the source's columns, {'question': 'anchor', 'id': None (drop)}; files and hub.
    Scores are scaled into [0, 1]. ``seed`` only affects synthetic data (files keep their order).
    """
    if spec == SYNTHETIC:
        _no_mapping_for_synthetic(columns)
        ds = synthetic_pairs(train_size + dev_size, seed)
        dev = _rows(ds, train_size, train_size + dev_size)
        if loss == "mnrl":
            return synthetic_positives(train_size, seed), dev
        return ds.select(range(train_size)), dev
    if _is_file_spec(spec) or _looks_local(spec):
        check_data(spec, loss, columns)
        path = os.path.abspath(os.path.expanduser(spec))
        ds = _normalise([_load_file(path)], path, loss, columns)[0]
        return _split_rows(ds, train_size, dev_size, path)
    return _load_hub(spec, train_size, dev_size, loss, columns)


def _no_mapping_for_synthetic(columns) -> None:
    if check_mapping(columns):
        raise ConfigError(f"columns={columns!r} renames columns of a file or hub dataset, but data='synthetic' "
                          "has fixed columns (sentence1, sentence2, score); drop columns, or point data at your file")


def _builder(path: str) -> str:
    low = path.lower()
    return "csv" if low.endswith(".csv") else "parquet" if low.endswith(".parquet") else "json"


def _load_file(path: str):
    import datasets

    builder = _builder(path)
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # datasets raises many different types for malformed files
        raise ConfigError(f"data file {path} could not be read as {builder.upper()} ({type(e).__name__}: {e}); "
                          f"fix the file or {_FIX_DATA}") from e


def _split_rows(ds, train_size: int, dev_size: int, where: str):
    n = len(ds)
    if n == 0:
        raise ConfigError(f"data {where} has no rows; {_FIX_DATA}")
    if n < train_size + dev_size:
        dev = min(dev_size, max(1, n // 10)) if dev_size > 0 else 0
        train = n - dev
        if train < 2:
            raise ConfigError(f"data {where} has only {n} rows; training needs at least {2 + dev} "
                              f"(train_size={train_size}, dev_size={dev_size}); add rows or {_FIX_DATA}")
        warnings.warn(f"data {where} has {n} rows, fewer than train_size + dev_size = "
                      f"{train_size + dev_size}; using {train} for train and {dev} for dev", stacklevel=3)
        train_size, dev_size = train, dev
    return ds.select(range(train_size)), _rows(ds, train_size, train_size + dev_size)


def _rows(ds, start: int, stop: int):
    """Rows start..stop-1; none when stop <= start (``datasets`` refuses an empty range that starts at the end:
    dev_size=0 asked for exactly that)."""
    return ds.select(range(start, stop)) if stop > start else ds.select([])


def _hub_error(spec: str, why: str) -> ConfigError:
    return ConfigError(f"cannot load hub dataset {spec!r}: {why}. Without the hub, use data='synthetic' (built in) "
                       "or a local .csv/.jsonl/.parquet file")


def _hub_name(spec: str) -> tuple[str, str | None]:
    name, _, config = spec.partition(":")
    return name, config or None


def _load_hub(spec: str, train_size: int, dev_size: int, loss=None, columns=None):
    import datasets

    from .models import hub_failure

    name, config = _hub_name(spec)
    try:
        dd = datasets.load_dataset(name, config)
    except Exception as e:
        raise _hub_error(spec, hub_failure(e)) from e
    if isinstance(dd, datasets.Dataset):
        dd = datasets.DatasetDict({"train": dd})
    splits = list(dd.keys())
    if not splits:
        raise ConfigError(f"hub dataset {spec!r} has no rows; {_FIX_DATA}")
    train_split = "train" if "train" in dd else splits[0]
    dev_split = next((s for s in ("validation", "dev") if s in dd), None)
    if dev_split is None:
        (ds,) = _normalise([dd[train_split]], spec, loss, columns)
        return _split_rows(ds, train_size, dev_size, spec)
    train, dev = _normalise([dd[train_split], dd[dev_split]], spec, loss, columns)
    if len(train) == 0:
        raise ConfigError(f"hub dataset {spec!r} split {train_split!r} has no rows; {_FIX_DATA}")
    return train.select(range(min(train_size, len(train)))), dev.select(range(min(dev_size, len(dev))))


def prepare(dataset, loss=None, columns=None, where: str = "data"):
    """One dataset -> exactly the columns ``loss`` reads, in its order (see ``stnb.columns``).

    Applies the mapping ``columns``, checks every column is used (ConfigError naming the columns,
    what the loss expects and the fix otherwise), checks texts are strings and scales scores.
    """
    return _normalise([dataset], where, loss, columns)[0]


def _normalise(parts: list, where: str, loss=None, columns=None) -> list:
    """Map, check and order the columns the loss reads; scale 0-5 scores into [0, 1].

    All parts (e.g. train and validation splits) share one column plan and one score scale.
    """
    plan = plan_columns(parts[0].column_names, loss, columns, where)
    li = loss_inputs(loss) if loss is not None else None
    as_score = plan.label is not None and (li is None or li.label == "score")  # class labels stay as they are
    out = []
    for p in parts:
        other = plan_columns(p.column_names, loss, columns, where)
        if other != plan:
            raise ConfigError(f"data {where}: its splits have different columns ({parts[0].column_names} and "
                              f"{p.column_names}); give every split the same columns")
        p = _apply(p, plan, as_score)
        for c in plan.texts:
            bad = sum(1 for v in p[c] if not isinstance(v, str))
            if bad:
                raise ConfigError(f"data {where}: column {c!r} has {bad} empty or non-text value(s); fill or drop "
                                  "those rows")
        out.append(p)
    if not as_score:
        return out
    values = [v for p in out for v in p[SCORE_COLUMN]]
    bad = [v for v in values if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v)]
    if bad:
        raise ConfigError(f"data {where}: column 'score' has {len(bad)} missing or non-numeric value(s) "
                          f"(e.g. {bad[0]!r}); scores must be numbers in [0, 1] or on the 0-5 STS scale")
    lo, hi = (min(values), max(values)) if values else (0.0, 0.0)
    if lo < 0 or hi > 5:
        raise ConfigError(f"data {where}: scores range from {lo} to {hi}; they must be in [0, 1] "
                          "or on the 0-5 STS scale (which is divided by 5); rescale the score column")
    scale = 5.0 if hi > 1 else 1.0
    return [p.remove_columns(SCORE_COLUMN).add_column(SCORE_COLUMN, [float(v) / scale for v in p[SCORE_COLUMN]])
            for p in out]


def _apply(ds, plan: ColumnPlan, as_score: bool):
    """Rename, keep the planned columns in the loss's order, and call a similarity label 'score'."""
    if plan.dropped:
        ds = ds.remove_columns(list(plan.dropped))
    if plan.rename:
        ds = ds.rename_columns(plan.rename)
    ds = ds.select_columns(plan.keep)
    if as_score and plan.label != SCORE_COLUMN:
        ds = ds.rename_column(plan.label, SCORE_COLUMN)
    return ds


# ---- checks ------------------------------------------------------------------------------------

def check_data(spec: str, loss: str | None = None, columns: dict | None = None) -> None:
    """Check a data spec before any process starts; ConfigError names the problem and the fix.

    'synthetic' is always fine (without a mapping). A local file (.csv/.jsonl/.json/.parquet, or
    anything path-like) must exist, be readable and non-empty, and its columns (after ``columns``)
    must be exactly what ``loss`` reads (``stnb.columns.plan_columns``). A hub dataset must be
    reachable (or cached); its columns are checked when the hub describes them.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"data must be a non-empty string, got {spec!r}; {_FIX_DATA}")
    if spec == SYNTHETIC:
        _no_mapping_for_synthetic(columns)
        return
    if not (_is_file_spec(spec) or _looks_local(spec)):
        return check_hub_data(spec, loss, columns)
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isdir(path):
        raise ConfigError(f"data path {path} is a folder, not a file; point data at a .csv/.jsonl/.parquet file")
    if not _is_file_spec(path):
        raise ConfigError(f"data file {path} has an unsupported type; use a .csv, .jsonl, .json or .parquet file "
                          "(or data='synthetic')")
    if not os.path.exists(path):
        raise ConfigError(f"data file {path} does not exist; check the path, or {_FIX_DATA}")
    if not os.path.isfile(path):
        raise ConfigError(f"data path {path} is not a regular file; point data at a .csv/.jsonl/.parquet file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError(f"data file {path} is not readable ({e}); fix its permissions or {_FIX_DATA}") from e
    if os.path.getsize(path) == 0:
        raise ConfigError(f"data file {path} is empty (0 bytes) and has no rows; {_FIX_DATA}")
    found = _parquet_columns(path) if _builder(path) == "parquet" else _first_row_columns(path)
    if found is None:
        raise ConfigError(f"data file {path} has no rows (only a header or blank lines); add rows or use "
                          "data='synthetic'")
    plan_columns(found, loss, columns, f"file {path}")


def check_hub_data(spec: str, loss=None, columns=None, timeout: float | None = None) -> None:
    """A hub dataset: refuse fast when the hub is offline/unreachable and the dataset is not cached,
    then check its columns from the hub's description (when it has one)."""
    import datasets

    from .models import HUB_TIMEOUT_S, hub_failure, hub_offline, probe_hub

    name, config = _hub_name(spec)
    if not hub_offline():
        # one bounded request: datasets' own loader retries a refused connection for ~25 s
        why = probe_hub(name, "dataset", HUB_TIMEOUT_S if timeout is None else timeout)
        if why:
            raise _hub_error(spec, why + " (a copy downloaded before is used with HF_HUB_OFFLINE=1)")
    try:
        builder = datasets.load_dataset_builder(name, config)
    except Exception as e:
        raise _hub_error(spec, hub_failure(e)) from e
    features = builder.info.features
    if features is not None:
        plan_columns(list(features), loss, columns, f"hub dataset {spec!r}")


def _parquet_columns(path: str) -> list[str] | None:
    """Column names of a Parquet file, or None when it holds no row."""
    try:
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError...
        raise ConfigError(f"data file {path} is not valid Parquet ({type(e).__name__}: {e}); fix the file or "
                          f"{_FIX_DATA}") from e
    if meta.num_rows == 0:
        return None
    return list(meta.schema.to_arrow_schema().names)


def _first_row_columns(path: str) -> list[str] | None:
    """Column names of the first data row, or None when the file holds no row."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if path.lower().endswith(".csv"):
                reader = csv.reader(f)
                header = next(reader, None)
                if header is None:
                    return None
                for row in reader:
                    if any(cell.strip() for cell in row):
                        return header
                return None
            # JSON Lines (.jsonl, and .json written one object per line) or a JSON array (.json)
            head = f.read(1)
            while head and head.isspace():
                head = f.read(1)
            if not head:
                return None
            if head == "[":
                rows = json.loads(head + f.read())
                if not rows:
                    return None
                if not isinstance(rows[0], dict):
                    raise ValueError("expected a list of objects")
                return list(rows[0])
            line = head + f.readline()
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("expected one JSON object per line")
            return list(row)
    except (ValueError, UnicodeDecodeError, csv.Error) as e:
        kind = "CSV" if path.lower().endswith(".csv") else "JSON Lines (one object per line) or a JSON list"
        raise ConfigError(f"data file {path} is not valid {kind}: {e}; fix the file or {_FIX_DATA}") from e


def has_scores(dataset) -> bool:
    """Whether the pair dataset carries similarity scores (a 'score' column)."""
    return SCORE_COLUMN in (dataset.column_names or [])
