"""``hvd.SyncBatchNorm``: batch normalization over the batches of every rank of a process set.

In training, the statistics of each channel come from the whole process set's batch. That
batch may be split unevenly, since each rank's count is weighed in. In the backward pass, the
gradient of the input takes the whole batch into account too. As in Horovod, the gradients of
``weight`` and ``bias`` stay local, and DistributedOptimizer reduces them like any other.

Both steps run over the two-level route:
- forward: one allgather of each rank's count, mean and sum of squared deviations, combined
  exactly (Chan et al.), in float64;
- backward: one allreduce of the sums of ``dy`` and ``dy * (x - mean)``.

In eval mode with running statistics, nothing is exchanged. Unlike Horovod's, which refuses CPU
input, it takes CPU and CUDA tensors alike (plain torch operations).
"""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..core.process_sets import global_process_set
from .allgather import allgather
from .allreduce import allreduce
from .reduce_ops import Sum


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``hvd.SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats)``,
    plus ``process_set``: the ranks whose batches are normalized together."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def _run_bn(self, input):
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training or not self.track_running_stats, self.momentum, self.eps)

    def forward(self, input):
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError("SyncBatchNorm: the input has %d channels (dim 1), the layer %d"
                             % (input.size(1), self.num_features))
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:   # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return self._run_bn(input)
        if self.process_set.size() in (None, 1) or not self.process_set.included():
            return self._run_bn(input)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean if self.training else None,
                                      self.running_var if self.training else None, self.eps, factor,
                                      self.process_set)


def _channels_last(x):
    """(C, everything else): the per-channel view of an (N, C, ...) tensor."""
    return x.transpose(0, 1).reshape(x.size(1), -1)


def _shape(x):
    return [1, -1] + [1] * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor, process_set):
        x = input.contiguous()
        per_channel = _channels_last(x).to(torch.float64)
        count = per_channel.size(1)
        mean = per_channel.mean(1) if count else torch.zeros(x.size(1), dtype=torch.float64, device=x.device)
        m2 = ((per_channel - mean[:, None]) ** 2).sum(1)
        row = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device), mean, m2])
        rows = allgather(row[None].cpu(), name="sync_batch_norm.stats.%d" % x.size(1), process_set=process_set).to(x.device)
        counts, means, m2s = rows[:, 0], rows[:, 1:1 + x.size(1)], rows[:, 1 + x.size(1):]
        total = counts.sum()
        if total <= 1:
            raise ValueError("SyncBatchNorm: expected more than 1 value per channel over the process set's batch "
                             "(got %d)" % int(total))
        gmean = (counts[:, None] * means).sum(0) / total
        gm2 = (m2s + counts[:, None] * (means - gmean) ** 2).sum(0)
        var = gm2 / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(gmean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((gm2 / (total - 1)).to(running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(var + eps)
        mean_c, invstd_c = gmean.to(x.dtype), invstd.to(x.dtype)
        out = (x - mean_c.view(_shape(x))) * invstd_c.view(_shape(x))
        if weight is not None:
            out = out * weight.view(_shape(x)) + bias.view(_shape(x))
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.total = float(total)
        ctx.process_set = process_set
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        dy = grad_output.contiguous()
        shape = _shape(x)
        xmu = x - mean.view(shape)
        sum_dy = _channels_last(dy).sum(1)
        sum_dy_xmu = _channels_last(dy * xmu).sum(1)
        grad_weight = grad_bias = grad_input = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * invstd
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        if ctx.needs_input_grad[0]:
            sums = allreduce(torch.cat([sum_dy, sum_dy_xmu]).cpu(), op=Sum, name="sync_batch_norm.grad_sums.%d" % x.size(1),
                             process_set=ctx.process_set).to(x.device)
            c = x.size(1)
            mean_dy = (sums[:c] / ctx.total).view(shape)
            mean_dy_xmu = (sums[c:] / ctx.total).view(shape)
            scale = invstd.view(shape) if weight is None else (invstd * weight).view(shape)
            grad_input = (dy - mean_dy - xmu * (invstd ** 2).view(shape) * mean_dy_xmu) * scale
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
