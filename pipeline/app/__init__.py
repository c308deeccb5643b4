"""What a user runs: the ``Trainer`` facade, run configs (YAML) and one seed's job."""

from pipeline.app.trainer import Trainer

__all__ = ["Trainer"]
