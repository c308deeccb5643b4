"""The schema tier of a run config: the pydantic models of every section (types, ranges, unknown
keys refused)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from fsmtrain.app.config.loading import override_of
from fsmtrain.app.config.problems import ConfigError, ConfigProblem
from fsmtrain.core.context import BUILTIN_METRICS, UNBOUNDED_EPOCHS
from fsmtrain.core.signals import preemption_signals

# What is trained: the fields that shape the weights, which a resume keeps and a replay cannot change
TRAINING_FIELDS: tuple[str, ...] = (
    "net", "net_config", "optimizer", "optimizer_config", "scheduler", "scheduler_config", "criterion",
    "criterion_config", "data", "data_config", "batch_size", "metrics", "grad_clip", "grad_accumulation", "precision",
    "step", "val_step", "optimizers", "schedulers",
)


class _Section(BaseModel):
    # strict: "3" is not an int; extra keys are mistakes, not silently ignored settings
    model_config = ConfigDict(extra="forbid", strict=True)


class Toggle(_Section):
    enabled: bool = True


class EarlyStoppingConfig(Toggle):
    patience: int = Field(default=20, ge=1)
    mode: Literal["min", "max"] = "min"
    min_delta: float = Field(default=1e-4, ge=0)
    monitor: str = "val_loss"


class CheckpointConfig(Toggle):
    save_every_n_epochs: int = Field(default=1, ge=1)
    keep_last_k: int = Field(default=3, ge=1)
    save_best: bool = True
    save_latest: bool = True  # latest.pt at every epoch end, so any kill leaves a recent resume point
    monitor: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    background: bool = True  # write on a writer thread while the next epoch trains; committed when durable
    every_n_steps: int | None = Field(default=None, ge=1)  # also step_<n>.pt after every N-th global step
    every_minutes: float | None = Field(default=None, gt=0)  # and after the first step M minutes after the last


class LogConfig(_Section):
    # fsync events.jsonl after each checkpoint commit and the result ("commits"), every line, or never
    fsync: Literal["commits", "every", "never"] = "commits"


class PreemptionConfig(_Section):
    signals: list[str] = Field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # notices: save the step, exit 143
    # several ranks: the batches between the rounds that compare their signals (auto: about every 500 ms)
    rounds_every: Literal["auto"] | int = "auto"

    @field_validator("signals")
    @classmethod
    def _signals(cls, v: list[str]) -> list[str]:
        return [sig.name for sig in preemption_signals(v)]

    @field_validator("rounds_every", mode="before")
    @classmethod
    def _rounds_every(cls, v: object) -> object:
        if v == "auto" or (type(v) is int and v >= 1):
            return v
        raise ValueError("'auto' or a whole number of batches >= 1")


class WandbConfig(_Section):
    enabled: bool = False
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str | None = None
    tags: list[str] = Field(default_factory=list)


class GradientMonitorOptions(Toggle):
    warn_threshold: float = Field(default=1e4, gt=0)


class OverfitOptions(Toggle):
    warmup_epochs: int = Field(default=5, ge=0)
    window_size: int = Field(default=5, ge=1)


class Target(_Section):
    """A class named by its dotted path, built with ``kwargs``: an extra callback, an exact metric
    (update/compute/reset, as torchmetrics'), a named optimizer's scheduler."""

    target: str
    kwargs: dict[str, Any] = Field(default_factory=dict)


class NamedOptimizerConfig(_Section):
    """One of several optimizers: its class, the submodule whose parameters it steps (an attribute
    path of the model, e.g. ``generator`` or ``encoder.head``) and its arguments."""

    target: str = "torch.optim.Adam"
    params: str
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CallbacksConfig(_Section):
    nan_detection: Toggle = Field(default_factory=Toggle)
    optimizer_mode: Toggle = Field(default_factory=Toggle)
    gradient_monitor: GradientMonitorOptions = Field(default_factory=GradientMonitorOptions)
    loss_prediction: Toggle = Field(default_factory=Toggle)
    overfit_detection: OverfitOptions = Field(default_factory=OverfitOptions)
    extra: list[Target] = Field(default_factory=list)


class GradClipConfig(_Section):
    max_norm: float | None = Field(default=None, gt=0)
    max_value: float | None = Field(default=None, gt=0)
    norm_type: float = 2.0

    @model_validator(mode="after")
    def _one_limit(self) -> GradClipConfig:
        if self.max_norm is None and self.max_value is None:
            raise ValueError("set max_norm or max_value (or grad_clip: null to disable clipping)")
        return self


_SCALAR_CHOICE = (type(None), bool, int, float, str)
STUDY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SearchParam(_Section):
    """One hyper-parameter of a study, keyed in ``search_space`` by the config path it sets
    (``optimizer_config.lr``): ``float`` / ``int`` from ``low`` to ``high`` (``log`` or ``step``
    optional), or ``categorical`` over ``choices``."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(default=None, gt=0)
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _complete(self) -> SearchParam:
        # Each message is what was expected; the schema tier adds the path and what was found.
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a non-empty 'choices' list for a categorical parameter")
            if any(not isinstance(c, _SCALAR_CHOICE) for c in self.choices):
                raise ValueError("choices that are null, booleans, numbers or strings (Optuna stores them)")
            if len({repr(c) for c in self.choices}) != len(self.choices):
                raise ValueError("each choice once")
            if self.low is not None or self.high is not None or self.step is not None or self.log:
                raise ValueError("only 'choices' for a categorical parameter (no low, high, step or log)")
            return self
        if self.choices is not None:
            raise ValueError(f"low and high for a {self.type} parameter, not 'choices'")
        if self.low is None or self.high is None:
            raise ValueError(f"both low and high for a {self.type} parameter")
        if self.low > self.high:
            raise ValueError("low <= high")
        if self.log and self.step is not None:
            raise ValueError("log or step, not both (Optuna samples a log range without steps)")
        if self.type == "int":
            if any(v is not None and float(v) != int(v) for v in (self.low, self.high, self.step)):
                raise ValueError("whole numbers for low, high and step of an int parameter")
            if self.log and self.low < 1:
                raise ValueError("low >= 1 for a log-scale int parameter")
        elif self.log and self.low <= 0:
            raise ValueError("low > 0 for a log-scale float parameter")
        return self

    def probe_values(self) -> list[Any]:
        """Values that must all make a valid config: both ends of a range, or every choice."""
        if self.type == "categorical":
            return list(self.choices or [])
        ends = [self.low, self.high]
        return [int(v) for v in ends if v is not None] if self.type == "int" else ends


class OptimizeConfig(_Section):
    """The ``optimize:`` section read by ``fsmtrain hpo`` (``fsmtrain train`` trains the config once)."""

    study_name: str | None = None
    storage: str | None = None
    n_trials: int = Field(default=20, ge=1)
    timeout: float | None = Field(default=None, gt=0)
    direction: Literal["minimize", "maximize"] = "minimize"
    sampler: str = "optuna.samplers.TPESampler"
    sampler_config: dict[str, Any] = Field(default_factory=dict)
    pruner: str = "optuna.pruners.MedianPruner"
    pruner_config: dict[str, Any] = Field(default_factory=dict)
    search_space: dict[str, SearchParam] = Field(default_factory=dict)
    # a trial averages the run objective over the first n_seeds of `seeds` (default: all of them)
    n_seeds: int | None = Field(default=None, ge=1)
    # RDB storages: a trial silent for grace_period seconds is failed and retried, at most max_retry times
    heartbeat_interval: int = Field(default=60, ge=1)
    grace_period: int | None = Field(default=None, ge=1)
    max_retry: int = Field(default=3, ge=0)

    @field_validator("study_name")
    @classmethod
    def _study_name(cls, v: str | None) -> str | None:
        if v is not None and not STUDY_NAME_RE.match(v):
            raise ValueError("a study name that is one folder name: letters, digits, '.', '_', '-'")
        return v


_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")
# What torch.manual_seed (and the loaders' torch.Generator) accepts: a signed or unsigned 64-bit number
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class FsdpPrecisionConfig(_Section):
    param_dtype: Literal["bf16", "fp16", "fp32"] | None = None  # None: the parameters' own
    reduce_dtype: Literal["bf16", "fp16", "fp32"] | None = None


class FsdpConfig(_Section):
    """``distributed.fsdp``: FSDP2 sharding (with ``strategy: fsdp``)."""

    shard: Literal["auto"] | list[str] = "auto"  # auto: each child holding >= 10% of the parameters; or class names
    reshard_after_forward: bool = True
    mixed_precision: FsdpPrecisionConfig = Field(default_factory=FsdpPrecisionConfig)
    cpu_offload: bool = False


class DistributedConfig(_Section):
    """Multi-process runs (``torchrun`` or ``fsmtrain train --nproc N``); one process ignores it."""

    strategy: Literal["ddp", "fsdp"] = "ddp"  # fsdp: parameters, gradients and optimizer state sharded (FSDP2)
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)

    backend: Literal["gloo", "nccl"] | None = None  # default: gloo on CPU, nccl on CUDA
    timeout_s: float = Field(default=1800.0, gt=0)  # how long a collective waits for a slow rank
    # How long a rank waits at an agreement point for the others; a rank that failed is noticed at once.
    agreement_timeout_s: float = Field(default=600.0, gt=0)


class RunConfig(_Section):
    project: str = Field(default="fsmtrain", min_length=1)
    name: str | None = None
    device: str = "cpu"
    seeds: list[int] = Field(default_factory=lambda: [0])
    net: str
    net_config: dict[str, Any] = Field(default_factory=dict)
    optimizer: str = "torch.optim.Adam"
    optimizer_config: dict[str, Any] = Field(default_factory=dict)
    scheduler: str | None = None
    scheduler_config: dict[str, Any] = Field(default_factory=dict)
    optimizers: dict[str, NamedOptimizerConfig] | None = None  # several, by name (in place of optimizer)
    schedulers: dict[str, Target] = Field(default_factory=dict)  # by the name of the optimizer each schedules
    criterion: str = "torch.nn.MSELoss"
    criterion_config: dict[str, Any] = Field(default_factory=dict)
    data: str
    data_config: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, str | Target] = Field(default_factory=dict)
    step: str | None = None  # the user's fn(model, batch) -> loss or {loss, ...}; default loss_fn(model(x), y)
    val_step: str | None = None  # the same for validation; default: step
    epochs: int | None = Field(default=None, gt=0)  # None: only max_steps ends the run
    max_steps: int | None = Field(default=None, gt=0)  # the run ends at this global step (or its epochs' end)
    val_every_n_steps: int | None = Field(default=None, gt=0)  # validation also after every N-th global step
    batch_size: int = Field(gt=0)
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    # event files in <run dir>/tensorboard (needs the tensorboard extra)
    tensorboard: Toggle = Field(default_factory=lambda: Toggle(enabled=False))
    callbacks: CallbacksConfig = Field(default_factory=CallbacksConfig)
    grad_clip: GradClipConfig | None = None
    grad_accumulation: int = Field(default=1, ge=1)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_every_n_steps: int | None = Field(default=None, gt=0)  # a train_step event every N global steps
    log: LogConfig = Field(default_factory=LogConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    # small models on shared CPUs run much faster single-threaded (no spinning intra-op workers)
    num_threads: int | None = Field(default=None, ge=1)
    optimize: OptimizeConfig | None = None
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    precision: Literal["32", "bf16-mixed", "16-mixed"] = "32"  # autocast (and fp16 loss scaling)
    compile: bool = False  # torch.compile the training forward

    _warnings: list[ConfigProblem] = PrivateAttr(default_factory=list)
    _source: str | None = PrivateAttr(default=None)  # the file it was read from
    _overrides: tuple[str, ...] = PrivateAttr(default=())  # the --set items applied to it

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set epochs or max_steps (or both: whichever is reached first ends the run)")
        if self.optimizers is None:
            if self.schedulers:
                raise ValueError("schedulers by name go with optimizers by name (optimizers: {name: ...}); one "
                                 "optimizer's scheduler is scheduler")
            return self
        # the single optimizer's fields, unless they hold the defaults (as a resolved config does)
        single = [k for k in ("optimizer", "optimizer_config", "scheduler", "scheduler_config")
                  if getattr(self, k) != RunConfig.model_fields[k].get_default(call_default_factory=True)]
        if single:
            raise ValueError(f"optimizers or {' and '.join(single)}, not both (a scheduler of several optimizers goes "
                             "in schedulers, by the optimizer's name)")
        if not self.optimizers:
            raise ValueError("at least one optimizer in optimizers")
        return self

    @property
    def max_epochs(self) -> int:
        return self.epochs if self.epochs is not None else UNBOUNDED_EPOCHS

    def source_of(self, path: str) -> str | None:
        """``--set <item>`` if an override wrote the value at ``path``, else the file."""
        item = override_of(path, self._overrides)
        return f"--set {item}" if item is not None else self._source

    @property
    def source(self) -> str | None:
        return self._source

    def error(self, problems: list[ConfigProblem]) -> ConfigError:
        """A ConfigError from where the value at fault came (``--set`` or the file), for a single problem."""
        return ConfigError(problems, self.source_of(problems[0].path) if len(problems) == 1 else self.source)

    def __eq__(self, other: object) -> bool:
        """Equal settings (where they were read from is not part of a config's value)."""
        return isinstance(other, RunConfig) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]

    @property
    def warnings(self) -> list[ConfigProblem]:
        """Semantic-tier findings: legal, but probably not what was meant."""
        return list(self._warnings)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, v: Any) -> Any:
        return "32" if v == 32 and type(v) is int else v  # `precision: 32` in YAML is a number

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("a non-empty list of seeds")
        outside = [s for s in v if not SEED_MIN <= s <= SEED_MAX]
        if outside:
            raise ValueError(f"seeds from -2**63 to 2**64-1 (what torch.manual_seed accepts); "
                             f"{', '.join(map(str, outside))} outside that range")
        dupes = sorted({s for s in v if v.count(s) > 1})
        if dupes:
            raise ValueError(f"unique seeds; {dupes} repeated")
        return v

    @field_validator("metrics")
    @classmethod
    def _metric_names(cls, v: dict[str, str | Target]) -> dict[str, str | Target]:
        taken = sorted(BUILTIN_METRICS & set(v))
        if taken:
            raise ValueError(f"metric names other than {', '.join(sorted(BUILTIN_METRICS))} (fsmtrain computes "
                             f"those itself); {', '.join(taken)} would replace fsmtrain's own")
        return v

    @field_validator("project", "name")
    @classmethod
    def _one_path_component(cls, v: str | None) -> str | None:
        if v is not None and (v in (".", "..") or "/" in v or "\\" in v or "\x00" in v):
            raise ValueError(f"a single folder name (no '/', '\\', '.' or '..'), got {v!r}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not _DEVICE_RE.match(v):
            raise ValueError("one of cpu, cuda, cuda:N, mps")
        return v


def resolved_dict(cfg: RunConfig) -> dict[str, Any]:
    """Every field with defaults filled in, JSON/YAML-safe: what a run's ``config.yaml`` holds."""
    return cfg.model_dump(mode="json")
