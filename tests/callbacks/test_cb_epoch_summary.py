import io
import math

import pytest

from fsmtrain import Slot, StopReason, TrainingCallback
from fsmtrain.callbacks import EpochSummaryCallback, GradientMonitorCallback, LossPredictionCallback


def table(text):
    """The console table as ``[(epoch label, {column: cell})]``, checking that each row lines up
    under the header printed before it and that legends come right before a header."""
    rows, header, lines = [], None, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("columns: "):
            assert lines[i + 1].startswith("epoch ")
            continue
        if line.startswith("epoch "):
            header = line
            continue
        assert header is not None and len(line) == len(header), (header, line)
        labels, cells = header.split(), line.split()
        assert len(labels) == len(cells)
        # right-aligned: every cell ends where its label ends
        ends = [header.index(label) + len(label) for label in labels[1:]]
        assert [line.index(c, e - len(c)) + len(c) for c, e in zip(cells[1:], ends, strict=True)] == ends
        rows.append((cells[0], dict(zip(labels[1:], cells[1:], strict=True))))
    return rows


def test_every_n_epochs_and_last_with_header_and_legend(scripted):
    stream = io.StringIO()
    scripted([EpochSummaryCallback(every_n_epochs=3, stream=stream)], [1.0, 0.9, 0.8, 0.7, 0.6],
             [1.1, 1.0, 0.9, 0.8, 0.7])
    text = stream.getvalue()
    lines = text.splitlines()
    assert lines[0] == "columns: train = train loss, val = validation loss, lr = learning rate"
    assert lines[1].split() == ["epoch", "train", "val", "lr"]
    assert len(lines) == 4  # legend and header once, then epochs 3 and 5
    assert table(text) == [("3/5", {"train": "0.8", "val": "0.9", "lr": "1.00e-01"}),
                           ("5/5", {"train": "0.6", "val": "0.7", "lr": "1.00e-01"})]


def test_grad_norm_prediction_and_new_columns_reprint_the_header(scripted):
    class FakeGrad(TrainingCallback):  # a stand-in writer of the slot (the real one needs a model)
        priority = GradientMonitorCallback.priority
        writes = GradientMonitorCallback.writes

        def on_epoch_end(self, epoch):
            epoch.set(self.writes[0], 2.5)

    stream = io.StringIO()
    val = [math.exp(-0.1 * t) for t in range(12)]
    summary = EpochSummaryCallback(every_n_epochs=10, stream=stream)
    scripted([FakeGrad(), LossPredictionCallback(max_epochs=21), summary], [1.0] * 12, val, max_epochs=12)
    text = stream.getvalue()
    rows = table(text)
    # epoch index 9 (row "10/12") has no prediction yet; index 11 (the last) has one
    assert rows[0] == ("10/12", {"train": "1", "val": f"{val[9]:.4g}", "lr": "1.00e-01", "grad": "2.5"})
    assert rows[1] == ("12/12", {"train": "1", "val": f"{val[11]:.4g}", "lr": "1.00e-01", "grad": "2.5",
                                 "pred": f"{math.exp(-2.0):.4g}"})
    legends = [line for line in text.splitlines() if line.startswith("columns: ")]
    assert legends == ["columns: train = train loss, val = validation loss, lr = learning rate, "
                       "grad = max gradient norm", "columns: pred = predicted final val loss"]


def test_every_metric_and_numeric_slot_gets_a_column(scripted):
    mine: Slot[float] = Slot("my_metric")

    class Mine(TrainingCallback):
        writes = (mine,)

        def on_val_end(self, epoch):
            epoch.set(mine, 10.0 * epoch.index)

    stream = io.StringIO()
    scripted([Mine(), EpochSummaryCallback(stream=stream)], [1.0, 0.5], [1.0, 0.5],
             extra=[{"val_accuracy": 0.25}, {"val_accuracy": 0.75}])
    rows = table(stream.getvalue())
    assert [r[1]["val_accuracy"] for r in rows] == ["0.25", "0.75"]
    assert [r[1]["my_metric"] for r in rows] == ["0", "10"]


def test_an_absent_value_shows_a_dash(scripted):
    flag: Slot[float] = Slot("sometimes")

    class Sometimes(TrainingCallback):
        writes = (flag,)

        def on_val_end(self, epoch):
            if epoch.index == 0:
                epoch.set(flag, 1.5)

    stream = io.StringIO()
    scripted([Sometimes(), EpochSummaryCallback(stream=stream)], [1.0, 0.5], [1.0, 0.5])
    assert [r[1]["sometimes"] for r in table(stream.getvalue())] == ["1.5", "-"]


def test_stop_prints_the_last_epoch(scripted):
    class Stop(TrainingCallback):
        def on_val_end(self, epoch):
            if epoch.index == 1:
                epoch.request_stop(StopReason.EARLY_STOP, "test")

    stream = io.StringIO()
    scripted([Stop(), EpochSummaryCallback(every_n_epochs=10, stream=stream)], [1.0] * 5, [1.0] * 5)
    assert [r[0] for r in table(stream.getvalue())] == ["2/5"]


def test_nan_shown(scripted):
    stream = io.StringIO()
    scripted([EpochSummaryCallback(stream=stream)], [math.nan], [math.inf])
    assert table(stream.getvalue())[0][1] | {"lr": ""} == {"train": "nan", "val": "inf", "lr": ""}


def test_default_stream_is_stdout_at_call_time(scripted, capsys):
    scripted([EpochSummaryCallback()], [1.0], [1.0])
    assert table(capsys.readouterr().out)[0][0] == "1/1"


def test_each_run_prints_its_own_header(scripted):
    stream = io.StringIO()
    summary = EpochSummaryCallback(stream=stream)
    scripted([summary], [1.0], [1.0])
    scripted([summary], [1.0], [1.0])
    assert sum(line.startswith("epoch ") for line in stream.getvalue().splitlines()) == 2


def test_bad_every():
    with pytest.raises(ValueError, match="every_n_epochs"):
        EpochSummaryCallback(every_n_epochs=0)
