"""The run configuration of the async GRPO recipe: one frozen dataclass, shipped to every actor."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["GRPOConfig"]


def _is_store_path(name: str) -> bool:
    """Whether ``name`` is a valid path inside a store (:func:`torch_deltasync.store.check_prefix`)."""
    from torch_deltasync.store import check_prefix

    try:
        check_prefix(name, "--run-name")
    except ValueError:
        return False
    return bool(name)


def _check_folder(path: Path, option: str) -> None:
    """Raise ``ValueError`` when ``path`` or a folder above it exists and is not a folder (a file),
    so that ``mkdir`` cannot work."""
    from torch_deltasync.store import file_in_the_way

    p = file_in_the_way(path)
    if p is not None:
        raise ValueError(f"{option}: {str(p)!r} is a file, not a folder (the run folder is {str(path)!r})")


def attention_shape(hidden_size: int) -> tuple[int, int, int]:
    """``(heads, key/value heads, head size)`` of the policy for ``hidden_size`` (heads of about 32,
    half as many key/value heads): :func:`recipes.grpo.policy.build_policy` builds it so."""
    heads = max(1, hidden_size // 32)
    return heads, max(1, heads // 2), hidden_size // heads


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """Everything a run needs. Runtime objects (meshes, models, stores) are never fields.

    The defaults are the README main command: about 0.4M-parameter Qwen3, two generator replicas,
    one trainer process, finishing in a few minutes on a 2-core CPU.
    """

    # --- run ---------------------------------------------------------------------------------------
    run_name: str = "async_grpo"
    """Folder name under ``runs_dir``; holds metrics, summary, plots, warm start and the default bucket."""
    runs_dir: str = "runs"
    """Parent folder of run folders."""
    bucket: str | None = None
    """Store path or URI (a folder, ``file://``, ``s3://...``, ``hf://buckets/...``; not ``memory://``, which
    lives inside one process). ``None``: an embedded local
    bucket at ``<run>/bucket`` (emptied at the start of each run)."""
    seed: int = 0
    """Seeds the warm start, the trainer and (offset by replica) every generator."""

    # --- model and task ----------------------------------------------------------------------------
    model_path: str | None = None
    """Local Hugging Face checkpoint (model + tokenizer) to train instead of the built-in Qwen3."""
    hidden_size: int = 128
    """Width of the built-in Qwen3 (ignored with ``model_path``)."""
    num_layers: int = 2
    """Decoder layers of the built-in Qwen3 (ignored with ``model_path``)."""
    digits: int = 5
    """Digits per prompt of the sorting task."""

    # --- supervised warm start ---------------------------------------------------------------------
    warmstart_steps: int = 400
    """Adam steps of supervised training before GRPO (cached under ``<run>/warmstart``); 0: none."""
    warmstart_lr: float = 3e-3
    """Peak learning rate of the warm start (one-cycle schedule)."""
    warmstart_noise: float = 0.3
    """Probability that the demonstrator writes a random digit instead of the right one: the warm
    start learns the task but samples wrong digits often, which GRPO then fixes."""
    warmstart_batch: int = 64
    """Examples per warm-start step."""

    # --- GRPO --------------------------------------------------------------------------------------
    steps: int = 200
    """GRPO steps (each consumes ``train_batch`` samples and makes ``minibatches`` optimizer steps)."""
    lr: float = 1e-5
    """Adam learning rate of GRPO (RL range, 1e-6 to 1e-5)."""
    train_batch: int = 64
    """Samples per GRPO step."""
    minibatches: int = 2
    """Optimizer steps per GRPO step; the clipped ratio acts from the second one on."""
    prompts_per_batch: int = 8
    """Prompts per generator batch."""
    group_size: int = 8
    """Completions per prompt; advantages are normalised within each group."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature."""
    clip_low: float = 0.2
    """Clipped ratio range is ``[1 - clip_low, 1 + clip_high]``."""
    clip_high: float = 0.2
    tis_cap: float | None = 2.0
    """Truncated importance sampling: weight each token by ``min(pi_old / pi_gen, tis_cap)``, with
    ``pi_gen`` the stored generation log-prob. ``None``: no correction."""

    # --- asynchrony and sync -----------------------------------------------------------------------
    publish_every: int = 1
    """Publish a version every this many GRPO steps."""
    max_staleness: int = 2
    """Samples more than this many versions older than the trainer's are dropped (and counted)."""
    max_buffered: int | None = None
    """Fresh samples in the buffer at which rollouts pause (back-pressure). ``None``: ``train_batch``
    (the next step's batch is ready; more would only age in the buffer)."""
    buffer_capacity: int = 2048
    """Slots of the replay buffer storage."""
    anchor_every: int = 0
    """Full anchor every this many versions (0: only the first version is an anchor)."""
    codec: str = "packed"
    """Delta codec name (``torch_deltasync.codecs.codec_names()``): ``"packed"`` (the library default: gaps,
    value steps, zstd) or ``"raw"`` (int32/int64 index + bf16 value per changed element)."""
    trainer_procs: int = 1
    """Trainer processes; more than 1 shards the policy with FSDP2 over gloo."""
    generators: int = 2
    """Generator replicas, one process each, each with its own model copy and ``DeltaReceiver``."""
    generator_backend: str = "hf"
    """Generator engine (``--engine``): ``"hf"`` (Hugging Face transformers in the replica's process);
    ``"vllm"`` (a vLLM OpenAI server process per replica, from ``.venv-vllm``, weights through its RL
    routes); ``"vllm-offline"`` (an in-process ``vllm.LLM``, GPU only)."""
    interrupt: str | None = None
    """What a new version does to rollouts in flight (:mod:`recipes.grpo.inflight`): ``"keep"``
    (commit under running rollouts, which continue on the new weights), ``"abort"`` (commit after
    aborting running rollouts, which are re-submitted with their prefix on the new weights),
    ``"drain"`` (commit between batches only).
    ``None``: ``keep`` with ``vllm``, ``drain`` otherwise (the only mode of the other engines)."""
    sync_poll_ms: float = 20.0
    """With ``keep`` / ``abort``: milliseconds between two looks of a generator for a newly staged
    version (a read of local readiness files) while its rollouts run; a found version is committed
    at once, under the running requests."""
    sync_lag: int = 1
    """With ``keep`` / ``abort``: commit in flight once the newest staged version is this many
    versions ahead of the served one (1: every version; ``k``: one pause per ``k`` versions, tokens
    up to ``k - 1`` versions behind the newest when sampled). At most ``max(1, max_staleness)``."""
    vllm_python: str | None = None
    """Interpreter of the vLLM environment (``None``: ``$TORCH_DELTASYNC_VLLM_PYTHON`` or ``.venv-vllm``)."""

    # --- robustness --------------------------------------------------------------------------------
    call_timeout_s: float = 300.0
    """Longest wait for any single actor call before the run reports it and stops (no hang)."""
    sample_timeout_s: float = 300.0
    """Longest wait of the trainer for a batch of fresh samples."""
    kill_generator: int | None = None
    """Fault injection (tests): SIGKILL this generator replica ..."""
    kill_at_step: int | None = None
    """... when the trainer reaches this GRPO step."""
    kill_target: str = "actor"
    """... its actor process (``"actor"``) or, with ``vllm``, its vLLM server process (``"server"``)."""

    def __post_init__(self) -> None:
        positive = ("steps", "train_batch", "minibatches", "prompts_per_batch", "publish_every",
                    "buffer_capacity", "trainer_procs", "generators", "digits", "hidden_size", "num_layers")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.generators + self.trainer_procs > 256:  # one host's process mesh: 100,000 panicked in Monarch
            raise ValueError(f"GRPOConfig.generators + trainer_procs must be at most 256 processes on this host, got "
                             f"{self.generators} + {self.trainer_procs}")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if self.train_batch % (self.minibatches * self.trainer_procs):
            raise ValueError(f"GRPOConfig.train_batch ({self.train_batch}) must be a multiple of minibatches x "
                             f"trainer_procs ({self.minibatches} x {self.trainer_procs})")
        if self.max_staleness < 0:
            raise ValueError(f"GRPOConfig.max_staleness must be >= 0, got {self.max_staleness}")
        if not 0 < self.lr < 1:
            raise ValueError(f"GRPOConfig.lr must be in (0, 1), got {self.lr}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"clip range [1 - {self.clip_low}, 1 + {self.clip_high}] is empty or negative")
        if self.tis_cap is not None and not 0 < self.tis_cap < float("inf"):
            raise ValueError(f"GRPOConfig.tis_cap must be > 0 or None, got {self.tis_cap}")
        if not 0 <= self.warmstart_noise <= 1:
            raise ValueError(f"GRPOConfig.warmstart_noise must be in [0, 1], got {self.warmstart_noise}")
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"GRPOConfig.temperature must be > 0, got {self.temperature}")
        if self.digits > 32:
            raise ValueError(f"GRPOConfig.digits must be in [1, 32] (the sorting task's range), got {self.digits}")
        heads, kv_heads, head_dim = attention_shape(self.hidden_size)
        if head_dim % 2 or heads % kv_heads:
            raise ValueError(f"GRPOConfig.hidden_size {self.hidden_size} gives {heads} attention heads of {head_dim} "
                             f"and {kv_heads} key/value heads: rotary embeddings need an even head size and the key/"
                             "value heads must divide the heads; use a multiple of 64, or an even number below 64")
        if "/" in self.run_name or not _is_store_path(self.run_name):  # one key segment (the store's rule)
            raise ValueError(f"--run-name {self.run_name!r} must be a plain name (letters, digits, '._=+@,-'; it names "
                             "a folder under --runs-dir and the store prefix)")
        if self.bucket is not None and not str(self.bucket).strip():
            raise ValueError("--bucket '' is empty: give a folder, file://, s3:// or hf://buckets/... (or leave it out "
                             "for runs/<name>/bucket)")
        if self.bucket is not None and "://" in str(self.bucket):
            from torch_deltasync.store import STORE_SCHEMES

            if str(self.bucket).partition("://")[0] not in STORE_SCHEMES:
                raise ValueError(f"--bucket {self.bucket!r}: use a folder, file://, s3://, gs://, az:// or "
                                 "hf://buckets/...")
        elif self.bucket is not None and Path(self.bucket).expanduser().exists() \
                and not Path(self.bucket).expanduser().is_dir():
            raise ValueError(f"--bucket {self.bucket!r} is a file, not a folder")
        if self.bucket is not None and not str(self.bucket).startswith("memory://"):
            from torch_deltasync.errors import StoreNotFoundError
            from torch_deltasync.store import check_store

            try:  # the URI's form, a folder under a file, the file system's package: nothing is made or fetched
                check_store(str(self.bucket))
            except (ValueError, ImportError, StoreNotFoundError) as e:
                raise ValueError(f"--bucket {self.bucket!r}: {e}") from None
        if self.buffer_capacity < 2 * self.train_batch:
            raise ValueError(f"GRPOConfig.buffer_capacity must be >= 2 * train_batch, got {self.buffer_capacity}")
        if not self.call_timeout_s > 0:
            raise ValueError(f"GRPOConfig.call_timeout_s must be > 0, got {self.call_timeout_s}")
        if self.anchor_every < 0:
            raise ValueError(f"GRPOConfig.anchor_every must be >= 0 (0: first version only), got {self.anchor_every}")
        if self.warmstart_steps < 0:
            raise ValueError(f"GRPOConfig.warmstart_steps must be >= 0, got {self.warmstart_steps}")
        if self.max_buffered is not None and self.max_buffered < 1:
            raise ValueError(f"GRPOConfig.max_buffered must be >= 1, got {self.max_buffered}")
        from .inflight import INTERRUPT_MODES

        if self.interrupt is not None and self.interrupt not in INTERRUPT_MODES:
            raise ValueError(f"--interrupt must be one of {list(INTERRUPT_MODES)}, got {self.interrupt!r}")
        if self.interrupt_mode != "drain" and self.generator_backend != "vllm":
            raise ValueError(f"--interrupt {self.interrupt} needs --engine vllm (the {self.generator_backend!r} engine "
                             "updates between batches only: --interrupt drain)")
        if not 1 <= self.sync_lag <= max(1, self.max_staleness):
            raise ValueError(f"GRPOConfig.sync_lag must be in [1, max(1, max_staleness) = {max(1, self.max_staleness)}] "
                             f"(a replica further behind yields only stale tokens), got {self.sync_lag}")
        if not self.sync_poll_ms > 0:
            raise ValueError(f"GRPOConfig.sync_poll_ms must be > 0, got {self.sync_poll_ms}")
        from torch_deltasync.codecs import codec_names

        if self.codec not in codec_names():
            raise ValueError(f"GRPOConfig.codec must be one of {sorted(codec_names())}, got {self.codec!r}")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"--model {self.model_path!r} is not a local Hugging Face checkpoint folder "
                             "(no config.json there; nothing is downloaded)")
        if self.bucket is not None and str(self.bucket).startswith("memory://"):
            raise ValueError("--bucket memory://... lives inside one process, but the trainer and the generators run "
                             "in separate processes; use a folder, file://, s3:// or hf://buckets/...")
        if (self.kill_generator is None) != (self.kill_at_step is None):
            raise ValueError("--kill-generator and --kill-at-step go together")
        if self.kill_target not in ("actor", "server"):
            raise ValueError(f"--kill-target must be 'actor' or 'server', got {self.kill_target!r}")
        if self.kill_target == "server" and self.generator_backend != "vllm":
            raise ValueError("--kill-target server needs --engine vllm (only it runs a server process)")
        if self.kill_generator is not None and not 0 <= self.kill_generator < self.generators:
            raise ValueError(f"--kill-generator {self.kill_generator} is not a replica index in [0, {self.generators})")
        if self.kill_at_step is not None and not 0 <= self.kill_at_step < self.steps:
            raise ValueError(f"--kill-at-step {self.kill_at_step} is not a GRPO step in [0, {self.steps}) (--steps "
                             f"{self.steps}): the fault would never be injected")
        from .generators import backend_names

        if self.generator_backend not in backend_names():
            raise ValueError(f"--engine {self.generator_backend!r} is not a generator engine; use one of "
                             f"{backend_names()} (recipes.grpo.generators.register_backend adds one)")
        if self.generator_backend == "vllm-offline" and self.model_path is None:
            raise ValueError("--engine vllm-offline needs --model PATH (vLLM serves a Hugging Face checkpoint; the "
                             "built-in policy has none)")

    def check_environment(self) -> None:
        """What the settings need from this machine, checked before a run starts (not when a config
        is built: ``--help`` builds one with the defaults): the vLLM environment's python for
        ``--engine vllm``, and a run folder that can be made.

        Raises:
            ValueError: naming the option and what is wrong.
        """
        if self.generator_backend == "vllm":
            from .vllm_server import default_vllm_python

            python = self.vllm_python or default_vllm_python()
            if shutil.which(python) is None:
                raise ValueError(f"--engine vllm: the vLLM environment's python {python!r} does not exist; run "
                                 "`bash tools/setup.sh` (it builds .venv-vllm) or give --vllm-python")
        _check_folder(Path(self.runs_dir) / self.run_name, "--runs-dir / --run-name")

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_name

    @property
    def interrupt_mode(self) -> str:
        """``interrupt`` with its default filled in (``keep`` for ``vllm``, else ``drain``)."""
        if self.interrupt is not None:
            return self.interrupt
        return "keep" if self.generator_backend == "vllm" else "drain"

    @property
    def buffered_limit(self) -> int:
        return self.max_buffered if self.max_buffered is not None else self.train_batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
