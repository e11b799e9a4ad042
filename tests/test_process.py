"""A process leaves its group and ends through ember.process: its output reaches the pipe
before the process ends without finalization, and its exit status is the command's."""

import subprocess
import sys

from ember.process import end_process_group, under_torchrun


def test_leave_flushes_and_keeps_the_exit_status():
    code = ("import sys; from ember.process import leave; print('written', end=''); "
            "print('to stderr', end='', file=sys.stderr); leave(3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "written" and done.stderr == "to stderr"


def test_a_single_process_has_no_group_to_end(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not under_torchrun()
    end_process_group()  # nothing joined: returns without waiting for peers
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert under_torchrun()


def test_a_second_sigterm_does_not_cut_the_stop_checkpoint_short():
    """Slurm signals torchrun and every worker of a step within milliseconds: the second
    SIGTERM must not end the process before the first one's checkpoint is written."""
    import os
    import signal

    from ember.process import sigterm_unwinds
    from ember.train.policies import StopOnSignal

    with sigterm_unwinds(), StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM


def test_a_command_run_from_another_thread_needs_no_signal_handler(tmp_path, capsys):
    import threading

    from ember.cli import main

    codes = []
    worker = threading.Thread(target=lambda: codes.append(main(["report", str(tmp_path / "missing")])))
    worker.start()
    worker.join()
    assert codes == [2]
