"""stellarun --elastic's driver without running a job: how it reads what the ranks recorded.
A link outage longer than the timeout cuts a cluster off (its hosts are left out for a while,
then tried again); one stalled rank is its host's failure; --elastic --wan's command starts each
rank in its cluster's namespace."""
import argparse

import pytest

from stellarun import cli, elastic
from stellarun.wan import WanEmulation


def _driver(labels, cooldown=None):
    args = argparse.Namespace(host_discovery_script=None, static_hosts=[("localhost", 2), ("127.0.0.1", 2)],
                              min_np=2, max_np=4, np=4, cluster_labels=labels, blacklist_cooldown_range=cooldown,
                              wan=100e6)
    driver = elastic.ElasticDriver(args, None, None)
    return driver


def _listed(driver):
    return {h for h, _ in driver.discovery.hosts()}


def _deadline(rank, silent):
    return {"rank": rank, "host": "vm", "pid": 1, "time": 0.0, "cause": "deadline", "detail": "d", "silent": silent}


@pytest.fixture
def two():
    driver = _driver({"localhost": "a", "127.0.0.1": "b"})
    ranks = elastic.assign([("localhost", 2), ("127.0.0.1", 2)], 4)
    yield driver, ranks
    elastic.shutil.rmtree(driver.base, ignore_errors=True)


def test_a_cluster_silent_to_the_other_is_cut_off_and_the_tie_goes_to_rank_0(two):
    driver, ranks = two
    # rank 3 (cluster b) timed out first and names a's ranks: still a is kept (rank 0's side of a tie)
    driver.handle_failures([_deadline(3, [0, 1])], ranks)
    assert set(driver.cut_off) == {"127.0.0.1"} and not driver.blacklist
    assert [h for h, _ in driver.usable(driver.discovery.hosts())] == ["localhost"]
    left = driver.cut_off["127.0.0.1"] - elastic.time.monotonic()
    assert elastic.CUT_RETRY_S - 1 < left <= elastic.CUT_RETRY_S
    # cut again: twice as long
    driver.handle_failures([_deadline(0, [2, 3]), _deadline(2, [0, 1])], ranks)
    left = driver.cut_off["127.0.0.1"] - elastic.time.monotonic()
    assert 2 * elastic.CUT_RETRY_S - 1 < left <= 2 * elastic.CUT_RETRY_S and not driver.blacklist


def test_the_larger_side_goes_on(tmp_path):
    driver = _driver({"localhost": "a", "127.0.0.1": "b", "127.0.0.2": "b"}, cooldown=(5, 5))
    try:
        ranks = elastic.assign([("localhost", 1), ("127.0.0.1", 1), ("127.0.0.2", 1)], 3)
        assert driver.handle_cuts([_deadline(1, [0])], ranks, _listed(driver)) == {"a"}
        assert set(driver.cut_off) == {"localhost"}
        assert 4 < driver.cut_off["localhost"] - elastic.time.monotonic() <= 5   # --blacklist-cooldown-range
    finally:
        elastic.shutil.rmtree(driver.base, ignore_errors=True)


def test_three_clusters_one_cut_off_from_both_others(tmp_path):
    driver = _driver({"localhost": "a", "127.0.0.1": "b", "127.0.0.2": "c"})
    try:
        ranks = elastic.assign([("localhost", 1), ("127.0.0.1", 1), ("127.0.0.2", 1)], 3)
        # a names c silent, c names a and b silent; nobody says a and b are apart
        assert driver.handle_cuts([_deadline(0, [2]), _deadline(2, [0, 1])], ranks, _listed(driver)) == {"c"}
    finally:
        elastic.shutil.rmtree(driver.base, ignore_errors=True)


def test_one_stalled_rank_is_its_hosts_failure_not_a_cut(two):
    driver, ranks = two
    # rank 0 waited for rank 3 only; rank 2 (the same cluster) answered: host 127.0.0.1 failed
    driver.handle_failures([_deadline(0, [3])], ranks)
    assert not driver.cut_off and driver.blacklist["127.0.0.1"] == float("inf")


def test_records_without_silent_ranks_are_handled_as_before(two):
    driver, ranks = two
    # (a rank's own failure; a failed collective blames the sender it names: the test below)
    driver.handle_failures([{**_deadline(2, None), "cause": "exception"}], ranks)
    assert not driver.cut_off and set(driver.blacklist) == {"127.0.0.1"}


def test_under_wan_a_host_it_cannot_place_is_left_out_with_a_warning(two, capsys):
    driver, _ = two
    listed = [("localhost", 2), ("127.0.0.1", 2), ("127.0.0.5", 1), ("node7", 1)]
    for _ in range(2):
        assert driver.usable(listed) == [("localhost", 2), ("127.0.0.1", 2)]
    out = capsys.readouterr().out
    assert out.count("no cluster; give it one with --cluster-of 127.0.0.5=LABEL; it is left out") == 1
    assert out.count("discovery listed host node7; it is left out") == 1   # once per host


def test_a_link_cut_between_two_of_three_clusters_keeps_two_joined_ones(tmp_path):
    driver = _driver({"localhost": "a", "127.0.0.1": "b", "127.0.0.2": "c"})
    try:
        ranks = elastic.assign([("localhost", 1), ("127.0.0.1", 1), ("127.0.0.2", 1)], 3)
        # a and b cannot reach each other; both reach c: {a, c} (rank 0's) goes on, not all three
        assert driver.handle_cuts([_deadline(0, [1]), _deadline(1, [0])], ranks, _listed(driver)) == {"b"}
        assert set(driver.cut_off) == {"127.0.0.1"}
    finally:
        elastic.shutil.rmtree(driver.base, ignore_errors=True)


def test_the_back_off_starts_over_after_a_long_incarnation(two, monkeypatch):
    driver, ranks = two
    driver.cuts = {"b": 5}
    outcomes = [1, 0]

    def run_job(command, records):
        if outcomes[0]:
            records.append(_deadline(0, [2, 3]))
        return outcomes.pop(0)
    driver.command_for_segments, driver.run_job = (lambda segments: segments), run_job
    monkeypatch.setattr(elastic, "CUT_RETRY_MAX_S", 0.0)   # every incarnation counts as long
    driver.args.reset_limit, driver.args.elastic_timeout = 3, 5
    assert driver.run() == 0
    assert driver.cuts == {"b": 1}


def test_dry_run_of_elastic_wan_builds_nothing(monkeypatch, capsys):
    def refuse(self):
        raise AssertionError("--dry-run built the emulation")
    monkeypatch.setattr(WanEmulation, "setup", refuse)
    argv = ["--elastic", "-np", "2", "--dry-run", "--wan", "100mbit", "-H", "localhost:1,127.0.0.1:1"]
    assert cli.main(argv + ["python", "train.py"]) == 2   # -H is refused before anything is built
    monkeypatch.setattr(elastic.Discovery, "hosts", lambda self: [("localhost", 1), ("127.0.0.1", 1)])
    argv = ["--elastic", "-np", "2", "--dry-run", "--wan", "100mbit", "--host-discovery-script", "/bin/true",
            "--cluster-of", "localhost=a", "--cluster-of", "127.0.0.1=b"]
    assert cli.main(argv + ["python", "train.py"]) == 0
    assert "ip netns exec" in capsys.readouterr().out


def test_elastic_wan_command_starts_each_rank_in_its_clusters_namespace():
    args = cli.parse(["--elastic", "-np", "3", "--wan", "100mbit", "--cluster-of", "localhost=a", "--cluster-of",
                      "127.0.0.1=b", "--mpirun", "mpirun", "python", "train.py"])
    emu = WanEmulation(2, 100e6)   # not set up: only its names and addresses are used
    segments = [("localhost", {"STELLA_CLUSTER": "a"}), ("127.0.0.1", {"STELLA_CLUSTER": "b"}),
                ("127.0.0.1", {"STELLA_CLUSTER": "b"})]
    cmd = cli.build_segments_command(args, segments, "/tmp/s", wan=(emu, ["a", "b"]))
    text = " ".join(cmd)
    assert "-launcher fork -hosts localhost:1,127.0.0.1:2" in text   # a hydra host each: no shared memory across
    assert "-genv STELLA_WAN_MASTER_ADDR %s" % emu.address(0) in text and "-genv FI_TCP_IFACE wan0" in text
    parts = text.split(" : ")
    assert len(parts) == 3
    assert "ip netns exec %s" % emu.namespaces[0] in parts[0] and "STELLA_WAN_ADDR %s" % emu.address(0) in parts[0]
    assert all("ip netns exec %s" % emu.namespaces[1] in p for p in parts[1:])


@pytest.mark.parametrize("argv, says", [
    (["--elastic", "-np", "2", "--wan", "100mbit", "-H", "localhost:2"], "give 2 or more clusters"),
    (["--elastic", "-np", "2", "--wan", "100mbit", "-H", "localhost:1,127.0.0.1:1", "--cluster-of", "localhost=a",
      "--cluster-of", "127.0.0.1=b"], "not -H"),
    (["--elastic", "-np", "2", "-H", "localhost:2", "--wan-schedule", "5:down"], "need --wan RATE"),
])
def test_elastic_wan_usage_errors(argv, says, capsys):
    assert cli.main(argv + ["python", "train.py"]) == 2
    assert says in capsys.readouterr().err


def test_a_schedule_can_cut_the_link():
    from stellarun.shaping import LINK_DOWN, parse_schedule
    assert parse_schedule("5:down,15:100mbit") == [(5.0, LINK_DOWN), (15.0, 100e6)]
    for bad in ("x:down", "-1:down", "5:up"):
        with pytest.raises(ValueError):
            parse_schedule(bad)


def test_a_stopped_rank_alone_in_its_cluster_is_a_failure_not_a_cut(two):
    driver, _ = two
    ranks = elastic.assign([("localhost", 1), ("127.0.0.1", 1)], 2)
    stopped = {"rank": 0, "host": "vm", "pid": 2, "time": 0.0, "cause": "signal", "detail": "stopped"}
    driver.handle_failures([_deadline(1, [0]), stopped], ranks)
    assert not driver.cut_off and set(driver.blacklist) == {"localhost"}


def test_a_group_whose_hosts_left_discovery_does_not_go_on(two):
    driver, _ = two
    ranks = elastic.assign([("localhost", 1), ("127.0.0.1", 1)], 2)
    driver.discovery.static = [("127.0.0.1", 1)]   # localhost was revoked: rank 0's side of the tie is gone
    assert driver.handle_cuts([_deadline(1, [0])], ranks, _listed(driver)) == {"a"}
    assert not driver.cut_off   # revoked, not cut off: when it is listed again it may rejoin at once


def test_a_start_up_deadline_with_a_cluster_back_after_a_cut_cuts_it_off_again(two):
    """MPI_Init does not complete over a link that is down, and before it nobody can be asked:
    if a cluster cut off before is back in the job, it is cut off again and nobody is
    blacklisted. Without such a cluster, when the ranks of every cluster timed out (the link
    went down as the job started), every cluster but rank 0's is cut off (blacklisting every
    host would leave the job none: the chaos soak found it waiting for hosts); when only some
    clusters' ranks did, their hosts fail as before."""
    driver, ranks = two
    start_up = [{**_deadline(r, None), "detail": "MPI_Init did not complete within 8 s"} for r in range(4)]
    for rec in start_up:
        del rec["silent"]
    driver.handle_failures(start_up, ranks)
    assert set(driver.cut_off) == {"127.0.0.1"} and not driver.blacklist and driver.cuts == {"b": 1}
    driver.cut_off.clear()
    driver.cuts = {}
    driver.handle_failures(start_up[2:], ranks)   # only cluster b's ranks timed out
    assert not driver.cut_off and set(driver.blacklist) == {"127.0.0.1"}
    driver.blacklist.clear()
    driver.cuts = {"b": 1}
    driver.handle_failures(start_up, ranks)
    assert set(driver.cut_off) == {"127.0.0.1"} and not driver.blacklist and driver.cuts == {"b": 2}
    driver.cut_off.clear()
    driver.cuts = {"a": 1, "b": 1}   # both were cut off before: rank 0's cluster goes on
    driver.handle_failures(start_up, ranks)
    assert set(driver.cut_off) == {"127.0.0.1"} and not driver.blacklist


def test_a_long_incarnation_without_the_cut_cluster_keeps_its_back_off(two, monkeypatch):
    """The back-off of a cluster starts over only after a long incarnation *with* it: a long one
    of the survivors alone (the cut cluster's wait at its cap) must not make its next start-up
    failure look like every host's."""
    driver, _ = two
    driver.cuts = {"b": 6}
    start_up = [{"rank": r, "host": "vm", "pid": 1, "time": 0.0, "cause": "deadline", "detail": "MPI_Init ..."}
                for r in range(4)]
    outcomes = [("alone", 1), ("both", 1), ("both", 0)]
    seen = []

    def run_job(segments, records):
        which, rc = outcomes.pop(0)
        seen.append(sorted({h for h, _ in segments}))
        if which == "both" and rc:
            records.extend(start_up)
        elif rc:   # the survivors leave for a reset (hosts added) after a long incarnation
            elastic.time.sleep(0.2)
            records.append({"rank": 0, "host": "vm", "pid": 1, "time": 0.0, "cause": "exit",
                            "detail": "exited with code %d" % elastic.RESET_EXIT})
        return rc
    driver.command_for_segments, driver.run_job = (lambda segments: segments), run_job
    driver.discovery.static = [("localhost", 2)]   # b is not listed during the first incarnation ...
    monkeypatch.setattr(elastic, "CUT_RETRY_MAX_S", 0.1)   # ... which counts as long (0.2 s); the next is short
    driver.args.reset_limit, driver.args.elastic_timeout = 5, 5
    driver.args.blacklist_cooldown_range = (0, 0)
    orig = driver.handle_failures

    def back(records, ranks):   # b is listed again for the next incarnation
        driver.discovery.static = [("localhost", 2), ("127.0.0.1", 2)]
        orig(records, ranks)
    driver.handle_failures = back
    assert driver.run() == 0
    assert seen[0] == ["localhost"] and seen[1] == ["127.0.0.1", "localhost"]
    assert not driver.blacklist and driver.cuts["b"] == 7   # cut off again, not every host blacklisted


def test_a_rank_stopped_at_start_up_blames_its_host_alone(two):
    """A rank frozen before MPI_Init: the others' start-up deadlines name nobody (nobody could be
    asked), stellarun finds the stopped rank and records it. Only that rank's host fails; the
    deadlines do not blame their own hosts (the chaos soak found every host blacklisted and the
    job waiting for hosts)."""
    driver, ranks = two
    start_up = [{**_deadline(r, None), "detail": "MPI_Init did not complete within 10 s"} for r in range(3)]
    for rec in start_up:
        del rec["silent"]
    stopped = {"rank": 3, "host": "vm", "pid": 7, "time": 1.0, "cause": "signal",
               "detail": "stopped (SIGSTOP or a debugger) when the job failed"}
    driver.handle_failures(start_up + [stopped], ranks)
    assert set(driver.blacklist) == {ranks[3][0]} and not driver.cut_off


def test_a_failed_collective_blames_the_sender_it_names_or_nobody(two):
    """The chaos soak: garbage THC scales from one rank made every receiver record a failed
    collective, and their hosts (both) were blacklisted. A collective's record blames the sender
    its message names ("rank N sent a malformed payload"), else nobody: the reset retries."""
    driver, ranks = two
    thc = [{"rank": r, "host": "vm", "pid": 1, "time": 0.0, "cause": "collective",
            "detail": "THC scales of 'x' (step 3): the clusters' ranks [1, 3] agreed on scale nan"} for r in (1, 3)]
    driver.handle_failures(thc, ranks)
    assert not driver.blacklist and not driver.cut_off
    sparse = [{"rank": 0, "host": "vm", "pid": 1, "time": 0.0, "cause": "collective",
               "detail": "PeerPayloadError: rank 2 sent a malformed payload for 'x' (step 5)"}]
    driver.handle_failures(sparse, ranks)
    assert set(driver.blacklist) == {ranks[2][0]}

