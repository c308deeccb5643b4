"""``fsmtrain init``: the commented starter config, and where it may be written."""

from __future__ import annotations

from pathlib import Path

__all__ = ["STARTER_CONFIG", "init_problem"]

STARTER_CONFIG = """\
# fsmtrain run config. Check it with `fsmtrain validate fsmtrain.yaml`, train with
# `fsmtrain train fsmtrain.yaml`. Classes and functions are named by dotted import path, with
# their keyword arguments in the matching *_config mapping.
project: my-project            # runs go to runs/<project>/<name>-seed<seed>/
name: baseline                 # run name (default: the config file's name)
device: cpu                    # cpu | cuda | cuda:N | mps
seeds: [0]                     # one run per seed; the summary reports the mean objective

data: fsmtrain.training.data.synthetic_regression   # builder(batch_size=, seed=, **data_config) -> (train, val)
data_config:
  n_samples: 2048
  n_features: 8

net: fsmtrain.training.models.MLP       # any torch.nn.Module subclass
net_config:
  in_features: 8
  out_features: 1
  hidden: [64, 64]

optimizer: torch.optim.Adam    # torch.optim.* or pytorch_optimizer.* (e.g. pytorch_optimizer.SPlus)
optimizer_config:
  lr: 1e-3

scheduler: null                # e.g. torch.optim.lr_scheduler.CosineAnnealingLR with T_max: <epochs>
scheduler_config: {}

criterion: torch.nn.MSELoss    # an nn.Module loss class or a function (output, target) -> tensor
criterion_config: {}

metrics: {}                    # extra validation metrics, e.g. val_accuracy: fsmtrain.training.models.accuracy

epochs: 20
batch_size: 64

early_stopping:                # stop after `patience` epochs without a relative improvement of min_delta
  enabled: true
  patience: 5
  mode: min
  min_delta: 1e-4
  monitor: val_loss

checkpoint:                    # saved under <run dir>/checkpoints/
  enabled: true
  save_every_n_epochs: 1
  keep_last_k: 3
  save_best: true
  monitor: val_loss
  mode: min

wandb:                         # offline runs land in <run dir>/wandb/
  enabled: false
  mode: offline
  project: null                # default: project
  tags: []

callbacks:                     # options of the built-ins, and your own callbacks
  gradient_monitor: {enabled: true, warn_threshold: 1e4}
  overfit_detection: {enabled: true, warmup_epochs: 5, window_size: 5}
  loss_prediction: {enabled: true}
  extra: []                    # e.g. [{target: mypkg.MyCallback, kwargs: {every: 2}}]

grad_clip: null                # e.g. {max_norm: 1.0}
grad_accumulation: 1           # optimizer step every N batches
log_level: info                # events.jsonl detail: debug adds per-batch lines
log:
  fsync: commits               # fsync events.jsonl at each checkpoint commit and the result (every | never)
num_threads: 1                 # torch CPU threads (null: torch's default); 1 is fastest for small models
"""


def init_problem(directory: Path, name: str, force: bool) -> str | None:
    """Why ``fsmtrain init DIR --name NAME`` cannot write DIR/NAME (None: it can), checked before any write."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        found = "an empty name" if name == "" else "a folder" if name in (".", "..") else "a path"
        hint = ""
        if "/" in name and not name.startswith("/") and not name.endswith("/") and ".." not in Path(name).parts:
            inner = Path(name)
            hint = f"; to write {directory / inner}, run: fsmtrain init {directory / inner.parent} --name {inner.name}"
        return f"--name: expected a plain file name (the config is written inside DIR, {directory}); found {name!r} " \
               f"({found}){hint}"
    target = directory / name
    for parent in (directory, *directory.parents):
        if parent.exists() and not parent.is_dir():
            found = "a file" if parent == directory else f"{parent}, a file"
            return f"DIR {directory}: expected a folder to write {name} into; found {found}"
    if target.is_dir():
        return f"--name: expected a file name; found {target}, a folder"
    if target.exists() and not force:
        return f"{target} exists; use --force to overwrite"
    return None
