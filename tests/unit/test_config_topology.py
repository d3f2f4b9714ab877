"""Settings from the environment and the cluster layout rules (no MPI launch needed)."""
import pytest

from stella_mpi.base.config import Config
from stella_mpi.comm.buffers import split_counts
from stella_mpi.comm.topology import cluster_label


def test_split_counts():
    assert split_counts(10, 3) == [4, 3, 3]
    assert split_counts(2, 4) == [1, 1, 0, 0]
    assert split_counts(0, 2) == [0, 0]
    assert sum(split_counts(2 ** 31 + 5, 7)) == 2 ** 31 + 5


def test_config_defaults_and_horovod_names(monkeypatch):
    for k in ("STELLA_TIMEOUT", "STELLA_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", "STELLA_CLUSTERS",
              "STELLA_CLUSTER", "STELLA_INTRA_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    c = Config.from_env()
    assert c.timeout_s > 0 and c.intra_backend == "auto" and c.clusters_per_node == 0
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    assert Config.from_env().fusion_threshold == 1024
    monkeypatch.setenv("STELLA_FUSION_THRESHOLD", "2048")
    assert Config.from_env().fusion_threshold == 2048


@pytest.mark.parametrize("var,value,match", [
    ("STELLA_TIMEOUT", "soon", "STELLA_TIMEOUT"),
    ("STELLA_TIMEOUT", "-1", "positive"),
    ("STELLA_INTRA_BACKEND", "carrier-pigeon", "auto, mpi or gloo"),
    ("STELLA_CLUSTERS", "-2", "STELLA_CLUSTERS"),
    ("STELLA_CHECK_COLLECTIVES", "maybe", r"STELLA_CHECK_COLLECTIVES='maybe' is not a valid boolean \(1/0"),
    ("STELLA_TIMEOUT", "nan", "STELLA_TIMEOUT='nan' is not a valid finite number"),   # would switch deadlines off
    ("STELLA_TIMEOUT", "inf", "STELLA_TIMEOUT='inf' is not a valid finite number"),
])
def test_config_errors_name_the_variable(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        Config.from_env()


def _cfg(monkeypatch, **env):
    for k in ("STELLA_CLUSTER", "STELLA_CLUSTERS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Config.from_env()


def test_cluster_labels(monkeypatch):
    assert cluster_label(_cfg(monkeypatch), 3, 0, 4) == "node:3"
    c = _cfg(monkeypatch, STELLA_CLUSTERS="2")
    assert [cluster_label(c, 0, r, 4) for r in range(4)] == ["node:0/0"] * 2 + ["node:0/1"] * 2
    assert [cluster_label(c, 0, r, 3) for r in range(3)] == ["node:0/0"] * 2 + ["node:0/1"]
    with pytest.raises(ValueError, match="more clusters"):
        cluster_label(_cfg(monkeypatch, STELLA_CLUSTERS="5"), 0, 0, 4)
    assert cluster_label(_cfg(monkeypatch, STELLA_CLUSTER="eu-west"), 0, 0, 4) == "label:eu-west"


def test_cluster_map_by_host(monkeypatch):
    import socket
    host = socket.gethostname()
    c = _cfg(monkeypatch, STELLA_CLUSTER_MAP="%s=lab,elsewhere=cloud" % host)
    assert cluster_label(c, 0, 0, 1) == "map:lab"
    with pytest.raises(ValueError, match="does not name this host"):
        cluster_label(_cfg(monkeypatch, STELLA_CLUSTER_MAP="elsewhere=cloud"), 0, 0, 1)
    with pytest.raises(ValueError, match="HOST=LABEL"):
        cluster_label(_cfg(monkeypatch, STELLA_CLUSTER_MAP="nolabel"), 0, 0, 1)


def test_stellarun_builds_the_mpirun_command():
    from stellarun.cli import build_command, parse
    cmd = build_command(parse(["-np", "4", "--clusters", "2", "--mpirun", "/x/mpirun", "python", "t.py", "--lr", "1"]),
                        "/tmp/status")
    assert cmd[:3] == ["/x/mpirun", "-np", "4"]
    assert cmd[-4:] == ["python", "t.py", "--lr", "1"]
    i = cmd.index("STELLA_CLUSTERS")
    assert cmd[i - 1] == "-genv" and cmd[i + 1] == "2"
    with pytest.raises(SystemExit, match="more than"):
        build_command(parse(["-np", "2", "--clusters", "3", "--mpirun", "m", "python"]), "")
    with pytest.raises(SystemExit, match="HOST=LABEL"):
        build_command(parse(["-np", "2", "--cluster-of", "x", "--mpirun", "m", "python"]), "")


def test_the_launcher_splits_ranks_into_clusters_as_the_runtime_does():
    """stellarun cannot import stella_mpi, so it has its own copy of split_counts: they must agree."""
    from stellarun.cli import cluster_sizes
    for n in range(1, 40):
        for parts in range(1, n + 1):
            assert cluster_sizes(n, parts) == split_counts(n, parts), (n, parts)
