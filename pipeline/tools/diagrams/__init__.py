"""Lifecycle diagrams on the command line (``fsmtrain diagram``); the drawing is :mod:`fsmtrain.core.drawing`."""
