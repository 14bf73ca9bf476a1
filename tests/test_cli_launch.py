"""The launcher (`tessera train --nproc-per-node N` hands over to torchrun): a SIGTERM or SIGHUP sent
to it alone reaches the launched command, so stopping the launcher never leaves workers behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.cli import run_forwarding_signals

# (its handlers set before it says its pid: a signal forwarded at once finds them)
CHILD = ("import os, signal, sys, time; "
         "[signal.signal(s, lambda *_: sys.exit(7)) for s in (signal.SIGTERM, signal.SIGHUP)]; "
         "print(os.getpid(), flush=True); time.sleep(60)")
LAUNCHER = ("import sys; from tessera.cli import run_forwarding_signals; "
            f"sys.exit(run_forwarding_signals([sys.executable, '-c', {CHILD!r}]))")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_launcher_stops_what_it_launched(sig):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(launcher.stdout.readline())
    try:
        launcher.send_signal(sig)  # to the launcher only, as `kill` or a container runtime sends it
        assert launcher.wait(timeout=20) == 7, "the launcher should return the child's exit status"
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the launched command outlived its launcher"
    finally:
        for pid in (child, launcher.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_launched_commands_exit_status_is_returned():
    assert run_forwarding_signals([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers put back
