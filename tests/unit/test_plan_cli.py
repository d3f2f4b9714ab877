"""``stellarun plan``'s command line (the launcher side: no torch, no MPI): what it refuses,
naming the field, and the spec it hands to the jobs."""
import pytest

from stellarun import plan


def spec(*argv):
    return plan.build_spec(plan.parse(["--model", "examples/plan_model.py"] + list(argv)))


def test_clusters_links_prices_are_read():
    s = spec("--cluster", "4xrtx4090,price=0.7", "--cluster", "8xA100-80GB,price=1.9,revocations=0.05,link=1gbit",
             "--link", "100mbit", "--global-batch", "256", "--target-loss", "2.5")
    a, b = s["clusters"]
    assert a == {"count": 4, "kind": "rtx4090", "price": 0.7, "link": 100e6}
    assert b == {"count": 8, "kind": "a100-80gb", "price": 1.9, "revocations": 0.05, "link": 1e9}
    assert s["global_batch"] == 256 and s["target_loss"] == 2.5 and s["target_steps"] is None


@pytest.mark.parametrize("argv, words", [
    ([], ["--cluster", "give each cluster"]),
    (["--cluster", "rtx4090"], ["COUNTxKIND", "cluster 0"]),
    (["--cluster", "0xh100"], ["count 0"]),
    (["--cluster", "2xh100,price=-1"], ["price", "must be >= 0"]),
    (["--cluster", "2xh100,price=abc"], ["price", "not a number"]),
    (["--cluster", "2xh100,speed=3"], ["field 'speed=3'", "price=..."]),
    (["--cluster", "2xh100,price=1,price=2"], ["given twice"]),
    (["--cluster", "2xh100,link=fast"], ["link", "fast"]),
    (["--cluster", "2xh100", "--link", "0mbit"], ["--link", "positive"]),
    (["--cluster", "4xh100", "--global-batch", "3"], ["--global-batch 3", "4 GPUs"]),
    (["--cluster", "2xh100", "--target-loss", "2", "--target-steps", "100"], ["contradict"]),
    (["--cluster", "2xh100,price=1", "--cluster", "2xh100"], ["price=", "[0]", "[1]"]),
    (["--cluster", "2xh100", "--commit-every", "0"], ["--commit-every 0"]),
    (["--cluster", "2xh100", "--model-arg", "oops"], ["--model-arg 'oops'", "KEY=VALUE"]),
])
def test_contradictions_are_refused_naming_the_field(argv, words):
    with pytest.raises(plan.PlanError) as e:
        spec(*argv)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_the_launcher_reports_a_refusal_with_exit_2(capsys):
    assert plan.main(["--model", "x.py", "--cluster", "2xh100", "--global-batch", "1"]) == 2
    assert "--global-batch 1" in capsys.readouterr().err
