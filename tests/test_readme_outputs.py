"""The README's shown command outputs are what the commands print.

Every shown output is a block that ``benchmarks/readme_outputs.py`` makes by running its commands
(a hand-copied output drifts: a replay's verdict, a sweep table, a val loss, a file the README runs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import readme_outputs as outputs  # noqa: E402  (a script of benchmarks/, not a package)

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_every_shown_command_output_is_a_generated_block() -> None:
    blocks = outputs.shown(README)
    assert set(blocks) == {b.name for b in outputs.BLOCKS}
    assert all(body.startswith("$ fsmtrain ") for body in blocks.values())
    # a transcript outside the markers would be a shown output no run checks
    outside = outputs._START.sub("", README)
    fenced = re.findall(r"^```[a-z]*\n(.*?)^```", outside, re.S | re.M)
    assert not [f for f in fenced if f.startswith("$ ")], "a command transcript outside <!-- output: --> markers"
    assert (REPO / "configs" / "study.yaml").is_file() and "fsmtrain hpo configs/study.yaml" in README


def test_the_check_sees_a_changed_number_and_not_a_changed_duration() -> None:
    blocks = outputs.shown(README)
    assert outputs.stale(README, blocks) == {}
    replay = blocks["replay"]
    loss = re.search(r"\b0\.\d{5,}\b", replay).group(0)  # type: ignore[union-attr]
    changed = outputs.stale(README, {"replay": replay.replace(loss, loss[:-1] + str((int(loss[-1]) + 1) % 10))})
    assert set(changed) == {"replay"}
    hpo = blocks["hpo"]
    duration = re.search(r"\((\d+\.\d) s\)", hpo).group(1)  # type: ignore[union-attr]
    assert outputs.stale(README, {"hpo": hpo.replace(f"({duration} s)", "(99.9 s)", 1)}) == {}
    # a writer that fell behind on a busy machine is not a stale output
    skipped = ("[warning  ] checkpoint_skipped             epoch=5 reason='the state of epoch 7 replaced it while it "
               "waited behind the write of epoch 5 (a slow disk: the newest state is written)'\n")
    first_trial = hpo.index("trial 0 ")
    assert outputs.stale(README, {"hpo": hpo[:first_trial] + skipped + hpo[first_trial:]}) == {}
    assert set(outputs.stale(README, {"hpo": hpo[:first_trial] + skipped.replace("checkpoint_skipped", "checkpoint")
                                      + hpo[first_trial:]})) == {"hpo"}
    # a commit logged a line earlier, before the next epoch's train_step line (on a busy machine)
    tampered = blocks["audit-tampered"]
    earlier = re.sub(r"line (\d+) \[checkpoint\]", lambda m: f"line {int(m[1]) - 1} [checkpoint]", tampered)
    assert earlier != tampered and outputs.stale(README, {"audit-tampered": earlier}) == {}
    assert set(outputs.stale(README, {"audit-tampered": tampered.replace("line 18 [ts]", "line 17 [ts]")})) == {
        "audit-tampered"}
    audit = blocks["audit"]
    lines = re.search(r"OK, (\d+) lines", audit).group(1)  # type: ignore[union-attr]
    assert set(outputs.stale(README, {"audit": audit.replace(f"{lines} lines", f"{int(lines) + 1} lines")})) == {
        "audit"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_blocks_are_what_a_fresh_run_prints(tmp_path: Path) -> None:
    fresh = outputs.generate(tmp_path)
    diffs = outputs.stale(README, fresh)
    assert not diffs, "stale README blocks (python benchmarks/readme_outputs.py --write):\n" + "\n".join(
        diffs.values())
