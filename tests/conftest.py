"""Suite-wide settings: W&B never reaches the network, and tests train on one thread."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(1)
