"""The ranks' per-batch signal rounds (``RankAgreement.poll_signal``): every rank holds each round at the same
batch, whatever its own clock says; auto spaces the rounds by the ranks' widest proposal from their
measured batch time; a signal
on one rank stops every rank after the same batch, within two spacings.

The two ranks run in one process, batch by batch in turn, over a test double of the one collective call the
rounds make (a max over the ranks, started without blocking and read later): the real gloo round runs in
``test_steps_preemption.py`` and ``test_steps2_two_ranks.py``, with real processes and real signals. The spacing
is ``preemption.rounds_every`` (``auto`` or a whole number), refused with the field named where it is wrong."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from fsmtrain import Trainer
from fsmtrain.app.config import ConfigError, load_config
from fsmtrain.core.consensus import (
    FIRST_ROUNDS_EVERY,
    MAX_ROUNDS_EVERY,
    ROUND_SPACING_S,
    RankAgreement,
    rounds_every_for,
)
from fsmtrain.core.context import RunContext
from fsmtrain.core.events import EventLog

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


class _Rounds:
    """Two ranks' rounds in order: the n-th call of each rank joins the n-th round; a read before every rank
    has sent its part of that round is a rank out of step, and fails."""

    def __init__(self) -> None:
        self.sent: list[dict[int, list[int]]] = []

    def send(self, rank: int, values: Sequence[int]) -> Callable[[], list[int]]:
        index = sum(rank in r for r in self.sent)
        if index == len(self.sent):
            self.sent.append({})
        self.sent[index][rank] = list(values)

        def read() -> list[int]:
            parts = self.sent[index]
            assert len(parts) == 2, f"rank {rank} read round {index} before every rank sent it"
            return [max(col) for col in zip(*parts.values(), strict=True)]
        return read


class _Rank:
    def __init__(self, rounds: _Rounds, rank: int) -> None:
        self.rank, self.world_size = rank, 2
        self.all_reduce_max_async = lambda values: rounds.send(rank, values)


def _ranks(rounds_every: int | None, seconds_per_batch: tuple[float, float]) -> tuple[list[RankAgreement],
                                                                                         list[float]]:
    rounds, now = _Rounds(), [0.0, 0.0]
    agreements = []
    for rank in (0, 1):
        run = RunContext(f"r{rank}", 1, EventLog(None, f"r{rank}", console=None, keep=True))
        agreements.append(RankAgreement(_Rank(rounds, rank), run, per_batch=False,  # type: ignore[arg-type]
                                        rounds_every=rounds_every, clock=functools.partial(now.__getitem__, rank)))
    return agreements, now


def _batches(agreements: list[RankAgreement], now: list[float], per_batch: tuple[float, float],
             signal_at: int | None = None) -> tuple[list[int], int | None]:
    """Poll both ranks before each batch until both have agreed a signal (or 4,000 batches); the batches
    where a round was held (the same on both ranks), and the batch both stopped before."""
    held: list[int] = []
    for batch in itertools.count(1):
        if batch == signal_at:
            agreements[1].run.pending_signal = 15  # SIGTERM, on rank 1 only
        lefts = []
        for rank, agreement in enumerate(agreements):
            agreement.poll_signal()
            lefts.append(agreement._left)
            now[rank] += per_batch[rank]
        assert lefts[0] == lefts[1], f"the ranks are out of step at batch {batch}: {lefts}"
        if lefts[0] == agreements[0].every:
            held.append(batch)
        signals = [a.signal for a in agreements]
        assert signals[0] == signals[1], f"one rank agreed a signal the other did not, at batch {batch}"
        if signals[0] is not None:
            assert signals[0] == (15, 1)
            return held, batch
        if batch == 4000:
            return held, None
    raise AssertionError("unreachable")


def test_auto_takes_the_widest_proposal_and_both_ranks_hold_each_round_at_the_same_batch() -> None:
    # Each rank proposes ROUND_SPACING_S of its own batches; the ranks take the widest, so no rank's rounds cost more
    # than the bound (in DDP the ranks run in step and measure the same batch time).
    per_batch = (ROUND_SPACING_S / 100, ROUND_SPACING_S / 25)
    agreements, now = _ranks(None, per_batch)
    held, stopped = _batches(agreements, now, per_batch)
    assert stopped is None
    assert held[:2] == [FIRST_ROUNDS_EVERY, 2 * FIRST_ROUNDS_EVERY], "two rounds before any batch time is known"
    assert rounds_every_for(per_batch[0]) == 100 and rounds_every_for(per_batch[1]) == 25
    steady = [b - a for a, b in itertools.pairwise(held[2:])]
    assert len(steady) > 30 and set(steady) == {100}, steady


@pytest.mark.parametrize(("rounds_every", "per_batch"), [
    (None, (0.002, 0.002)), (None, (0.05, 0.3)), (None, (1e-5, 1e-5)), (8, (0.002, 0.002)), (3, (0.5, 0.5)),
])
@pytest.mark.parametrize("signal_at", [1, 7, 8, 9, 70, 301, 1001])
def test_a_signal_on_one_rank_is_agreed_by_both_before_the_same_batch_within_two_spacings(
        rounds_every: int | None, per_batch: tuple[float, float], signal_at: int) -> None:
    agreements, now = _ranks(rounds_every, per_batch)
    held, stopped = _batches(agreements, now, per_batch, signal_at)
    assert stopped is not None
    bound = 2 * (rounds_every or MAX_ROUNDS_EVERY)
    assert signal_at < stopped <= signal_at + bound
    before, after = max((b for b in held if b < signal_at), default=0), stopped
    assert after in held, "a signal is read at a round"
    assert len([b for b in held if before < b <= after]) <= 2, "sent at the next round, read at the one after"
    if rounds_every is not None:
        assert all(b % rounds_every == 0 for b in held), "a fixed spacing holds a round every that many batches"


def test_auto_spacing_is_about_the_round_spacing_of_training_within_its_limits() -> None:
    assert rounds_every_for(ROUND_SPACING_S) == 1
    assert rounds_every_for(5.0) == 1  # a long step: a round every batch
    assert rounds_every_for(ROUND_SPACING_S / 10) == 10
    assert rounds_every_for(0.003) == round(ROUND_SPACING_S / 0.003)  # the quickstart's step on 2 CPU ranks
    assert rounds_every_for(1e-6) == MAX_ROUNDS_EVERY
    assert rounds_every_for(0.0) == MAX_ROUNDS_EVERY


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("8", 8), ("1", 1)])
def test_the_spacing_is_a_config_setting(value: str, expected: object) -> None:
    assert load_config(QUICKSTART, [f"preemption.rounds_every={value}"]).preemption.rounds_every == expected


@pytest.mark.parametrize("value", ["0", "often", "2.5", "true", "-3"])
def test_a_bad_spacing_is_refused_naming_the_field_the_rule_and_the_value(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(QUICKSTART, [f"preemption.rounds_every={value}"])
    said = str(info.value)
    assert "preemption.rounds_every: expected 'auto' or a whole number of batches >= 1; found" in said, said
    config = tmp_path / "config.yaml"  # and from the command, with no traceback
    config.write_text(QUICKSTART.read_text() + f"\npreemption:\n  rounds_every: {value}\n")
    done = subprocess.run([sys.executable, "-m", "fsmtrain", "validate", str(config)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "preemption.rounds_every: expected" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(ValueError, match="preemption_rounds_every must be an integer >= 1 or None, got 0"):
        model = nn.Linear(1, 1)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), [(torch.ones(1, 1),) * 2],
                preemption_rounds_every=0)
