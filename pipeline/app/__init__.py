"""What a user runs: the ``Trainer`` facade, run configs, one seed's job and HPO studies."""
