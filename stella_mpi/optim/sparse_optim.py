"""Sparse optimizers on CPU float32 parameters: the C kernels of ``c_src/stella_optim.h``.

:class:`SparseSGD`, :class:`SparseAdam` and :class:`SparseAdamW` take the hyper-parameters of
``torch.optim.SGD`` / ``Adam`` / ``AdamW`` and, at each :meth:`~SparseOptimizer.step`, one sparse
gradient per parameter: ``(indices, values)`` with int32 indices strictly ascending into the
flattened parameter and float32 values (or ``None`` for no entry).

``mode="exact"``: the parameters and state equal what the dense torch optimizer would hold when
fed, at every step, the dense gradient that is ``values`` at ``indices`` and 0 elsewhere. Listed
coordinates are brought up to date when they are listed; the others lag (a per-coordinate
last-step counter, int32) until :meth:`~SparseOptimizer.catch_up`. **Call ``catch_up()`` before
reading the parameters** (or pass ``catch_up=True`` to ``step``, which leaves every coordinate
current at the cost of a pass over the whole tensor). Changing a hyper-parameter catches up
first, because the replayed steps use the hyper-parameters in force when they are replayed.

``mode="lazy"``: like TensorFlow's LazyAdam: a listed coordinate takes one step of the rule with
its gradient (Adam's bias corrections use the optimizer's global step); an unlisted coordinate
does not change at all (no momentum decay, no weight decay).

With a :class:`stella_mpi._native.pool.CpuPool` the work is split over its pinned workers (inside
each tensor by blocks of 16 floats and across tensors); without one it runs on the calling
thread. Either way a step whose list is malformed (not ascending, out of range) raises
``ValueError`` and changes nothing.
"""
import numpy as np
import torch

from .._native import check, ffi, lib
from .._native.buffers import pointer

MODES = {"lazy": lib.STELLA_OPTIM_LAZY, "exact": lib.STELLA_OPTIM_EXACT}
MAX_NUMEL = int(lib.STELLA_SPARSE_MAX_N)


def _as_index(idx, what):
    """int32 view of an index tensor/array (int64 is converted when it fits)."""
    if isinstance(idx, np.ndarray):
        if idx.dtype == np.int64:
            if idx.size and (idx.min() < 0 or idx.max() >= 2 ** 31):
                raise ValueError("%s: index out of the int32 range" % what)
            idx = idx.astype(np.int32)
        return idx
    if isinstance(idx, torch.Tensor) and idx.dtype == torch.int64:
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= 2 ** 31):
            raise ValueError("%s: index out of the int32 range" % what)
        idx = idx.to(torch.int32)
    return idx


def _explain_bad_list(idx, n, what):
    """A precise message for a list the C core refused as malformed."""
    a = idx.numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
    a = a.astype(np.int64) & 0xFFFFFFFF if a.dtype == np.int32 else a.astype(np.int64)
    over = np.nonzero(a >= n)[0]
    if over.size:
        j = int(over[0])
        return "%s: index %d at position %d is out of range for a parameter of %d elements" % (what, a[j], j, n)
    down = np.nonzero(np.diff(a) <= 0)[0]
    if down.size:
        j = int(down[0])
        return ("%s: indices must be strictly ascending; position %d holds %d after %d"
                % (what, j + 1, a[j + 1], a[j]))
    return "%s: malformed index list" % what


class _ParamState:
    """A parameter's flat view, its state buffers and the C struct pointing at them."""

    def __init__(self, param, i):
        if not isinstance(param, torch.Tensor):
            raise TypeError("parameter %d must be a torch tensor, got %s" % (i, type(param).__name__))
        if param.dtype != torch.float32 or param.device.type != "cpu" or not param.is_contiguous():
            raise ValueError("parameter %d must be a contiguous float32 CPU tensor, got %s %s%s"
                             % (i, param.dtype, param.device, "" if param.is_contiguous() else " (not contiguous)"))
        if param.numel() > MAX_NUMEL:
            raise ValueError("parameter %d has %d elements; the sparse kernels take at most %d"
                             % (i, param.numel(), MAX_NUMEL))
        self.param = param
        self.flat = param.detach().view(-1)
        self.n = self.flat.numel()
        self.bufs = {}
        self.last = None
        self.struct = ffi.new("stella_optim_tensor *")

    def buffer(self, name):
        if name not in self.bufs:
            self.bufs[name] = torch.zeros(self.n, dtype=torch.float32)
        return self.bufs[name]

    def bind(self, names, exact):
        """Point the struct at the buffers ``names`` (buf1, buf2, buf3 order; None = unused)."""
        s = self.struct
        s.n = self.n
        s.param = pointer(self.flat, torch.float32, "parameter", writable=True)[0]
        for slot, name in zip(("buf1", "buf2", "buf3"), names):
            setattr(s, slot, pointer(self.buffer(name), torch.float32, "state %r" % name, writable=True)[0]
                    if name else ffi.NULL)
        if exact and self.last is None:
            self.last = torch.zeros(self.n, dtype=torch.int32)
        s.last = (ffi.cast("int32_t *", pointer(self.last, torch.int32, "last-step counters", writable=True)[0])
                  if exact else ffi.NULL)


class PendingStep:
    """A step submitted to a pool. :meth:`wait` raises what the step raised."""

    def __init__(self, opt, pool, step, keep):
        self._opt, self._pool, self._step, self._keep = opt, pool, step, keep
        self.done = pool is None

    def wait(self, timeout_ms=-1):
        if self.done:
            return
        try:
            self._pool.wait(timeout_ms)
        except TimeoutError:
            raise
        except ValueError as e:
            self.done = True
            self._opt._pending = None
            self._opt._failed(self._step, e)
        self.done = True
        self._opt._pending = None


class SparseOptimizer:
    """Base of the sparse optimizers (see the module docstring)."""

    KIND = None
    _HP_NAMES = ()

    def __init__(self, params, mode="exact", **hp):
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        if not params:
            raise ValueError("the optimizer got an empty parameter list")
        if mode not in MODES:
            raise ValueError("mode must be 'exact' or 'lazy', not %r" % (mode,))
        self.mode = mode
        self.step_count = 0
        self._hp = dict(hp)
        self._states = [_ParamState(p, i) for i, p in enumerate(params)]
        self._pending = None
        self._rebind()

    # ---- hyper-parameters

    @property
    def params(self):
        return [s.param for s in self._states]

    @property
    def hparams(self):
        return dict(self._hp)

    def _buffer_names(self):
        raise NotImplementedError

    def _fill(self, h):
        raise NotImplementedError

    def _rebind(self):
        h = ffi.new("stella_optim_hparams *")
        h.kind = self.KIND
        h.mode = MODES[self.mode]
        self._fill(h)
        self._hstruct = h
        names = self._buffer_names()
        for s in self._states:
            s.bind(names, self.mode == "exact")
            rc = lib.stella_optim_check(h, s.struct)
            if rc == lib.STELLA_ERR_ARG:
                raise ValueError("%s: invalid hyper-parameters %s" % (type(self).__name__, self._hp))
            check(rc, "stella_optim_check")

    def set_hparams(self, **kw):
        """Change hyper-parameters (e.g. ``lr``) from the next step on. EXACT catches every
        coordinate up first, under the old values."""
        unknown = set(kw) - set(self._HP_NAMES)
        if unknown:
            raise TypeError("unknown hyper-parameter(s) %s; %s has %s"
                            % (sorted(unknown), type(self).__name__, list(self._HP_NAMES)))
        new = dict(self._hp)
        new.update(kw)
        if new == self._hp:
            return
        self._no_pending()
        if self.mode == "exact" and self.step_count > 0:
            self.catch_up()
        old = self._hp
        self._hp = new
        try:
            self._rebind()
        except Exception:
            self._hp = old
            self._rebind()
            raise

    def __getattr__(self, name):
        if name in type(self)._HP_NAMES and "_hp" in self.__dict__:
            return self.__dict__["_hp"][name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in type(self)._HP_NAMES:
            self.set_hparams(**{name: value})
        else:
            object.__setattr__(self, name, value)

    # ---- steps

    def _no_pending(self):
        if self._pending is not None and not self._pending.done:
            raise RuntimeError("a step is still running on the CPU pool: wait() for it first")

    def _lists(self, grads):
        if len(grads) != len(self._states):
            raise ValueError("step got %d gradients for %d parameters" % (len(grads), len(self._states)))
        out = []
        for i, (s, g) in enumerate(zip(self._states, grads)):
            if g is None:
                out.append(None)
                continue
            idx, val = g
            what = "gradient of parameter %d" % i
            idx = _as_index(idx, what)
            ip, k = pointer(idx, torch.int32, what + " indices")
            vp, kv = pointer(val, torch.float32, what + " values")
            if k != kv:
                raise ValueError("%s: %d indices but %d values" % (what, k, kv))
            out.append((ip, vp, k, idx, val) if k else None)
        return out

    def _validate(self, lists, step):
        for i, (s, l) in enumerate(zip(self._states, lists)):
            if l is None:
                continue
            rc = lib.stella_optim_validate(self._hstruct, s.struct, l[0], l[2], step)
            self._raise_list(rc, i, s, l, step)

    def _raise_list(self, rc, i, s, l, step):
        if rc == lib.STELLA_OK:
            return
        what = "gradient of parameter %d" % i
        if rc == lib.STELLA_ERR_MALFORMED:
            raise ValueError(_explain_bad_list(l[3], s.n, what))
        if rc == lib.STELLA_ERR_ARG and self.mode == "exact":
            raise ValueError("%s: a listed coordinate is not behind step %d (corrupt last-step counters?)"
                             % (what, step))
        check(rc, what)

    def step(self, grads, pool=None, catch_up=False, timeout_ms=-1):
        """Apply one step (``grads``: one ``(indices, values)`` or ``None`` per parameter).
        ``catch_up=True`` (EXACT) also brings every unlisted coordinate to this step."""
        pending = self.submit_step(grads, pool=pool, catch_up=catch_up)
        pending.wait(timeout_ms)

    def submit_step(self, grads, pool=None, catch_up=False):
        """Start a step; with a pool it runs on the workers and the caller gets a
        :class:`PendingStep` to ``wait()`` on (the gradients must stay alive until then)."""
        self._no_pending()
        lists = self._lists(grads)
        step = self.step_count + 1
        if step > lib.STELLA_OPTIM_MAX_STEP:
            raise OverflowError("step counter exhausted")
        exact = self.mode == "exact"
        if pool is None:
            self._validate(lists, step)  # every list checked before any tensor changes
            for i, (s, l) in enumerate(zip(self._states, lists)):
                if l is not None:
                    rc = lib.stella_optim_apply(self._hstruct, s.struct, l[0], l[1], l[2], 0, l[2], step)
                    self._raise_list(rc, i, s, l, step)
                if exact and catch_up:
                    check(lib.stella_optim_catch_up(self._hstruct, s.struct, 0, s.n, step), "catch_up")
            self.step_count = step
            return PendingStep(self, None, step, None)
        ops = []
        for s, l in zip(self._states, lists):
            if exact and catch_up:
                ops.append((lib.STELLA_TASK_APPLY_CATCH_UP if l else lib.STELLA_TASK_CATCH_UP, s, l))
            elif l is not None:
                ops.append((lib.STELLA_TASK_APPLY, s, l))
        tasks = self._tasks(ops, step)
        self.step_count = step
        try:
            pool.submit(tasks, keepalive=(lists, grads, self._hstruct))
        except Exception:
            self.step_count = step - 1
            raise
        self._lists_in_flight = lists
        self._pending = PendingStep(self, pool, step, lists)
        return self._pending

    def _failed(self, step, err):
        """A pool step was refused (nothing was written): undo the counter, explain."""
        self.step_count = step - 1
        lists = getattr(self, "_lists_in_flight", None)
        if lists is not None:
            for i, (s, l) in enumerate(zip(self._states, lists)):
                if l is not None:
                    self._raise_list(lib.stella_optim_validate(self._hstruct, s.struct, l[0], l[2], step), i, s, l, step)
        raise err

    def _tasks(self, ops, step):
        tasks = ffi.new("stella_pool_task[]", len(ops))
        for j, (op, s, l) in enumerate(ops):
            t = tasks[j]
            t.op = op
            t.hp = self._hstruct[0]
            t.tensor = s.struct[0]
            if l is not None:
                t.idx, t.val, t.k = l[0], l[1], l[2]
            t.lo, t.hi, t.step = 0, s.n, step
        return tasks

    def catch_up(self, pool=None, timeout_ms=-1):
        """EXACT: bring every coordinate to the current step (do it before reading the
        parameters). LAZY: nothing to do."""
        self._no_pending()
        if self.mode != "exact" or self.step_count == 0:
            return
        if pool is None:
            for s in self._states:
                check(lib.stella_optim_catch_up(self._hstruct, s.struct, 0, s.n, self.step_count), "catch_up")
            return
        tasks = self._tasks([(lib.STELLA_TASK_CATCH_UP, s, None) for s in self._states], self.step_count)
        pool.run(tasks, keepalive=(self._hstruct,), timeout_ms=timeout_ms)

    def lookahead(self, outs=None, caught_up=False):
        """The parameters one more step ahead with a zero gradient: the part of the next update
        that is already known (momentum, weight decay) before the next gradient arrives. Used by
        the CPU engine to predict the weights a one-step-stale forward should have. EXACT only,
        after at least one step (every coordinate is caught up first). Written into ``outs``
        (one float32 tensor per parameter, shaped like it) or into new tensors; returns them.
        ``caught_up=True`` skips the catch-up pass (the last step had ``catch_up=True``)."""
        if self.mode != "exact":
            raise ValueError("lookahead needs mode='exact' (lazy coordinates do not move without a gradient)")
        if self.step_count == 0:
            raise ValueError("lookahead needs at least one step (there is no optimizer state yet)")
        if not caught_up:
            self.catch_up()
        else:
            self._no_pending()
        if outs is None:
            outs = [torch.empty_like(s.flat) for s in self._states]
        with torch.no_grad():
            for s, out in zip(self._states, outs):
                self._lookahead_one(s, out.view(-1))
        return outs

    def _lookahead_one(self, s, out):
        raise NotImplementedError

    def moves_without_gradient(self):
        """Whether a zero-gradient step changes the parameters (else lookahead is a copy)."""
        return True

    # ---- checkpoints

    def state_dict(self, catch_up=True):
        """Hyper-parameters, step and per-parameter state (cloned). EXACT catches up first
        unless ``catch_up=False`` (the last-step counters are saved either way)."""
        self._no_pending()
        if catch_up:
            self.catch_up()
        state = []
        for s in self._states:
            d = {name: buf.clone().view_as(s.param) for name, buf in s.bufs.items()}
            if s.last is not None:
                d["last_step"] = s.last.clone().view_as(s.param)
            state.append(d)
        return {"optimizer": type(self).__name__, "mode": self.mode, "step": self.step_count,
                "hparams": dict(self._hp), "state": state}

    def load_state_dict(self, sd):
        self._no_pending()
        if sd.get("optimizer") != type(self).__name__ or sd.get("mode") != self.mode:
            raise ValueError("state of a %s (%s) cannot be loaded into a %s (%s)"
                             % (sd.get("optimizer"), sd.get("mode"), type(self).__name__, self.mode))
        if len(sd["state"]) != len(self._states):
            raise ValueError("state has %d parameters, the optimizer %d" % (len(sd["state"]), len(self._states)))
        for i, (s, d) in enumerate(zip(self._states, sd["state"])):
            for name, t in d.items():
                if t.numel() != s.n:
                    raise ValueError("state %r of parameter %d has %d elements, the parameter %d"
                                     % (name, i, t.numel(), s.n))
        self._hp = dict(sd["hparams"])
        for s, d in zip(self._states, sd["state"]):
            s.bufs = {}
            for name, t in d.items():
                if name == "last_step":
                    s.last = t.detach().to(torch.int32).reshape(-1).clone()
                else:
                    s.bufs[name] = t.detach().to(torch.float32).reshape(-1).clone()
        self.step_count = int(sd["step"])
        self._rebind()


class SparseSGD(SparseOptimizer):
    """``torch.optim.SGD`` on sparse gradients. State: ``momentum_buffer``."""

    KIND = lib.STELLA_OPTIM_SGD
    _HP_NAMES = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 maximize=False, mode="exact"):
        super().__init__(params, mode, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)

    def _buffer_names(self):
        return ("momentum_buffer" if self._hp["momentum"] != 0 else None, None, None)

    def _fill(self, h):
        hp = self._hp
        h.lr, h.momentum, h.dampening, h.weight_decay = (float(hp["lr"]), float(hp["momentum"]),
                                                         float(hp["dampening"]), float(hp["weight_decay"]))
        h.flags = (lib.STELLA_OPTIM_NESTEROV if hp["nesterov"] else 0) | (lib.STELLA_OPTIM_MAXIMIZE if hp["maximize"] else 0)

    def moves_without_gradient(self):
        return bool(self._hp["momentum"] or self._hp["weight_decay"])

    def _lookahead_one(self, s, out):
        hp = self._hp
        w = s.flat
        mu, wd = float(hp["momentum"]), float(hp["weight_decay"])
        if not wd:  # the common case in one pass: w - lr * mu * buf (nesterov: mu**2)
            if mu:
                torch.add(w, s.bufs["momentum_buffer"], alpha=-float(hp["lr"]) * mu * (mu if hp["nesterov"] else 1.0),
                          out=out)
            else:
                out.copy_(w)
            return
        d = w * wd
        if mu:
            buf = s.bufs["momentum_buffer"] * mu + d * (1.0 - float(hp["dampening"]))
            d = d + buf * mu if hp["nesterov"] else buf
        torch.add(w, d, alpha=-float(hp["lr"]), out=out)


class SparseAdam(SparseOptimizer):
    """``torch.optim.Adam`` on sparse gradients (weight decay added to the gradient).
    State: ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` (amsgrad)."""

    KIND = lib.STELLA_OPTIM_ADAM
    _HP_NAMES = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    _DEFAULT_WD = 0.0

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, amsgrad=False,
                 maximize=False, mode="exact"):
        super().__init__(params, mode, lr=lr, betas=tuple(betas), eps=eps,
                         weight_decay=self._DEFAULT_WD if weight_decay is None else weight_decay,
                         amsgrad=amsgrad, maximize=maximize)

    def _buffer_names(self):
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq" if self._hp["amsgrad"] else None)

    def _fill(self, h):
        hp = self._hp
        b1, b2 = hp["betas"]
        h.lr, h.beta1, h.beta2, h.eps, h.weight_decay = (float(hp["lr"]), float(b1), float(b2), float(hp["eps"]),
                                                         float(hp["weight_decay"]))
        h.flags = (lib.STELLA_OPTIM_AMSGRAD if hp["amsgrad"] else 0) | (lib.STELLA_OPTIM_MAXIMIZE if hp["maximize"] else 0)

    def _lookahead_one(self, s, out):
        hp = self._hp
        b1, b2 = (float(b) for b in hp["betas"])
        lr, wd, w = float(hp["lr"]), float(hp["weight_decay"]), s.flat
        t = self.step_count + 1
        m, v = s.bufs["exp_avg"] * b1, s.bufs["exp_avg_sq"] * b2
        if self.KIND == lib.STELLA_OPTIM_ADAMW:
            base = w * (1.0 - lr * wd)
        else:
            base = w
            if wd:
                g = w * wd
                m.add_(g, alpha=1.0 - b1)
                v.addcmul_(g, g, value=1.0 - b2)
        if hp["amsgrad"]:
            v = torch.maximum(s.bufs["max_exp_avg_sq"], v)
        denom = v.sqrt_().div_((1.0 - b2 ** t) ** 0.5).add_(float(hp["eps"]))
        torch.addcdiv(base, m, denom, value=-lr / (1.0 - b1 ** t), out=out)


class SparseAdamW(SparseAdam):
    """``torch.optim.AdamW`` on sparse gradients (decoupled weight decay, default 1e-2)."""

    KIND = lib.STELLA_OPTIM_ADAMW
    _DEFAULT_WD = 1e-2
