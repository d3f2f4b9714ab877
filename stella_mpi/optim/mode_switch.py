"""One optimizer that moves between the synchronous route and local steps
(``DistributedOptimizer(compression=<sparse>, local_steps=hvd.LocalSteps(...),
adjuster=hvd.Adjuster(modes=("sync", "local")))``).

It starts synchronous: every gradient averaged over all ranks, the cross-cluster hop through the
sparse ``compression`` at the adjuster's density (or THC rungs), the user's optimizer stepping on
the average (:mod:`.synchronous`). The adjuster's mode rule (adjust/mode_rule.py), fed the same
values on every rank, switches at the same step everywhere:

* to local steps, after a synchronous decision: the parameters (the same on every rank) become
  the anchor, and from the next step gradients are averaged inside each cluster only, the
  clusters exchanging the pseudo-gradient every H steps through ``LocalSteps.compression``
  (:mod:`.local_steps`; H chosen by the local-steps rule from ``Adjuster.local_steps``, the first
  one predicted by the mode rule);
* back to synchronous, after an exchange (with ``overlap``, after ``sync_clusters()``): every
  rank holds the agreed parameters, and the next step is averaged over all ranks again, from
  the density the adjuster left.

What each mode keeps through the other: the error-feedback residuals of the sparse route and of
a compressed pseudo-gradient (progress not yet sent, sent when the route is back), the
adjuster's estimates and rung (the controller's first decisions after a local phase still take
windows from before it into their medians); the user's optimizer state goes on in both (its
momentum follows the average over all ranks, then over the cluster, and is averaged over all
ranks on the way back). Each local phase starts from the H the mode rule predicts, with the
local-steps rule's history and the outer optimizer's momentum cleared (both belong to the
last phase, possibly thousands of steps before). Momentum correction, density warm-up,
``dense_below``, ``local_clip`` and accumulation rungs are refused: each changes the gradient
route's semantics in a way that local steps do not carry.
"""
import dataclasses
import logging
import math

import torch

from ..adjust.controller import Estimate
from ..adjust.mode_rule import ModeRule
from ..adjust.session import thc_wire_bytes
from ..adjust.settings import MODES
from ..api.allreduce import grouped_allreduce_async
from ..api.functions import broadcast_object
from ..api.handles import synchronize
from ..api.queries import rank
from ..api.reduce_ops import Average
from ..base import timeline
from ..comm.hierarchy import allreduce_bytes
from ..compression import Compression
from ..core.process_sets import global_process_set
from .local_steps import LocalStepsMixin, cluster_process_set
from .synchronous import _DistributedOptimizer

log = logging.getLogger("stella_mpi")


def payload_per_entry(comp, nclusters):
    """Wire bytes one rank sends per shard entry of the pseudo-gradient through ``comp``, as the
    routes count them: THC's summed words and scales; a sparse selection's entries gathered from
    the C - 1 other clusters (its bytes per entry: values and indices); a dense allreduce."""
    if getattr(comp, "homomorphic", False):
        return thc_wire_bytes(comp.bits, nclusters, comp.block_log2)
    if getattr(comp, "sparse", False):
        return (nclusters - 1) * comp.density * _DistributedOptimizer.ENTRY_BYTES.get(comp.name, 6.0)
    width = 2 if comp.name in ("fp16", "bf16") else 4
    n = 1 << 20
    return allreduce_bytes(width * n, nclusters) / n


def pseudo_backlog(controller, est, comp):
    """The backlog ``comp`` leaves on the pseudo-gradient, as the controller counts it for the
    synchronous rung of that compression (none, fp16 and bf16 leave none)."""
    if getattr(comp, "homomorphic", False):
        return controller.backlog(est, 1.0, comp.bits)
    if getattr(comp, "sparse", False):
        return controller.backlog(est, comp.density)
    return 0.0


class ModeSwitchMixin(LocalStepsMixin):
    """Mixed in before :class:`.synchronous._DistributedOptimizer` built on the global process
    set with the sparse compression and the adjuster's session."""

    def _init_modes(self, settings, adjuster):
        pseudo = settings.compression if settings.compression is not None else self._compression
        self._init_local_steps(settings, pseudo, adjuster)
        self._mode = "sync"
        self._sync_route = (self._process_set, self._sparse)
        self._session = self._adjust        # None with one cluster: nothing crosses, nothing to switch
        self._cluster_set = cluster_process_set()
        self.mode_switches = []             # [(step, mode, reason)], the same on every rank
        self.mode_reason = None
        self._mode_rule = None
        if self._session is not None:
            ctrl = self._session.controller
            nclusters = self._process_set.topology.num_clusters
            self._mode_rule = ModeRule(adjuster, ctrl, nclusters, payload_per_entry(pseudo, nclusters),
                                       lambda est: pseudo_backlog(ctrl, est, pseudo))

    @property
    def mode(self):
        """"sync" or "local": the route of the next step."""
        return self._mode

    @property
    def adjust_decisions(self):
        return list(self._session.decisions) if self._session is not None else []

    def step(self, closure=None):
        if self._mode == "local":
            loss = super().step(closure)   # LocalStepsMixin's: the exchange every H steps, H chosen there
            if self._mode_rule is not None and self._mode_rule.mode == "sync":
                self._enter_sync()
            return loss
        session = self._session
        last = session.decisions[-1] if session is not None and session.decisions else None
        loss = _DistributedOptimizer.step(self, closure)
        if session is not None and session.decisions and session.decisions[-1] is not last:
            _, decision = session.decisions[-1]
            if decision.estimate is not None:
                mode, self.mode_reason = self._mode_rule.after_sync(decision.estimate)
                if mode == "local":
                    self._enter_local()
        return loss

    def _choose_every(self, compute_s, exchange_s, wire_s=None):
        super()._choose_every(compute_s, exchange_s, wire_s)
        if self._mode_rule is not None and self._ls_measured is not None:
            compute, exchange, wire = self._ls_measured
            _, self.mode_reason = self._mode_rule.after_local(compute, exchange, self._ls.every, wire)

    def _set_route(self, mode):
        """The route of the next step: the global set with the sparse compression and the
        adjuster's session, or the cluster's set, dense, with the session paused."""
        if mode == "local":
            self._process_set, self._sparse = self._cluster_set, False
            self._compression, self._adjust = Compression.none, None
        else:
            self._process_set, self._sparse = self._sync_route
            self._adjust = self._session
            self._compression = self._session.compression
            self._session.resume()
        self._mode = mode

    def _record(self, mode):
        self.mode_switches.append((self._step_count, mode, self.mode_reason))
        log.info("stella_mpi: from step %d %s (%s)", self._step_count,
                 "local steps" if mode == "local" else "synchronous", self.mode_reason)
        timeline.instant("ADJUST_MODE", step=self._step_count, mode=mode, reason=self.mode_reason)

    def _enter_local(self):
        """After a synchronous step: every rank holds the same parameters, the anchor; H starts
        where the mode rule predicted the local-steps rule would put it."""
        every = self._mode_rule.predicted_every
        self._ls.capture(self._ls_named)
        self._ls.every = every
        self._ls_rule.restart(every)   # the last local phase's times are old
        self._ls.momentum = {}         # and so is its outer momentum
        self._ls.local_steps = 0
        self._ls_period_start = None
        self._ls_in_sync = True
        self._set_route("local")
        self._record("local")

    def _enter_sync(self):
        """After an exchange: complete what is in flight (with overlap), average the user's
        optimizer state over all ranks (each cluster's momentum followed its own gradients), then
        the global route."""
        self.sync_clusters()
        self._average_optimizer_state()
        self._set_route("sync")
        self._record("sync")

    def _average_optimizer_state(self):
        """Every floating-point tensor of the user's optimizer state (SGD's momentum, Adam's
        moments; not its step counts, which agree) averaged over all ranks, weighted by cluster
        size as the pseudo-gradients are: for SGD with momentum the mean of the clusters'
        velocities is the velocity the mean gradient would have built. One dense exchange of the
        state, at the switch only."""
        held = [(p, key) for _, p in self._ls_named for key, t in sorted(self.state.get(p, {}).items())
                if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 0 and key != "step"]
        if not held:
            return
        tensors = [self.state[p][key].contiguous() for p, key in held]
        out = synchronize(grouped_allreduce_async(tensors, op=Average, name="mode_switch.%s.state" % self._ls_name))
        for (p, key), t in zip(held, out):
            self.state[p][key].copy_(t)

    def sync_clusters(self):
        if self._mode == "local":
            super().sync_clusters()

    def consensus_parameters(self):
        if self._mode == "local":
            return super().consensus_parameters()
        return {n: p.detach().clone() for n, p in self._ls_named}

    def _saved_mode(self):
        return {"mode": self._mode,
                "sync_estimate": self._mode_rule.saved_estimate() if self._mode_rule is not None else None}

    def state_dict(self):
        out = super().state_dict()
        out["stella_mode"] = self._saved_mode()
        return out

    def _stella_sync_state(self, root_rank):
        """broadcast_optimizer_state: ``root_rank``'s local-steps state and mode on every rank
        (a checkpoint loaded on the root alone may have changed its mode)."""
        super()._stella_sync_state(root_rank)
        self._take_mode(*_checked_mode(broadcast_object(self._saved_mode() if rank() == root_rank else None,
                                                        root_rank, name="mode_switch.mode")))

    def load_state_dict(self, state_dict):
        """Load a checkpoint, and its mode (a checkpoint without one: synchronous); the
        parameters are taken as loaded, no exchange runs."""
        state_dict = dict(state_dict)
        mode, estimate = _checked_mode(state_dict.pop("stella_mode", {"mode": "sync", "sync_estimate": None}))
        out = super().load_state_dict(state_dict)
        self._take_mode(mode, estimate)
        return out

    def _take_mode(self, mode, estimate):
        """Take ``mode`` (a checkpoint's, the root's) as it is, no exchange run; the mode rule
        gets the synchronous ``estimate`` saved with it (or None)."""
        if self._session is None:
            return
        if mode != self._mode:
            if mode == "local" and not self._ls.anchor:
                self._ls.capture(self._ls_named)
            self._set_route(mode)
        self._mode_rule.take(mode, estimate)


def _checked_mode(saved):
    """(mode, Estimate or None) from a checkpoint's ``stella_mode``; ValueError naming what is
    wrong (before anything is loaded)."""
    what = "DistributedOptimizer checkpoint: stella_mode"
    if not isinstance(saved, dict) or saved.get("mode") not in MODES:
        raise ValueError("%s must be {'mode': one of %s, 'sync_estimate': ...}, got %r" % (what, MODES, saved))
    est = saved.get("sync_estimate")
    if est is None:
        return saved["mode"], None
    fields = {f.name for f in dataclasses.fields(Estimate)}
    if not isinstance(est, dict) or set(est) != fields or not all(
            v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in est.values()):
        raise ValueError("%s: sync_estimate must hold the numbers %s, got %r" % (what, sorted(fields), est))
    return saved["mode"], Estimate(**est)


def check_mode_switch(compression, engine, op, process_set, momentum_correction, density_warmup, dense_below,
                      adjuster, local_steps):
    """Refuse, naming it, what the switching optimizer cannot carry (``local_clip`` with
    ``local_steps`` is refused before, by DistributedOptimizer)."""
    what = "DistributedOptimizer(adjuster=hvd.Adjuster(modes=('sync', 'local')))"
    if local_steps is None:
        raise ValueError("%s switches to local steps: pass local_steps=hvd.LocalSteps(every=..., compression=...)"
                         % what)
    if not getattr(compression, "sparse", False) or getattr(compression, "homomorphic", False):
        raise ValueError("%s: the synchronous route's compression must be sparse (cacheaware, topk, threshold, "
                         "randomk), got %r; THC rungs come from Adjuster(thc_bits=...)" % (what, compression))
    if local_steps.overlap and local_steps.compression is not Compression.none:
        raise ValueError("%s: LocalSteps(overlap=True) sends the pseudo-gradient uncompressed, outside the collective "
                         "thread; pass LocalSteps(compression=hvd.Compression.none, overlap=True) (the optimizer's "
                         "compression is the synchronous route's)" % what)
    for name, value in (("engine", engine), ("momentum_correction", momentum_correction),
                        ("density_warmup", density_warmup), ("dense_below", dense_below)):
        if value:
            raise ValueError("%s: %s=%r is not carried through local steps; leave it out" % (what, name, value))
    if op != Average:
        raise ValueError("%s averages gradients and pseudo-gradients: op must be hvd.Average" % what)
    if process_set is not global_process_set:
        raise ValueError("%s runs over the global process set (its clusters are the local groups)" % what)
    if adjuster.allow_accumulation or adjuster.batch_split:
        raise ValueError("%s: allow_accumulation and batch_split are not carried through local steps" % what)
