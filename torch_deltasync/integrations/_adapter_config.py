"""A LoRA run's adapter config: PEFT's ``LoraConfig`` as the JSON that travels with the run
(``<prefix>/adapter/adapter_config.json``), read as untrusted input and compared by structure
(:mod:`torch_deltasync.integrations.peft`, ``docs/lora.md``)."""

from __future__ import annotations

import copy
import json
import math
import warnings
from typing import Any, Mapping

from ..errors import CorruptObjectError, ObjectNotFoundError, VersionNotFoundError
from ..manifest import Manifest, check_run_file
from ..store import Store, open_store


#: Store key of the run's adapter config, relative to the run prefix.
ADAPTER_CONFIG_KEY = "adapter/adapter_config.json"
#: Largest adapter config we parse (bytes); PEFT's are ~1-3 KiB.
MAX_ADAPTER_CONFIG_BYTES = 256 << 10

#: Config fields that change which tensors an adapter has or what they compute. Two configs that
#: agree on these describe interchangeable adapter weights (``peft_version``, paths, dropout and
#: ``inference_mode`` may differ).
STRUCTURAL_FIELDS = (
    "r", "lora_alpha", "target_modules", "exclude_modules", "use_rslora", "use_dora", "rank_pattern",
    "alpha_pattern", "fan_in_fan_out", "bias", "modules_to_save", "layers_to_transform", "layers_pattern",
    "lora_bias", "target_parameters", "trainable_token_indices", "layer_replication",
)


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _depth(doc: Any) -> int:
    """How deep JSON ``doc`` nests (a scalar: 0), without recursion."""
    deepest, todo = 0, [(doc, 0)]
    while todo:
        node, d = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d + 1)
            todo.extend((x, d + 1) for x in (node.values() if isinstance(node, dict) else node))
    return deepest


#: Fields whose types PEFT does not check when a config is built, and what each may be
#: (``LoraConfig``'s annotations); ``None`` is PEFT's default for all but the booleans, ``bias``,
#: ``lora_dropout`` and ``init_lora_weights`` (a bool or the name of a method, which vLLM checks).
_FIELD_TYPES = {
    "use_rslora": lambda v: type(v) is bool, "use_dora": lambda v: type(v) is bool,
    "fan_in_fan_out": lambda v: type(v) is bool, "lora_bias": lambda v: type(v) is bool,
    "bias": lambda v: v in ("none", "all", "lora_only"),
    "modules_to_save": lambda v: v is None or _strings(v),
    "exclude_modules": lambda v: v is None or isinstance(v, str) or _strings(v),
    "layers_pattern": lambda v: v is None or isinstance(v, str) or _strings(v),
    "layers_to_transform": lambda v: v is None or type(v) is int or _ints(v),
    "target_parameters": lambda v: v is None or _strings(v),
    "layer_replication": lambda v: v is None or (isinstance(v, list) and all(
        _ints(r) and len(r) == 2 and 0 <= r[0] < r[1] <= 1 << 16 for r in v)),
    "trainable_token_indices": lambda v: v is None or _ints(v) or (
        isinstance(v, dict) and all(isinstance(k, str) and _ints(x) for k, x in v.items())),
    "lora_dropout": lambda v: type(v) in (int, float) and 0 <= v <= 1,
    "init_lora_weights": lambda v: type(v) is bool or isinstance(v, str),
}

#: How deep an adapter config may nest (PEFT's own are 3 levels deep; Python's recursion in
#: ``LoraConfig.to_dict`` fails at some hundreds).
MAX_CONFIG_DEPTH = 16

#: Config fields a receiver's ``LoraConfig`` has reset to ``LoraConfig``'s defaults
#: (:func:`lora_config_from`): those that only configure an initialisation method of
#: ``init_lora_weights`` (LoftQ, EVA, CorDA, LoRA-GA), and ``megatron_core`` (used only with
#: ``megatron_config``, which is refused).
_RESET_FIELDS = {"loftq_config": {}, "eva_config": None, "corda_config": None, "lora_ga_config": None,
                "megatron_core": "megatron.core"}


#: ``init_lora_weights`` methods that change the base layer's weights when the adapter is made
#: (PEFT's PiSSA, OLoRA, LoftQ, CorDA and LoRA-GA initialisations subtract or quantize them).
BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda", "lora_ga")


def check_init_method(config, where: str) -> None:
    """Warn when ``config``'s ``init_lora_weights`` changed the trainer's base weights: receivers
    apply the synced adapter to their own, unchanged base weights, where it computes another
    function (unless they load the trainer's changed base too, or the adapter is converted with
    PEFT's ``path_initial_model_for_weight_conversion``). ``config``: a ``LoraConfig`` or its ``dict``."""
    if isinstance(config, Mapping):
        init = config.get("init_lora_weights", True)
    else:
        init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        warnings.warn(f"{where}: init_lora_weights={init!r} changed the base weights when the adapter was made; "
                      "receivers apply the adapter to their own base weights, where it computes another function "
                      "unless they hold the same changed base (or convert the adapter with PEFT's "
                      "path_initial_model_for_weight_conversion)", UserWarning, stacklevel=3)


def lora_config_class():
    from peft import LoraConfig

    return LoraConfig


def peft_config(model_or_config: Any, adapter_name: str):
    configs = getattr(model_or_config, "peft_config", None)
    cfg = configs[adapter_name] if isinstance(configs, Mapping) else model_or_config
    if not isinstance(cfg, lora_config_class()):
        raise TypeError(f"only LoRA adapters are supported, got {type(cfg).__name__}")
    return cfg


def adapter_config_json(model_or_config: Any, adapter_name: str = "default") -> bytes:
    """The adapter's ``LoraConfig`` as the JSON ``LoraConfig.save_pretrained`` writes (sets as sorted lists).

    Args:
        model_or_config: a ``peft.PeftModel`` or a ``peft.LoraConfig``.
        adapter_name: which adapter of a model.

    Raises:
        TypeError: not a LoRA adapter (only ``peft_type == "LORA"`` is supported).
    """
    d = peft_config(model_or_config, adapter_name).to_dict()
    for k, v in d.items():
        if isinstance(v, set):
            d[k] = sorted(v)
    return json.dumps(d, indent=2, sort_keys=True, default=str).encode()


def config_dict_json(doc: Mapping[str, Any], base_model_name_or_path: str | None = None) -> bytes:
    """The ``adapter_config.json`` of a materialised version: the run's config (as
    :func:`check_adapter_config` returns it), ``base_model_name_or_path`` replaced when given."""
    d = dict(doc)
    if base_model_name_or_path is not None:
        d["base_model_name_or_path"] = base_model_name_or_path
    return json.dumps(d, indent=2, sort_keys=True).encode()


def _config_error(where: str, msg: str) -> CorruptObjectError:
    return CorruptObjectError(f"{where}: {msg}")


def check_adapter_config(data: bytes, where: str = ADAPTER_CONFIG_KEY) -> dict[str, Any]:
    """Validate an untrusted adapter config (JSON bytes) without PEFT: what a receiver that only
    writes adapter folders for vLLM needs (vLLM parses ``adapter_config.json`` with its own
    ``vllm.lora.peft_helper.PEFTHelper`` and does not need ``peft``).

    Rules: at most :data:`MAX_ADAPTER_CONFIG_BYTES`; a JSON object nested at most
    :data:`MAX_CONFIG_DEPTH` deep; ``peft_type == "LORA"``; ``r`` a positive integer, ``lora_alpha``
    a finite number, ``target_modules`` a string or a list of strings, ``rank_pattern`` /
    ``alpha_pattern`` objects of positive integers / numbers; no ``megatron_config`` (PEFT imports
    the module it names); the fields PEFT takes without checking their types of the types it
    declares (:data:`_FIELD_TYPES`). The initialisation method stays as the trainer wrote it, so a
    materialised folder is read as the trainer's own checkpoint would be (vLLM refuses the methods
    that changed the trainer's base weights: :func:`check_init_method`).

    Args:
        data: the config bytes.
        where: what to name in errors (the store key or path).

    Returns:
        The config as a JSON object (``dict``).

    Raises:
        CorruptObjectError: any rule broken; the message names the field.
    """
    if len(data) > MAX_ADAPTER_CONFIG_BYTES:
        raise _config_error(where, f"{len(data)} bytes; an adapter config is at most {MAX_ADAPTER_CONFIG_BYTES}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _config_error(where, f"not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise _config_error(where, "the top level is not a JSON object")
    if _depth(doc) > MAX_CONFIG_DEPTH:
        raise _config_error(where, f"nests deeper than {MAX_CONFIG_DEPTH} levels")
    if doc.get("peft_type") != "LORA":
        raise _config_error(where, f"peft_type is {doc.get('peft_type')!r}; only LoRA adapters ('LORA') sync")
    r = doc.get("r")
    if type(r) is not int or not 1 <= r <= 1 << 16:
        raise _config_error(where, f"r must be an integer in [1, 65536], got {r!r}")
    alpha = doc.get("lora_alpha")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise _config_error(where, f"lora_alpha must be a finite number, got {alpha!r}")
    tm = doc.get("target_modules")
    if not (tm is None or isinstance(tm, str) or (isinstance(tm, list) and all(isinstance(x, str) for x in tm))):
        raise _config_error(where, f"target_modules must be a string or a list of strings, got {tm!r}")
    for key, kinds in (("rank_pattern", (int,)), ("alpha_pattern", (int, float))):
        pat = doc.get(key) or {}
        if not isinstance(pat, dict) or not all(
            isinstance(k, str) and type(v) in kinds and v > 0 and math.isfinite(v) for k, v in pat.items()
        ):
            raise _config_error(where, f"{key} must map module patterns to positive numbers, got {pat!r}")
    if doc.get("megatron_config") is not None:
        raise _config_error(where, "megatron_config is set; PEFT would import the module the config names")
    for key, ok in _FIELD_TYPES.items():
        if key in doc and not ok(doc[key]):
            raise _config_error(where, f"{key} has a value PEFT does not define: {doc[key]!r:.80}")
    return doc


def lora_config_from(doc: Mapping[str, Any], where: str = ADAPTER_CONFIG_KEY):
    """Build PEFT's ``LoraConfig`` from a config ``doc`` that :func:`check_adapter_config` accepted
    (``where``: what to name in errors, the store key or path). Keys this
    PEFT does not know are dropped with a warning, as ``PeftConfig.from_pretrained`` does (a newer
    PEFT wrote them). The initialisation method (``init_lora_weights`` other than true or false,
    and :data:`_RESET_FIELDS`) is reset to PEFT's default: it only acts when an adapter is created,
    never when received weights are loaded, and building a LoftQ config makes PEFT import scipy,
    which a rollout worker need not have.

    Raises:
        CorruptObjectError: PEFT's own checks reject the config.
        ImportError: ``peft`` is not installed.
    """
    cls = lora_config_class()
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(doc) - known)
    if unknown:
        warnings.warn(f"{where}: ignoring config keys this PEFT does not know: {unknown} (written by a newer PEFT?)")
    kwargs = {k: v for k, v in doc.items() if k in known}
    if not isinstance(kwargs.get("init_lora_weights", True), bool):
        kwargs["init_lora_weights"] = True
    for key, default in _RESET_FIELDS.items():
        if key in kwargs:
            kwargs[key] = copy.deepcopy(default)
    try:
        return cls(**cls.check_kwargs(**kwargs))
    except (TypeError, ValueError) as e:
        raise _config_error(where, f"PEFT rejects the config: {e}") from None


def parse_adapter_config(data: bytes, where: str = ADAPTER_CONFIG_KEY):
    """Validate an untrusted adapter config (JSON bytes) and build the ``peft.LoraConfig``:
    :func:`check_adapter_config`'s rules, then PEFT's own checks (unknown keys dropped with a
    warning).

    Args:
        data: the config bytes.
        where: what to name in errors (the store key or path).

    Returns:
        A ``peft.LoraConfig``.

    Raises:
        CorruptObjectError: any rule broken; the message names the field.
    """
    return lora_config_from(check_adapter_config(data, where), where)


def read_adapter_config_dict(store: Store | str, *, prefix: str = "", manifest: Manifest | None = None) -> dict[str, Any]:
    """Read a run's adapter config (``<prefix>/adapter/adapter_config.json``) without PEFT.

    Args:
        store: a store or anything :func:`~torch_deltasync.open_store` accepts.
        prefix: the run's sub-path in the store.
        manifest: a version of the run: the config must match the sha256 it records.

    Returns:
        The config as :func:`check_adapter_config` returns it (a ``dict``; PEFT's own checks have
        not run: :func:`read_adapter_config` runs them).

    Raises:
        VersionNotFoundError: the run has no adapter config (not an adapter run, or no sender yet).
        CorruptObjectError: the config breaks :func:`check_adapter_config`'s rules;
            ``ChecksumMismatchError`` when it is not the one ``manifest`` records.
        StoreError: the store failed.
    """
    st = open_store(store).sub(prefix)
    where = f"{st.describe()}/{ADAPTER_CONFIG_KEY}"
    try:
        data = st.get(ADAPTER_CONFIG_KEY)
    except ObjectNotFoundError:
        raise VersionNotFoundError(
            f"{st.describe()}: no {ADAPTER_CONFIG_KEY}; is this an adapter run (AdapterSender) and has it started?"
        ) from None
    if manifest is not None:
        check_run_file(data, ADAPTER_CONFIG_KEY, manifest, where)
    return check_adapter_config(data, where)


def read_adapter_config(store: Store | str, *, prefix: str = "", manifest: Manifest | None = None):
    """Read and validate a run's adapter config (``<prefix>/adapter/adapter_config.json``).

    Args:
        manifest: a version of the run: the config must match the sha256 it records
            (:attr:`Manifest.run_files`; manifests of runs written before they did record none).

    Raises:
        VersionNotFoundError: the run has no adapter config (not an adapter run, or no sender yet).
        CorruptObjectError: the config is invalid; ``ChecksumMismatchError`` when it is not the one
            ``manifest`` records (changed or damaged after the run published it).
        StoreError: the store failed.
    """
    st = open_store(store).sub(prefix)
    return lora_config_from(read_adapter_config_dict(st, manifest=manifest), f"{st.describe()}/{ADAPTER_CONFIG_KEY}")


def _structure(config) -> dict[str, Any]:
    d = config.to_dict()
    out = {}
    for k in STRUCTURAL_FIELDS:
        v = d.get(k)
        out[k] = sorted(v) if isinstance(v, (set, list)) and all(isinstance(x, str) for x in v) else v
    return out


def structure_diff(a, b) -> list[str]:
    sa, sb = _structure(a), _structure(b)
    return [f"{k}: {sa[k]!r} vs {sb[k]!r}" for k in STRUCTURAL_FIELDS if sa[k] != sb[k]]


# --- sender ------------------------------------------------------------------------------------
