"""``python -m pipeline``: the fsmtrain command line."""

from pipeline.cli import main

raise SystemExit(main())
