"""``python -m fsmtrain``: the fsmtrain command line."""

from fsmtrain.cli import main

raise SystemExit(main())
