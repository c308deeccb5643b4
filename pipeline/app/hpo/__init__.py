"""Hyper-parameter search (``fsmtrain hpo``): the Optuna study a config's ``optimize:`` section
describes, each trial one ordinary run per seed."""
