"""Local steps across clusters (``hvd.LocalSteps``): gradients are averaged inside each cluster
at every step, and the clusters meet only every ``every`` steps, as in post-local SGD and
Cloudless-Training (model averaging) or DiLoCo (an outer Nesterov optimizer).

Every step: the synchronous optimizer on the cluster's own process set (dense, fast link), then
the user's optimizer. Every H-th step (after the user's update):

    delta   = anchor - params                     the pseudo-gradient (identical inside a cluster)
    avg     = allreduce(delta, Average, compression)  over all ranks (so: the mean over clusters,
                                                      weighted by cluster size), through the
                                                      optimizer's ``compression``: none, fp16/bf16,
                                                      or sparse with error feedback
    "average":  params = anchor - avg             (model averaging)
    "nesterov": m = mu * m + avg
                params = anchor - outer_lr * (avg + mu * m)   (DiLoCo's outer Nesterov SGD)
    anchor  = params

``anchor`` is taken at the first ``step()`` (after the user's ``broadcast_parameters``), so every
rank starts from the same parameters and, after each outer step, holds the same parameters
again (the all-reduce's result is the same everywhere). With ``every=1``, ``outer="average"`` and
no compression this is synchronous dense training for any optimizer whose update is linear in
the gradient and its own state (SGD with momentum and weight decay): the mean over clusters of
the clusters' velocities follows the same recursion as the velocity of the mean gradient.
Optimizers with a non-linear update (Adam) keep a per-cluster state and are not equivalent, as in
DiLoCo (there, the inner optimizer is AdamW by design).

Not built (yet): overlapping the outer exchange of one period with the next period's local
steps. The CPU engine is refused: it keeps its master copy and optimizer state in shards
spread over the ranks of all clusters, which a cluster-local step cannot update alone.
"""
import itertools
from dataclasses import dataclass

import torch

from ..api.allreduce import compressed_allreduce_async, grouped_allreduce_async
from ..api.functions import broadcast_object
from ..api.handles import synchronize
from ..api.queries import rank
from ..api.reduce_ops import Average
from ..core import state
from ..core.process_sets import ProcessSet, global_process_set

OUTERS = ("average", "nesterov")
_instances = itertools.count()   # names each optimizer's exchange (ranks build optimizers in the same order)


@dataclass(frozen=True)
class LocalSteps:
    """What the user asks for (public name ``hvd.LocalSteps``), passed as
    ``DistributedOptimizer(..., local_steps=hvd.LocalSteps(every=H))``.

    every: local steps between two cross-cluster exchanges (H >= 1).
    outer: "average" (model averaging: ``outer_lr`` and ``outer_momentum`` are not used) or
        "nesterov" (DiLoCo: Nesterov SGD on the averaged pseudo-gradient).
    outer_lr, outer_momentum: the outer optimizer's (DiLoCo uses 0.7 and 0.9).
    """
    every: int
    outer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError("LocalSteps: every must be an int >= 1 (local steps per exchange), got %r"
                             % (self.every,))
        if self.outer not in OUTERS:
            raise ValueError("LocalSteps: outer must be one of %s, got %r" % (", ".join(OUTERS), self.outer))
        if not (isinstance(self.outer_lr, (int, float)) and self.outer_lr > 0):
            raise ValueError("LocalSteps: outer_lr must be > 0, got %r" % (self.outer_lr,))
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ValueError("LocalSteps: outer_momentum must be in [0, 1), got %r" % (self.outer_momentum,))


class LocalStepsState:
    """The outer algorithm's state, one per optimizer: the settings, the anchor (parameters at
    the last exchange) and the outer momentum, keyed by parameter name; ``state_dict`` and
    ``load_state_dict`` for checkpoints."""

    def __init__(self, settings):
        self.settings = settings
        # progress
        self.local_steps = 0      # steps since the last exchange
        self.exchanges = 0        # exchanges done
        # per parameter (by name)
        self.anchor = {}
        self.momentum = {}

    def capture(self, named):
        self.anchor = {n: p.detach().clone() for n, p in named}

    def state_dict(self):
        return {"local_steps": self.local_steps, "exchanges": self.exchanges,
                "anchor": {n: t.clone() for n, t in self.anchor.items()},
                "momentum": {n: t.clone() for n, t in self.momentum.items()}}

    def load_state_dict(self, sd, named):
        """Load ``sd`` for the parameters ``named`` [(name, parameter)]: tensors moved to each
        parameter's device and dtype (as torch's optimizers do), names checked."""
        params = dict(named)
        for what in ("anchor", "momentum"):
            unknown = sorted(set(sd[what]) - set(params))
            if unknown or (what == "anchor" and sd[what] and set(sd[what]) != set(params)):
                raise ValueError("LocalSteps state: %s names %s, the optimizer's parameters are %s"
                                 % (what, unknown or sorted(sd[what]), sorted(params)))
        self.local_steps = int(sd["local_steps"])
        self.exchanges = int(sd["exchanges"])
        self.anchor = {n: t.detach().to(params[n].device, params[n].dtype).clone() for n, t in sd["anchor"].items()}
        self.momentum = {n: t.detach().to(params[n].device, params[n].dtype).clone()
                         for n, t in sd["momentum"].items()}


def cluster_process_set():
    """This rank's cluster as a process set (registered once: every rank registers every
    cluster's set, in cluster order, the first time; later calls find them)."""
    rt = state.current("hvd.LocalSteps")
    topo = global_process_set.topology
    mine = None
    for c, members in enumerate(topo.cluster_members):
        ranks = sorted(global_process_set.ranks[r] for r in members)
        found = [p for p in rt.process_sets.values() if p.ranks == ranks]
        ps = found[0] if found else rt.add_process_set(ProcessSet(ranks))
        if c == topo.cluster_id:
            mine = ps
    return mine


class LocalStepsMixin:
    """What the synchronous optimizer (built on the cluster's process set) gains: the outer
    exchange every ``every`` steps. Mixed in before :class:`.synchronous._DistributedOptimizer`."""

    def _init_local_steps(self, settings, outer_compression):
        self._ls = LocalStepsState(settings)
        self._ls_compression = outer_compression
        self._ls_named = [(self._names[p], p) for p in self._params]
        self._ls_name = "local_steps.%d.delta" % next(_instances)

    def step(self, closure=None):
        if not self._ls.anchor:
            self._ls.capture(self._ls_named)    # the broadcast parameters, before the first update
        loss = super().step(closure)
        self._ls.local_steps += 1
        if self._ls.local_steps >= self._ls.settings.every:
            self._outer_step()
        return loss

    def _outer_step(self):
        s = self._ls.settings
        comp = self._ls_compression
        deltas = [(self._ls.anchor[name] - p.detach()).contiguous() for name, p in self._ls_named]
        if getattr(comp, "sparse", False):   # one fused buffer, one error-feedback residual per shard
            avgs = synchronize(compressed_allreduce_async(deltas, comp, self._ls_name, Average, inplace=True))
        else:
            pairs = [comp.compress(d) for d in deltas]
            out = synchronize(grouped_allreduce_async([c for c, _ in pairs], op=Average, name=self._ls_name))
            avgs = [comp.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs)]
        with torch.no_grad():
            for (name, p), avg in zip(self._ls_named, avgs):
                anchor = self._ls.anchor[name]
                avg = avg.to(anchor.dtype)
                if s.outer == "average":
                    p.copy_(anchor - avg)
                else:
                    m = self._ls.momentum.get(name)
                    if m is None:
                        m = self._ls.momentum[name] = torch.zeros_like(avg)
                    m.mul_(s.outer_momentum).add_(avg)
                    p.copy_(anchor - s.outer_lr * (avg + s.outer_momentum * m))
                anchor.copy_(p)
        self._ls.local_steps = 0
        self._ls.exchanges += 1

    def state_dict(self):
        out = super().state_dict()
        out["stella_local_steps"] = self._ls.state_dict()
        return out

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop("stella_local_steps", None)
        if saved is not None:
            self._ls.load_state_dict(saved, self._ls_named)
        else:   # a checkpoint without local steps: a new period starts from the loaded parameters
            self._ls = LocalStepsState(self._ls.settings)
        return super().load_state_dict(state_dict)

    def _stella_sync_state(self, root_rank):
        """broadcast_optimizer_state: ``root_rank``'s local-steps state on every rank (the
        counters decide when the clusters meet, so they must agree)."""
        mine = self._ls.state_dict() if rank() == root_rank else None
        self._ls.load_state_dict(broadcast_object(mine, root_rank, name="local_steps.state"), self._ls_named)
