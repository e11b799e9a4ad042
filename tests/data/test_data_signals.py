"""A preparation stopped by a signal: the workers end with it, and no worker prints a
traceback. (That it then continues to the same bytes: tests/data/test_data_resume.py.)"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ember_cmd
from ember.data import prepare


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes of `pid` (multiprocessing's spawn_main in their command)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    found = []
    for child in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    small = root / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"row {i} is about models and data"}) + "\n" for i in range(300)))
    prepare([small], root / "tok", tokenizer="bpe", vocab_size=300, seq_len=16, progress=False)
    text = root / "big.jsonl"
    with open(text, "w") as handle:
        for i in range(400_000):
            handle.write(json.dumps({"text": f"document {i} says something about tokens, shards and workers"}) + "\n")
    return root


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc to find the workers")
@pytest.mark.parametrize("sig, group, status", [(signal.SIGTERM, False, 143), (signal.SIGINT, True, 130)])
def test_a_signal_ends_the_workers_too(big, tmp_path, sig, group, status):
    proc = subprocess.Popen(ember_cmd("data", "prepare", str(big / "big.jsonl"), "--out", str(tmp_path / "o"),
                                      "--tokenizer", str(big / "tok" / "tokenizer.json"), "--seq-len", "16",
                                      "--workers", "2", "--quiet"),
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # A shell that runs the suite in the background (`make test &`) leaves
                            # SIGINT ignored, and Python then installs no KeyboardInterrupt: as a terminal does.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while len(_workers_of(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2, "the preparation ended before both workers were seen"
    time.sleep(1.0)  # inside the packing loop
    if group:  # Ctrl-C in a terminal reaches the whole process group
        os.killpg(proc.pid, sig)
    else:  # `kill PID`, a scheduler: the main process alone
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert "Traceback" not in err and ("terminated" if sig == signal.SIGTERM else "interrupted") in err, err
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers)
    assert not (tmp_path / "o" / "manifest.json").exists()
