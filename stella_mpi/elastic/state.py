"""Horovod's elastic state objects: ``State`` (commit, restore, sync, check_host_updates, reset
callbacks), ``ObjectState`` (plain Python values) and ``TorchState`` (models, optimizers and
``ElasticSampler``s through handlers, any other value as an object).

What differs from Horovod, and why: MPI cannot re-form a job's world in place, so a reset is a
new MPI job (``stellarun --elastic`` starts it) and the committed state has to outlive the
processes. So ``commit()`` also writes the committed state to a node-local file (one per host,
written by the host's first rank; the directory is the launcher's ``STELLA_ELASTIC_DIR``), and the
next job's ranks load the newest commit found on any surviving host and ``sync()`` it from
there to every rank, newcomers included. No shared filesystem is needed. Without
``stellarun --elastic`` nothing is written and the objects behave as Horovod's in memory.

What a commit holds: the model's and the optimizer's ``state_dict`` (so stella's own state that
lives there: momentum-correction velocities, local-steps anchors, the CPU engine's master copy and
optimizer state), samplers, and the user's values. Not held: the sparse route's error-feedback
residuals, which belong to the shard layout of the job that made them (a restore or a new layout
starts them at zero: the entries not yet sent are lost, at density d those of about the last 1/d
steps, mostly small ones), and the adjuster's current density (it starts again from the
optimizer's compressor and re-measures the link). Momentum correction's velocities are each
rank's own; a commit holds the committing rank's, and a sync gives every rank the root's."""
import copy

import torch

from ..api.functions import broadcast_object, broadcast_parameters
from ..api.queries import rank
from ..base.errors import HostsUpdatedInterrupt
from .sampler import ElasticSampler
from .worker import current_job


class State:
    """Tracks state across resets: ``commit()`` saves it (and checks for host changes),
    ``restore()`` rolls back to the last commit, ``sync()`` sends ``root``'s to every rank."""

    def __init__(self):
        self._reset_callbacks = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks):
        """Functions called after every reset (ranks added or removed), before the state is
        synchronized: e.g. to rescale the learning rate to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the state (in memory, and to the host's file under ``stellarun --elastic``),
        then raise ``HostsUpdatedInterrupt`` on every rank if hosts changed."""
        self.save()
        self._commits += 1
        job = current_job()
        if job is not None:
            job.persist(self)
        self.check_host_updates()

    def check_host_updates(self):
        """Raise ``HostsUpdatedInterrupt`` on every rank at once if the launcher announced new
        or removed hosts since this job started (one small broadcast from rank 0)."""
        job = current_job()
        if job is None:
            return
        changed = broadcast_object(job.read_update() if rank() == 0 else None, root_rank=0,
                                   name="elastic.host_updates")
        if changed is not None:
            raise HostsUpdatedInterrupt(skip_sync=changed == "added")

    # what a commit file holds (the subclasses fill these in)
    def snapshot(self):
        """The saved state as plain data (what a commit writes)."""
        raise NotImplementedError()

    def load_snapshot(self, data):
        """Make ``data`` (a snapshot) the saved and the current state."""
        raise NotImplementedError()

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self, root_rank=0):
        raise NotImplementedError()

    def reset(self):
        """Called on a reset before the callbacks (subclasses reset what depends on the ranks)."""


class ObjectState(State):
    """State of plain Python values, given as keyword arguments and exposed as attributes."""

    def __init__(self, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self):
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self, root_rank=0):
        self.save()
        self._saved_state, self._commits = broadcast_object((self._saved_state, self._commits), root_rank=root_rank,
                                                            name="elastic.objects")
        self._set_attrs()

    def snapshot(self):
        return {"objects": copy.deepcopy(self._saved_state), "commits": self._commits}

    def load_snapshot(self, data):
        self._saved_state = data["objects"]
        self._commits = data["commits"]
        self._set_attrs()

    def _set_attrs(self):
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))


class _Handler:
    """Saves, restores and syncs one value with a state_dict (model, optimizer, sampler)."""

    def __init__(self, value):
        self.value = value
        self.saved = None
        self.save()

    def save(self):
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self, root_rank, name):
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=root_rank,
                                                    name="elastic.%s" % name))


class _OptimizerHandler(_Handler):
    def sync(self, root_rank, name):
        # an optimizer whose state is sharded over the ranks (the CPU engine) syncs all of it from
        # what the root loaded: a state_dict() there is collective, and only the root has loaded
        if getattr(self.value, "_stella_sharded_state", False):
            self.value._stella_sync_state(root_rank)
        else:
            super().sync(root_rank, name)


class _ModelHandler(_Handler):
    def sync(self, root_rank, name):
        broadcast_parameters(self.value.state_dict(), root_rank=root_rank)


HANDLERS = [(torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler), (ElasticSampler, _Handler)]


class TorchState(ObjectState):
    """Models, optimizers (``hvd.DistributedOptimizer`` included) and ``ElasticSampler``s are
    saved through their ``state_dict``; every other keyword is a plain value."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for k, v in kwargs.items():
            cls = next((h for t, h in HANDLERS if isinstance(v, t)), None)
            if cls is not None:
                handlers[k] = cls(v)
            else:
                plain[k] = v
        object.__setattr__(self, "_handlers", handlers)
        for k, h in handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**plain)

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        object.__setattr__(self, name, value)

    def save(self):
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self):
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self, root_rank=0):
        for name, h in self._handlers.items():
            h.sync(root_rank, name)
        super().sync(root_rank)   # (its save() saves the synced handlers too)

    def reset(self):
        for h in self._handlers.values():
            if isinstance(h.value, ElasticSampler):
                h.value.reset()

    def snapshot(self):
        out = super().snapshot()
        out["handlers"] = {k: h.saved for k, h in self._handlers.items()}
        return out

    def load_snapshot(self, data):
        for k, sd in data["handlers"].items():
            if k in self._handlers:
                self._handlers[k].saved = sd
                self._handlers[k].restore()
        super().load_snapshot(data)

