"""Hyper-parameter search (``fsmtrain hpo``): each trial one ordinary run per seed."""
