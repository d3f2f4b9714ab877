"""Buckets, shared by every gradient route (synchronous and CPU engine): parameter names and
their checks, the bucket plan, the gradient hooks and the launch order.

Gradients are handed over by a post-accumulate hook on each parameter as soon as backward
produces them. Parameters are cut into buckets in reverse registration order (roughly the
order backward produces them), at most ``STELLA_FUSION_THRESHOLD`` bytes each, one dtype and
device per bucket (or the user's ``groups``). Buckets are launched strictly in bucket order,
each once all its gradients are ready, so that every rank submits the same collectives in the
same order whatever order its hooks fire in.
"""
import torch

from ..comm.buffers import split_counts


def parameter_names(param_groups, named_parameters):
    """{parameter: name}: the user's ``named_parameters`` (Horovod's checks: (name, parameter)
    tuples, unique names, every parameter of the optimizer named), or Horovod's default names
    ``allreduce.noname.<group>.<index>``."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [("allreduce.noname.%d.%d" % (i, j), p)
                            for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named_parameters]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s" % ", ".join(dups))
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [id(p) for g in param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: %s" % ", ".join(str(i) for i in unnamed))
    return {p: n for n, p in named_parameters}


class Bucket:
    """Parameters whose gradients travel as one buffer; ``pending``: those whose gradient of
    this step is not final yet."""

    def __init__(self, index, params, group_index=0):
        self.index = index
        self.params = params
        self.group_index = group_index
        self.numel = sum(p.numel() for p in params)
        self.pending = set(params)

    def name(self, prefix, names):
        """The collective name of this bucket (the same on every rank)."""
        return "%s.%d.%s" % (prefix, self.index, names[self.params[0]])


def plan_by_size(sequences, cap):
    """Cut each sequence of parameters, in order, into buckets of at most ``cap`` bytes (a
    larger parameter is a bucket of its own), never mixing dtypes or devices nor crossing from
    one sequence into the next. Returns [(sequence index, parameters)]."""
    out = []
    for si, seq in enumerate(sequences):
        cur, nbytes = [], 0
        for p in seq:
            size = p.numel() * p.element_size()
            if cur and (nbytes + size > cap or p.dtype != cur[0].dtype or p.device != cur[0].device):
                out.append((si, cur))
                cur, nbytes = [], 0
            cur.append(p)
            nbytes += size
        if cur:
            out.append((si, cur))
    return out


def plan_pseudo_gradient_buckets(deltas, cap):
    """Local steps' sparse or THC pseudo-gradient exchange: ``deltas`` (parameter order) cut by
    :func:`plan_by_size` into buckets of at most ``cap`` bytes. Returns the buckets' lists, in
    launch order. Pure, as :func:`plan_gradient_buckets` (stella_mpi/plan/wire.py plans with
    meta tensors)."""
    return [b for _, b in plan_by_size([list(deltas)], cap)]


def plan_gradient_buckets(params, cap):
    """The synchronous routes' default plan: ``params`` (in registration order) taken in reverse
    (roughly the order backward produces them) and cut by :func:`plan_by_size` into buckets of
    at most ``cap`` bytes. Returns the buckets' parameter lists, in launch order. Pure: it reads
    ``numel()``, ``element_size()``, ``dtype`` and ``device`` only (meta tensors will do:
    stella_mpi/plan/wire.py plans with them)."""
    return [b for _, b in plan_by_size([list(reversed(params))], cap)]


def plan_by_groups(params, groups):
    """Horovod's ``groups``: an int (that many buckets of consecutive parameters, in reverse
    order) or a list of lists of parameters (each a bucket; the others one bucket each); then
    split so that a bucket holds one dtype and one device."""
    ordered = list(reversed(params))
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        buckets, start = [], 0
        for n in split_counts(len(ordered), groups):
            buckets.append(ordered[start:start + n])
            start += n
    else:
        seen, buckets = set(), []
        for g in groups:
            if any(not isinstance(p, torch.Tensor) for p in g):
                raise ValueError("groups must consist of torch.Tensor.")
            if any(id(p) in seen for p in g):
                raise ValueError("A parameter can only appear once in groups.")
            seen.update(id(p) for p in g)
            buckets.append([p for p in g if p.requires_grad])
        buckets += [[p] for p in ordered if id(p) not in seen]
    split = []
    for b in buckets:
        by_kind = {}
        for p in b:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        split.extend(by_kind.values())
    return [b for b in split if b]


class BucketedOptimizer:
    """Mixin of the DistributedOptimizer: hooks hand gradients over, buckets launch in order.

    The gradient route implements ``launch(bucket)`` and ``grad_ready(p)``; the optimizer calls
    :meth:`_hook_parameters` once, :meth:`_use_buckets` whenever a route brings its own plan,
    :meth:`_launch_remaining` when the step's gradients must all go, and :meth:`_start_step`
    when a new step's gradients begin to arrive."""
    _hooks = ()

    def _hook_parameters(self, params):
        """Put the post-accumulate hook on ``params`` (once: a new route reuses them)."""
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _use_buckets(self, buckets):
        self._buckets = buckets
        self._bucket_of = {p: b for b in buckets for p in b.params}
        self._next_launch = 0

    def _on_grad_ready(self, p):
        self._route.grad_ready(p)

    def _grad_final(self, p):
        """``p``'s gradient of this step is final: launch every bucket that is now complete
        (unless the route sends its buckets at synchronize only)."""
        self._bucket_of[p].pending.discard(p)
        if self._route.launch_in_backward():
            self._launch_in_order()

    def _launch_in_order(self, force=False):
        """Launch the buckets strictly in bucket order, each once all its gradients are ready
        (all of them with ``force``)."""
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending and not force:
                return
            self._route.launch(bucket)
            self._next_launch += 1

    def _launch_remaining(self):
        """Launch every bucket of this step not launched yet (e.g. parameters without gradient)."""
        self._launch_in_order(force=True)

    def _start_step(self):
        self._next_launch = 0
        for b in self._buckets:
            b.pending = set(b.params)
