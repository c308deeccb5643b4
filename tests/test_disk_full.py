"""A full disk is a named error in the phase it happened, with a log of whole lines that ends the
run properly: no third-party traceback on the console, no torn line for a
resume to repair, and an audit that does not take it for a killed process."""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from resume_harness import REPO, env, forked, same_weights

from fsmtrain.core.events import read_events
from fsmtrain.tools.audit import audit_file
from fsmtrain.training.checkpoint import CheckpointWriteError, load_checkpoint
from fsmtrain.training.checkpoint_file import check_free_space
from fsmtrain.training.checkpoint_writer import tensor_bytes

QUICK = REPO / "configs" / "quickstart.yaml"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 20 MB tmpfs (mounting needs root: the test is skipped, saying so, where it cannot)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: a real small file system cannot be made")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a 20 MB tmpfs here (mount needs root): {made.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_disk_ends_the_run_named_in_its_epoch_and_resume_needs_no_repair(small_disk: Path,
                                                                                tmp_path: Path) -> None:
    """Found on a 20 MB tmpfs: "ERROR before training: OSError(28…)" after 3 trained epochs, some 60
    lines of W&B traceback, a torn last log line; resume repaired it, and the audit then said "the
    process was killed"."""
    runs = small_disk / "runs"
    filler = {"target": "disk_support.FillDisk",
              "kwargs": {"path": str(small_disk / "filler"), "marker": str(tmp_path / "filled"), "at_epoch": 2}}
    # W&B on (offline), as found; checkpoints written before the epoch ends, so none is in flight
    # when the disk fills at the third epoch's begin.
    sets = ["--set", "epochs=4", "--set", "checkpoint.background=false", "--set", f"callbacks.extra=[{filler}]"]
    proc = forked("train", str(QUICK), "--run-dir", str(runs), *sets, cwd=tmp_path)
    out, err = (b.decode() for b in proc.communicate(timeout=400))
    assert proc.returncode == 1, out + err
    run = runs / "mlp-regression-seed0"
    events = read_events(run / "events.jsonl")
    assert (f"seed 0: ERROR in epoch 3: no space left writing events.jsonl (device tmpfs (tmpfs) mounted at "
            f"{small_disk}, 0 of 20971520 bytes free)") in out, out
    failed = next(e for e in events if e["event"] == "exception")
    assert failed["payload"]["type"] == "LogWriteError" and failed["payload"]["source"] == \
        "FillDisk.on_train_epoch_begin"
    assert [e["event"] for e in events].count("disk_filled") == 1  # the line that found the disk full is whole
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    raw = (run / "events.jsonl").read_bytes()
    assert raw.endswith(b"\n")  # every line whole
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "error"
    assert "LogWriteError" in events[-1]["payload"]["stop_message"]
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)

    (small_disk / "filler").unlink()  # space again
    proc = forked("resume", str(run), cwd=tmp_path)
    out, err = (b.decode() for b in proc.communicate(timeout=400))
    assert proc.returncode == 0, out + err
    resumed = [e for e in read_events(run / "events.jsonl") if e["event"] == "resume"]
    assert resumed and resumed[-1]["payload"]["torn_line_bytes"] == 0  # nothing to repair
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)
    assert "killed" not in report.render(False)



def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]


_SETS = ["--set", "epochs=5", "--set", "wandb.enabled=false"]  # W&B's files would share the small disk


@pytest.fixture(scope="module")
def never_failed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that never failed, on a roomy disk: the weights to reach, and the sizes to fill around
    (whether its checkpoints were written in the background changes neither)."""
    folder = tmp_path_factory.mktemp("reference")
    proc = forked("train", str(QUICK), "--run-dir", str(folder), *_SETS, cwd=folder)
    out, err = (b.decode() for b in proc.communicate(timeout=400))
    assert proc.returncode == 0, out + err
    return folder / "mlp-regression-seed0"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("background", "begun"), [(True, False), (False, True)])
def test_a_checkpoint_that_finds_the_disk_full_is_named_and_resume_loses_nothing(
        small_disk: Path, tmp_path: Path, never_failed: Path, background: bool, begun: bool) -> None:
    """Found on a 20 MB tmpfs with 32 KB left when epoch 3 began (room for the log's lines, not for
    the 83 KB checkpoint), in the background writer: "ERROR after 3 epoch(s) (requested by
    CheckpointCallback.on_val_begin: OSError: [Errno 28] No space left on device)", naming no
    file, no device and no way on; and, now and then, the log's error instead: the writer's temp
    file had filled the disk to its last block just as the log needed one.

    ``begun``: the disk has room for the state's tensors but not for the whole file, so the write
    begins and fails part-way (in the foreground: nothing else writes meanwhile); otherwise it has
    less than the tensors, and the write is not begun at all. W&B is off: its files share the disk
    (tests/test_disk_full.py's first test has it on)."""
    sets = [*_SETS, "--set", f"checkpoint.background={str(background).lower()}"]
    latest = never_failed / "checkpoints" / "latest.pt"
    file_bytes, tensors = latest.stat().st_size, tensor_bytes(load_checkpoint(latest))
    page = 4096
    leave = (file_bytes - 1) // page * page if begun else 32 * 1024
    # two pages to spare for the log's lines of epoch 3 before the write
    assert (tensors + 2 * page <= leave < file_bytes) if begun else leave < tensors, (tensors, file_bytes)

    runs = small_disk / "runs"
    filler = {"target": "disk_support.FillDisk",
              "kwargs": {"path": str(small_disk / "filler"), "marker": str(tmp_path / "filled"), "at_epoch": 2,
                         "leave": leave}}
    proc = forked("train", str(QUICK), "--run-dir", str(runs), *sets, "--set", f"callbacks.extra=[{filler}]",
                    cwd=tmp_path)
    out, err = (b.decode() for b in proc.communicate(timeout=400))
    assert proc.returncode == 1, out + err
    run = runs / "mlp-regression-seed0"
    epoch_file = run / "checkpoints" / "epoch_3.pt"
    # the foreground write fails in the epoch it saves; the background one is found at the next look
    found_in = 4 if background else 3
    line = next((ln for ln in out.splitlines() if ln.startswith("seed 0: ERROR")), out)
    assert line.startswith(f"seed 0: ERROR in epoch {found_in}: the checkpoint of epoch 3 could not be written: "
                           f"no space left writing {epoch_file} (device tmpfs (tmpfs) mounted at {small_disk}, "), line
    unchanged = "the checkpoints committed before it are unchanged"
    if begun:
        assert line.endswith(f" bytes free); {unchanged}"), line
    else:  # not begun: the bytes of its state's tensors (epoch 3's, a few off the finished run's last) did not fit
        needs = re.search(rf" bytes free\); it needs at least (\d+) bytes; {unchanged}$", line)
        assert needs is not None and int(needs.group(1)) > leave, line
    assert f"free space on that device, then continue it with: fsmtrain resume {run}" in out, out
    _no_traceback(err)
    events = read_events(run / "events.jsonl")
    failed = next(e for e in events if e["event"] == "exception")
    assert failed["payload"]["type"] == "CheckpointWriteError"
    assert events[-1]["event"] == "result" and events[-1]["payload"]["stop_reason"] == "error"
    # nothing half-written is left behind, and what was committed still loads
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.pt", "epoch_1.pt", "epoch_2.pt",
                                                                      "latest.pt"]
    committed = {e["payload"]["path"] for e in events if e["event"] == "checkpoint"}
    assert "checkpoints/epoch_3.pt" not in committed and "checkpoints/latest.pt" in committed
    assert load_checkpoint(run / "checkpoints" / "latest.pt")["epoch"] == 2  # epoch_2.pt
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)

    (small_disk / "filler").unlink()
    proc = forked("resume", str(run), cwd=tmp_path)
    out, err = (b.decode() for b in proc.communicate(timeout=400))
    assert proc.returncode == 0, out + err
    _no_traceback(err)
    report = audit_file(run / "events.jsonl")
    assert report.ok, report.render(False)
    # the resumed run went on from epoch 2's checkpoint to the weights of the run that never failed
    assert same_weights(run / "model.pt", never_failed / "model.pt")

_FILE_LIMIT = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from fsmtrain.core.log_file import LogFile, LogWriteError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
    log = LogFile(Path(sys.argv[1]))
    n = 0
    try:
        while True:
            log.write(b'{"seq":%d,"line":"%s"}\\n' % (n, b"x" * 150))
            n += 1
    except LogWriteError as exc:
        print(n, exc.strerror)
    log.close()
""")


@pytest.mark.timeout(60)
def test_a_line_that_cannot_be_written_is_cut_back_to_the_last_whole_line(tmp_path: Path) -> None:
    """The file-size limit of a process (RLIMIT_FSIZE) stands in for a disk that fills mid-line: it
    needs no mount, and it refuses the bytes past the limit exactly where a full disk would."""
    log = tmp_path / "events.jsonl"
    done = subprocess.run([sys.executable, "-c", _FILE_LIMIT, str(log)], env=env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines, message = done.stdout.split(" ", 1)
    raw = log.read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == int(lines) and len(raw) < 5000
    assert message.startswith("file too large writing events.jsonl (device ")




def test_a_file_larger_than_the_free_blocks_is_not_begun(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    check_free_space(tmp_path / "epoch_1.pt", 1)  # fits: nothing raised
    with pytest.raises(OSError) as caught:
        check_free_space(tmp_path / "epoch_1.pt", free + (1 << 40))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "epoch_1.pt")
    error = CheckpointWriteError.of(caught.value, 0, tmp_path / "epoch_1.pt", free + (1 << 40))
    assert error.strerror is not None
    assert error.disk_full and error.strerror.startswith(
        f"the checkpoint of epoch 1 could not be written: no space left writing {tmp_path / 'epoch_1.pt'} (device ")
    assert error.strerror.endswith(f"; it needs at least {free + (1 << 40)} bytes; the checkpoints committed "
                                   "before it are unchanged")
    assert not list(tmp_path.iterdir())  # nothing was begun
