"""What you run on what runs left behind: audit, replay, diagrams (and the pytest plugin).

Modules are imported by name (``fsmtrain.tools.audit``); this package imports none of them, so
``fsmtrain audit`` does not pay for replay's torch."""
