"""Deep Gradient Compression's momentum correction for SGD with momentum on the sparse route:
``DistributedOptimizer(SGD(..., momentum=m), compression=<sparse>, momentum_correction=True)``.

Without it, the sparse route sends gradients (plus their error-feedback residual) and the user's
SGD applies momentum to the sparse average: an entry that waited k steps in the residual arrives
without the momentum it would have gathered, and the momentum buffer then carries the sparse
arrivals forward. With it (DGC, Lin et al., ICLR 2018), each rank keeps the velocity itself and
the sparse route carries velocities:

    g'  = g + weight_decay * w                 (this rank's gradient, decayed as SGD does)
    u   = momentum * u + (1 - dampening) * g'  (this rank's velocity, kept here; the first step
                                                u = g', as torch's SGD starts its buffer)
    sent = u,  or  g' + momentum * u  with nesterov
    the route: residual += sent; select; residual -= selected (error feedback is DGC's
    accumulation v); the average of the selections over all ranks comes back
    w  -= lr * that average                    (the user's SGD with momentum, dampening and
                                                weight decay switched off for this step only)

So the user's optimizer still means what it says: with density 1.0 (everything sent) the update is
dense momentum SGD's exactly, up to the order of float additions (the average of velocities is the
velocity of the average). ``masking=True`` adds DGC's momentum factor masking: entries of the
velocity whose coordinate came back non-zero (sent by some cluster this step) are zeroed, so a
stale velocity does not keep pushing an entry that was just applied. Masking changes the update
even at density 1 (it drops momentum where everything is sent), so it is off by default and
measured separately.

The velocity is explicit state (``MomentumCorrectionState``: settings, one buffer per parameter,
its own ``state_dict``), saved in the optimizer's ``state_dict()`` under
``"stella_momentum_correction"``. A step refused for a NaN/Inf gradient (STELLA_NONFINITE=skip or
raise) rolls every velocity of that step back on every rank, also those of buckets that went
through, so the non-finite values reach neither the velocity nor the residual (the route refuses
before it selects). The velocities accumulate the gradients as backward left them: with AMP's
GradScaler (scaled gradients, a changing scale) or gradient clipping after ``synchronize()``
the correction carries scaled values and clips velocities; use it with unscaled gradients.
"""
__all__ = ["MomentumCorrectionState"]


class MomentumCorrectionState:
    """The velocity of every parameter and the settings of momentum correction."""

    def __init__(self, masking=False):
        self.masking = bool(masking)
        self.velocity = {}   # parameter name -> tensor like the parameter
        self._backup = {}    # parameter name -> velocity before this step (until the step is agreed)
        self._spare = {}     # parameter name -> a backup tensor no step holds any more (reused: a fresh
        #                      CPU allocation of a bucket's size costs its page faults every step)

    @staticmethod
    def check_group(group, what="momentum_correction"):
        if group.get("momentum", 0.0) <= 0.0:
            return False
        if group.get("maximize", False):
            raise ValueError("%s: SGD with maximize=True is not supported" % what)
        return True

    def transform(self, name, param, grad, group, tag=None):
        """Turn this rank's gradient into what the sparse route sends (in place of ``grad``).
        ``tag`` (the CPU engine's step) keeps one backup per step in flight."""
        m, damp, wd = group["momentum"], group.get("dampening", 0.0), group.get("weight_decay", 0.0)
        g = grad.add(param.detach(), alpha=wd) if wd else grad
        u = self.velocity.get(name)
        if u is None or u.shape != grad.shape or u.device != grad.device:
            u = g.clone()              # torch's SGD starts its buffer at the first gradient (no dampening)
            self.velocity[name] = u
            self._backup[(name, tag)] = None
        else:
            backup = self._spare.pop(name, None)
            if backup is None or backup.shape != u.shape or backup.device != u.device:
                backup = u.new_empty(u.shape)
            self._backup[(name, tag)] = backup.copy_(u)
            u.mul_(m).add_(g, alpha=1.0 - damp)
        if group.get("nesterov", False):
            grad.copy_(g.add(u, alpha=m))
        else:
            grad.copy_(u)

    def applied(self, name, reduced=None, tag=None):
        """The step went through: with masking, zero the velocity where ``reduced`` came back
        non-zero. The backup of this step is dropped (kept for reuse)."""
        backup = self._backup.pop((name, tag), None)
        if backup is not None:
            self._spare[name] = backup
        if self.masking and reduced is not None:
            u = self.velocity.get(name)
            if u is not None:
                u.masked_fill_(reduced != 0, 0.0)

    def refused(self, name, tag=None):
        """The step was refused on every rank (non-finite gradient): restore the velocity from
        before it. With tags, the backups of later steps of ``name`` go too: their velocities
        carried the refused step's values, so those steps are refused as well."""
        if (name, tag) not in self._backup:
            return
        old = self._backup.pop((name, tag))
        if tag is not None:
            for key in [k for k in self._backup if k[0] == name and k[1] is not None and k[1] > tag]:
                del self._backup[key]
        if old is None:
            self.velocity.pop(name, None)
        else:
            self.velocity[name].copy_(old)

    def state_dict(self):
        return {"masking": self.masking, "velocity": {k: v.detach().clone() for k, v in self.velocity.items()}}

    def check(self, state, params):
        """Raise ValueError, naming the parameter, unless ``state`` (a ``state_dict()``) holds
        velocities of the parameters ``params`` ({name: parameter}) with their shapes."""
        velocity = state.get("velocity", {}) if isinstance(state, dict) else None
        if not isinstance(velocity, dict):
            raise ValueError("momentum correction state: expected {'masking': ..., 'velocity': {name: tensor}}, got %r"
                             % (state,))
        for name, v in velocity.items():
            if name not in params:
                raise ValueError("momentum correction state: a velocity of parameter %r, which this optimizer does "
                                 "not hold (its parameters: %s)" % (name, ", ".join(sorted(params))))
            if not hasattr(v, "shape") or tuple(v.shape) != tuple(params[name].shape):
                raise ValueError("momentum correction state: the velocity of parameter %r has shape %s, the "
                                 "parameter %s" % (name, list(getattr(v, "shape", [])), list(params[name].shape)))

    def load_state_dict(self, state):
        self.masking = bool(state.get("masking", self.masking))
        self.velocity = {k: v.detach().clone() for k, v in state.get("velocity", {}).items()}
        self._backup = {}


def plain_sgd_step(optimizer_step, param_groups, closure=None):
    """Run the user's SGD step with momentum, dampening, nesterov and weight decay off in
    ``param_groups`` (the corrected groups: the route already applied them; other groups of the
    optimizer keep theirs), then restore the groups' settings."""
    saved = []
    for g in param_groups:
        saved.append({k: g.get(k) for k in ("momentum", "dampening", "nesterov", "weight_decay")})
        g.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
    try:
        return optimizer_step(closure)
    finally:
        for g, s in zip(param_groups, saved):
            g.update(s)
