"""base/devices.py: the checks and the CPU behaviour of the device route (the CUDA side is
exercised by tests/test_gpu.py on a GPU machine)."""
import pytest
import torch

from stella_mpi.base import devices


def test_one_device_names_the_tensor_elsewhere():
    ts = [torch.ones(2), torch.ones(3), torch.ones(1, device="meta")]
    with pytest.raises(ValueError, match=r"'fc.bias' is on meta but 'fc.weight' is on cpu"):
        devices.one_device(ts, "engine='cpu'", ["fc.weight", "x", "fc.bias"])
    with pytest.raises(ValueError, match="tensor 2 is on meta"):
        devices.one_device(ts, "hvd.allreduce")
    assert devices.one_device(ts[:2], "x") == torch.device("cpu")


def test_cpu_tensors_need_no_event():
    assert devices.ready_event([torch.ones(3)]) is None


def test_cpu_route_is_plain_copies():
    route = devices.route_for("cpu")
    assert route is devices.route_for(torch.device("cpu"))
    x = torch.arange(5.0)
    assert route.to_host(x, "slot") is x
    out = torch.empty(5)
    assert route.to_device(x, out=out) is out and torch.equal(out, x)
    assert route.record() is None
    route.finish()
    buf = route.host_buffer("s", 10, torch.float32)
    assert buf.numel() == 10 and route.host_buffer("s", 4, torch.float32).data_ptr() == buf.data_ptr()
    with route.context():
        pass


def test_device_path_setting(monkeypatch):
    monkeypatch.delenv("STELLA_DEVICE_PATH", raising=False)
    assert not devices.device_path_forced() and not devices.on_device_route(torch.ones(1))
    monkeypatch.setenv("STELLA_DEVICE_PATH", "torch")
    assert devices.on_device_route(torch.ones(1))
    monkeypatch.setenv("STELLA_DEVICE_PATH", "cuda")
    with pytest.raises(ValueError, match="STELLA_DEVICE_PATH='cuda'"):
        devices.device_path_forced()


def test_device_names_are_kinds():
    assert devices.device_name("cpu") == "cpu" and devices.device_name(torch.device("cuda", 1)) == "cuda"
