"""What you run on what runs left behind: audit, replay, report, diagrams, and the pytest plugin.
This package imports none of them, so each command pays only for its own imports."""
