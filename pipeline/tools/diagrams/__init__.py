"""Lifecycle diagrams (``fsmtrain diagram``): the table, a config's callbacks on it, or one run's path.

The drawing itself is :mod:`fsmtrain.core.drawing`, below every layer that writes a diagram: a run
writes its own ``lifecycle.mmd`` at its end, and the run (``fsmtrain.app``) may not import tools.
This package is the command (``cli``) and the callbacks a config puts on the diagram.
"""

from fsmtrain.tools.diagrams.cli import config_callbacks

__all__ = ["config_callbacks"]
