"""A rank that raises, exits or stalls ends the whole job within seconds, with a message
naming it: never a hang."""
import re
import sys
import time

import pytest

from mpi_launch import ROOT, mpirun_path, run_job

pytestmark = pytest.mark.mpi


def _launch(mode, timeout_env="60", as_module=False, env=None, np_=2):
    """faulty_rank.py's ``mode`` on ``np_`` ranks in 2 clusters: one rank each where what is
    tested is one rank against another (half the start-up of 4), 4 where it is a cluster's ranks
    (inner steps, gloo inside a cluster)."""
    import os
    env = dict(os.environ, PYTHONUNBUFFERED="1", STELLA_TIMEOUT=timeout_env, STELLA_CLUSTERS="2", **(env or {}))
    launcher = mpirun_path()
    if launcher is None:
        pytest.skip("no mpirun")
    cmd = [launcher, "-np", str(np_), sys.executable] + (["-m", "mpi4py"] if as_module else []) + \
        ["tests/scripts/faulty_rank.py", mode]
    t0 = time.monotonic()
    proc = run_job(cmd, 120, env=env, cwd=ROOT, capture_output=True, text=True)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("as_module", [False, True], ids=["python-script", "python-m-mpi4py"])
def test_uncaught_exception_ends_job(as_module):
    proc, elapsed = _launch("raise", as_module=as_module)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert "boom on purpose" in out
    if not as_module:
        assert "rank 1 raised an uncaught RuntimeError" in out
    assert "finished without noticing" not in out


def test_a_killed_rank_leaves_no_mpich_files():
    """A rank killed by SIGKILL never unlinks MPICH's shared-memory segment, and plain mpirun
    leaves it behind: the test launcher, like stellarun, removes what the job made that no
    running process uses."""
    from stellarun import leftovers
    since = time.time() - 1
    proc, _ = _launch("kill")
    assert proc.returncode != 0
    assert any(p.startswith("/dev/shm/mpich_shm_") for p in proc.leftovers_removed), proc.leftovers_removed
    left = set(leftovers.candidates(since=since)) - leftovers.in_use()
    assert not left, "MPICH files left: %s" % sorted(left)


def test_dead_rank_ends_job():
    proc, elapsed = _launch("exit")
    assert proc.returncode != 0
    assert elapsed < 45, elapsed


def test_stalled_rank_hits_the_deadline():
    proc, elapsed = _launch("stall", timeout_env="5")   # (5 s: as in test_start_and_end_have_deadlines)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "did not complete within 5 s" in out, out[-3000:]
    # rank 1's collective thread still cycles: the others see that it never submitted step.0
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\) never submitted it", out), out[-3000:]
    assert "ending the job on every rank" in out


@pytest.mark.slow   # (the deadline's own test is test_stalled_rank_hits_the_deadline)
def test_a_rank_that_stalls_in_an_inner_step_is_named_by_its_cluster():
    """Local steps' inner steps reduce on the cluster's channel, off the negotiation: a rank that
    never comes still ends the job at the deadline, named by its cluster's other rank."""
    proc, elapsed = _launch("stall_in_inner_step", timeout_env="8", np_=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert re.search(r"rank 0: the cluster's allreduce .* did not complete within 8 s", out), out[-3000:]
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\)", out), out[-3000:]
    assert "finished without noticing" not in out


def test_a_rank_that_joins_during_inner_steps_ends_the_job_naming_it():
    """hvd.join() on rank 1 while rank 0, of its cluster, waits for its inner step's gradients:
    the job ends as soon as the negotiation says rank 1 joined (well before the 60 s deadline),
    naming it and what to do instead."""
    proc, elapsed = _launch("join_in_inner_steps", np_=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert "rank 1 of this cluster called hvd.join()" in out, out[-3000:]
    assert "STELLA_CLUSTER_CHANNEL=0" in out
    assert "finished without noticing" not in out


@pytest.mark.slow   # (the default run has the channel's join case; this is its mispairing check)
def test_an_inner_step_buffer_that_pairs_with_another_collective_ends_the_job():
    """Rank 1's lane carries another number, as a buffer from another optimizer or bucket would:
    its cluster's ranks see the sums disagree at the first inner step and end the job, never
    applying the mixed sum."""
    proc, elapsed = _launch("mispaired_inner_step", np_=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert "paired with another collective on a rank of its cluster" in out, out[-3000:]
    assert "finished without noticing" not in out


@pytest.mark.slow   # (the default run's 10 minutes: a stalled rank is named by test_stalled_rank_hits_the_deadline)
def test_a_rank_whose_gil_is_held_in_a_blocking_call_is_named_with_the_cause():
    """mpi4py's pickle-based comm.allreduce (comm.gather, comm.reduce) holds Python's GIL while it
    waits for the other ranks, so stella_mpi's collective thread on that rank cannot run and its
    rounds stop: the others' deadline names the negotiation round they were in, what they waited
    for and the rank, and says what may hold the GIL (not a collective that had completed long
    before, as the message named until the collective thread forgot its last op)."""
    proc, elapsed = _launch("gil_held", timeout_env="8")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert "negotiation round (this rank waited for 'after_warmup')" in out, out[-3000:]
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\) never came", out), out[-3000:]
    assert "holds Python's GIL" in out and "comm.Allreduce" in out, out[-3000:]
    assert "'warmup'" not in out, out[-3000:]
    assert "finished without noticing" not in out


@pytest.mark.parametrize("mode,what", [pytest.param("late_import", "MPI_Init did not complete within 5 s",
                                                    marks=pytest.mark.slow),   # (stop_at_start: before MPI_Init too)
                                       # before MPI_Init nobody can be asked; the watchdogs look at the
                                       # ranks under the same hydra proxy (found by the chaos soak)
                                       ("stop_at_start", r"rank 1 \(host [^,]+, pid \d+\) is stopped"),
                                       ("late_init", "rank 1 never came"),
                                       # the others wait for rank 1 at their end, and their collective
                                       # thread's idle round may have been waiting for it already (it
                                       # started first, so its deadline passes first): both say so
                                       pytest.param("stop_at_exit", "(the end of the program|negotiation round) "
                                                    "did not complete within 5 s", marks=pytest.mark.slow)])
def test_start_and_end_have_deadlines(mode, what):
    """A rank frozen before MPI_Init, before hvd.init() or at the end of the program: the others
    end within STELLA_TIMEOUT and a few seconds, saying what they waited for."""
    # (5 s: with one rank per cluster every wait is on the faulty rank, so a short deadline
    # cannot fire on a healthy one)
    proc, elapsed = _launch(mode, timeout_env="5")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, (elapsed, out[-3000:])
    assert re.search(what, out), out[-3000:]
    if mode not in ("late_import", "stop_at_start"):   # before MPI_Init nobody can be asked
        assert re.search(r"rank 1 (\(host [^,]+, pid \d+\) )?never came", out), out[-3000:]


@pytest.mark.slow   # (the default run's chaos sample sends garbage THC scales: tests/test_chaos_sample.py)
def test_a_garbage_thc_scale_from_a_peer_ends_the_job():
    """A THC scale is agreed by one MAX over the clusters: a peer's NaN wins it, so every rank
    refuses the step (naming the ranks that agreed, not the sender: a MAX cannot tell)."""
    _ends_the_job("corrupt_thc_scale", r"THC scales of '[^']*thc\.grad[^']*' \(step 0\): the clusters' ranks "
                  r"\[[0-9, ]+\] agreed on scale nan for block 0, not finite scales >= 0 and a flag of 0 or 1; a peer "
                  r"sent garbage")


def _ends_the_job(mode, pattern):
    """Rank 1 of faulty_rank.py tampers as ``mode`` says (2 ranks, one per cluster: its one shard
    is the whole tensor): the job ends within 45 s, non-zero, with ``pattern`` (a regular
    expression) in its output, and no rank got past the step."""
    proc, elapsed = _launch(mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert re.search(pattern, out), out[-3000:]
    assert "finished without noticing" not in out


def test_malformed_payload_from_a_peer_ends_job_naming_the_sender():
    _ends_the_job("corrupt", re.escape("rank 1 sent a malformed payload for 'sparse.grad#shard0'"))


@pytest.mark.slow   # (the C decoder's refusals of every bad scale run by default: tests/unit/test_chunked_kernels.py)
def test_a_bad_sparseloco_scale_from_a_peer_ends_the_job_naming_the_sender():
    _ends_the_job("corrupt_sparseloco_scale", r"rank 1 sent a malformed payload for 'sparseloco\.grad#shard0' "
                  r"\(step \d+\): quantised payload decode")


@pytest.mark.slow
def test_a_rank_waiting_inside_gloo_is_not_named_as_silent():
    """Rank 3 freezes inside an allreduce; rank 2, in its cluster, waits for it inside gloo's
    reduce-scatter. The deadline names rank 3 alone as never having come: rank 2 answers from
    inside gloo, while it waits (a blocking gloo wait answered only once its own deadline passed,
    so a rank that entered it later looked silent, and a launcher would have taken its whole
    cluster for cut off)."""
    proc, elapsed = _launch("freeze_in_op", timeout_env="8", env={"STELLA_INTRA_BACKEND": "gloo"}, np_=4)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, (elapsed, out[-3000:])
    assert re.search(r"rank 3 \(host [^,]+, pid \d+\) never came", out), out[-3000:]
    assert not re.search(r"rank 2 \(host [^,]+, pid \d+\)(, rank \d \(host [^,]+, pid \d+\))* never came", out), \
        out[-3000:]
    assert re.search(r"rank\(s\) [0-9, ]*2[0-9, ]* wait in ", out), out[-3000:]


def test_an_oversized_payload_is_refused_unread_naming_the_sender():
    proc, elapsed = _launch("oversized")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert re.search(r"sparse exchange of 'sparse.grad#shard0': rank 1 announced a payload of \d+ bytes for a tensor "
                     r"of 10000 elements \(a valid one has 32 to \d+\); refusing it unread", out), out[-3000:]
    assert "finished without noticing" not in out


@pytest.mark.parametrize("mode", ["failing_op", "failing_op_all"], ids=["one-rank", "every-rank"])
def test_a_failed_collective_never_returns_data(mode):
    """The failing rank's caller gets HorovodInternalError (never its own un-reduced input), and
    the job ends everywhere."""
    proc, elapsed = _launch(mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert "injected transport failure" in out and "rank 1:" in out, out[-3000:]
    assert "got a result after its collective failed" not in out, out[-3000:]
    assert "finished without noticing" not in out


def test_a_terminated_rank_names_itself():
    """Under plain mpirun hydra's report may name another pid: the rank says it was terminated."""
    proc, elapsed = _launch("term")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 45, elapsed
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\) received SIGTERM", out), out[-3000:]
