"""The collective thread after a fatal failure (in a child process, MPI stays out of the test
runner): the failed op, every op queued behind it and every later submission raise
HorovodInternalError; none completes as a success, and the job-ending path is taken once."""
import subprocess
import sys

from mpi_launch import ROOT

SCRIPT = r'''
import threading, types
from stella_mpi.base.errors import HorovodInternalError
from stella_mpi.core import collective_thread as ct

ended = []
ct.end_job = lambda message, **kw: ended.append(kw.get("cause"))   # the process would end here: record instead
thread = ct.CollectiveThread(0, types.SimpleNamespace(check_collectives=False))
gate = threading.Event()

def broken(pset, desc, inputs, joined):
    gate.wait()
    raise RuntimeError("broken transport")

def op(name, execute):
    return ct.Op("allreduce", name, {"kind": "allreduce", "name": name}, (), execute, None)

first = thread.submit(op("a", broken))
queued = thread.submit(op("b", lambda *args: "the result of b"))
gate.set()
for hid in (first, queued):
    try:
        result = thread.wait(hid)
    except HorovodInternalError as e:
        assert "broken transport" in str(e) and "rank 0" in str(e), e
    else:
        raise SystemExit("handle %d completed as a success: %r" % (hid, result))
try:
    thread.submit(op("c", lambda *args: "the result of c"))
except HorovodInternalError:
    pass
else:
    raise SystemExit("a submission after the failure was accepted")
import time
deadline = time.monotonic() + 10
while not ended and time.monotonic() < deadline:   # the thread ends the job right after failing the handles
    time.sleep(0.01)
assert ended == ["collective"], ended
print("fail-stop checks passed")
'''


def test_no_handle_completes_after_a_fatal_failure():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fail-stop checks passed" in proc.stdout
    # the whole story is written before anyone wakes up
    assert "rank 0: allreduce 'a' failed: RuntimeError: broken transport" in proc.stderr, proc.stderr
    assert "ending the job on every rank" in proc.stderr
