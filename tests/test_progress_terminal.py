"""On a terminal, `fsmtrain train` keeps one line per epoch on screen above its live progress bar."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")


def render(stream: bytes) -> list[str]:
    """The screen a terminal shows after ``stream``: handles text, \\r, \\n, cursor up/down, erase in
    line, colours and cursor hiding; any other escape sequence fails the test rather than be ignored."""
    screen: list[list[str]] = [[]]
    row = col = 0
    text = stream.decode("utf-8")
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\x1b":
            m = CSI.match(text, i)
            assert m is not None, f"unexpected escape at {text[i:i + 20]!r}"
            params, final = m.group(1), m.group(2)
            n = int(params) if params.isdigit() else 1
            if final == "A":
                row = max(0, row - n)
            elif final == "B":
                row += n
            elif final == "K":
                line = screen[row]
                mode = int(params or "0")
                screen[row] = [] if mode == 2 else line[:col] if mode == 0 else [" "] * col + line[col:]
            elif not (final == "m" or (params == "?25" and final in "lh")):
                raise AssertionError(f"unhandled escape sequence {m.group(0)!r}")
            i = m.end()
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
        else:
            line = screen[row]
            line.extend(" " * (col - len(line)))
            line[col:col + 1] = [ch]
            col += 1
        while len(screen) <= row:
            screen.append([])
        i += 1
    return ["".join(line).rstrip() for line in screen]


def run_on_terminal(cwd: Path, *args: str) -> tuple[int, bytes]:
    """Run ``python ARGS`` with a pseudo-terminal as its stdin, stdout and stderr; all the bytes it wrote."""
    main_fd, child_fd = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(WANDB_MODE="offline", TERM="xterm", COLUMNS="120", LINES="40")
    proc = subprocess.Popen([sys.executable, *args], stdin=child_fd, stdout=child_fd,
                            stderr=child_fd, cwd=cwd, env=env, close_fds=True)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    return proc.wait(timeout=60), b"".join(chunks)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_epoch_line_stays_above_the_live_bar(tmp_path: Path) -> None:
    epochs = 4
    rc, stream = run_on_terminal(tmp_path, "-m", "fsmtrain", "train", str(QUICKSTART), "--set", f"epochs={epochs}",
                                 "--set", f"scheduler_config.T_max={epochs}", "--set", "early_stopping.patience=2",
                                 "--set", "wandb.enabled=false")
    assert rc == 0, stream.decode(errors="replace")
    assert b"\x1b[" in stream  # a live display really ran, redrawing in place
    screen = render(stream)
    shown = "\n".join(screen)
    header = next((i for i, line in enumerate(screen) if line.split()[:3] == ["epoch", "train", "val"]), None)
    assert header is not None, shown
    rows = [line for line in screen[header + 1:] if re.match(rf"\d+/{epochs}\s+\d", line)]
    assert [row.split()[0] for row in rows] == [f"{k}/{epochs}" for k in range(1, epochs + 1)], shown
    bar = next(i for i, line in enumerate(screen) if line.startswith("epochs "))
    assert bar > screen.index(rows[-1]), shown  # the bar is drawn below the history
    assert "exit code 0 (OK)" in shown


WARNS_MID_RUN = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fsmtrain import Trainer, TrainingCallback


class WarnAtEpoch2(TrainingCallback):
    def on_epoch_end(self, epoch):
        if epoch.index == 1:
            epoch.warn("test", "a warning while the bar is live")


torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(256, 4), torch.randn(256, 1)), batch_size=8)
model = nn.Linear(4, 1)
Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), data, data, max_epochs=4,
        callbacks=[WarnAtEpoch2()]).fit()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_console_warning_prints_above_the_live_bar(tmp_path: Path) -> None:
    """The run's console (warnings) prints above the bar too: it neither vanishes under a redraw
    nor leaves a stale copy of the bar in the history."""
    (tmp_path / "warns.py").write_text(WARNS_MID_RUN)
    rc, stream = run_on_terminal(tmp_path, "warns.py")
    assert rc == 0, stream.decode(errors="replace")
    screen = render(stream)
    shown = "\n".join(screen)
    warning = next((i for i, line in enumerate(screen) if "a warning while the bar is live" in line), None)
    assert warning is not None, shown
    rows = [i for i, line in enumerate(screen) if re.match(r"\d/4\s+\d", line)]
    assert len(rows) == 4 and rows[0] < warning < rows[2], shown  # printed in epoch 2, in order
    assert [line.startswith("epochs ") for line in screen].count(True) == 1, shown  # no stale bar
