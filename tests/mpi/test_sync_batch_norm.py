"""hvd.SyncBatchNorm against torch's BatchNorm on the whole batch of every rank, in one process:
the output, the running statistics, the input's gradient and (summed over the ranks) the
gradients of weight and bias. The ranks' batches have different sizes."""
import pytest
import torch

import stella_mpi as hvd


def _batch(r, dims):
    g = torch.Generator().manual_seed(100 + r)
    return torch.randn((2 + r,) + dims, generator=g, dtype=torch.float64) * (1 + r) + r


@pytest.mark.parametrize("dims,bn", [((3,), torch.nn.BatchNorm1d), ((3, 5), torch.nn.BatchNorm1d),
                                     ((4, 3, 2), torch.nn.BatchNorm2d)])
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(dims, bn):
    r, n = hvd.rank(), hvd.size()
    channels = dims[0]
    sync = hvd.SyncBatchNorm(channels).double()
    ref = bn(channels).double()
    with torch.no_grad():
        for m in (sync, ref):
            m.weight.copy_(torch.linspace(0.5, 1.5, channels, dtype=torch.float64))
            m.bias.copy_(torch.linspace(-1, 1, channels, dtype=torch.float64))
    batches = [_batch(q, dims) for q in range(n)]
    weights = [torch.randn(b.shape, generator=torch.Generator().manual_seed(7 + q), dtype=torch.float64)
               for q, b in enumerate(batches)]
    x = batches[r].clone().requires_grad_(True)
    for _ in range(2):   # twice: the running statistics move
        out = sync(x)
        x.grad = None
        sync.zero_grad()
        (out * weights[r]).sum().backward()
    full = torch.cat(batches).requires_grad_(True)
    for _ in range(2):
        ref_out = ref(full)
        full.grad = None
        ref.zero_grad()
        (ref_out * torch.cat(weights)).sum().backward()
    start = sum(b.shape[0] for b in batches[:r])
    rows = slice(start, start + batches[r].shape[0])
    assert torch.allclose(out, ref_out[rows], atol=1e-10)
    assert torch.allclose(x.grad, full.grad[rows], atol=1e-10)
    assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-12)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-12)
    assert int(sync.num_batches_tracked) == 2
    assert torch.allclose(hvd.allreduce(sync.weight.grad, op=hvd.Sum), ref.weight.grad, atol=1e-10)
    assert torch.allclose(hvd.allreduce(sync.bias.grad, op=hvd.Sum), ref.bias.grad, atol=1e-10)
    # eval mode: the running statistics, nothing exchanged
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(batches[r]), ref(batches[r]), atol=1e-12)


def test_sync_batch_norm_rejects_a_wrong_channel_count():
    with pytest.raises(ValueError, match="channels"):
        hvd.SyncBatchNorm(4)(torch.randn(3, 5))
