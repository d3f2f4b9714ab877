"""The settings every rank of an optimizer's process set must share, compared when it is built.

Ranks that build their ``DistributedOptimizer`` with different settings would otherwise pair
collectives that do not belong together: local steps every 4 steps in one cluster and every 8
in the other exchange step 3 with step 7; an overlapped exchange on some ranks only waits for
peers that never come; two outer optimizers leave the clusters with different parameters and
exit 0. One all-gather of each rank's settings (as words: nothing but strings crosses) at
construction, before any hook or communicator is made, turns all of these into one
``ValueError`` raised on every rank, naming each rank's value, like a mismatched THC width.
"""
import dataclasses

import torch

from ..api.functions import allgather_object
from ..core import state

__all__ = ["settings_of", "check_agreement", "disagreements"]

# hyperparameters of a torch optimizer's groups that are how it runs, not what it computes
_IMPLEMENTATION = ("params", "foreach", "fused", "capturable", "differentiable")


def _comp(c):
    if c is None:
        return "the optimizer's compression"
    settings = getattr(c, "settings", None)
    if callable(settings):
        try:
            return "%s%s" % (c.name, tuple(settings())[1:] or "")
        except TypeError:   # (Horovod's compressors are classes: settings is unbound)
            pass
    return getattr(c, "name", getattr(c, "__name__", type(c).__name__))


def _optimizer(o):
    groups = []
    for g in o.param_groups:
        groups.append(", ".join("%s=%r" % (k, g[k]) for k in sorted(g) if k not in _IMPLEMENTATION))
    return "%s(%s)" % (type(o).__name__, "; ".join(groups))


def _outer(ls, named):
    if ls.outer in ("average", "sum"):
        return ls.outer
    if ls.outer == "nesterov":
        return "nesterov(lr=%r, momentum=%r)" % (ls.outer_lr, ls.outer_momentum)
    # a callable or an optimizer: what it builds, with its hyperparameters
    return _optimizer(ls.outer_optimizer(named))


def _field(value):
    """A settings field as the comparison writes it: compressors (``Adjuster(pseudo_rungs=...)``)
    by their settings."""
    if isinstance(value, tuple) and value and all(callable(getattr(v, "compress", None)) for v in value):
        return "(%s)" % ", ".join(_comp(v) for v in value)
    return repr(value)


def _plain(obj):
    if obj is None:
        return "none"
    if dataclasses.is_dataclass(obj):
        return "%s(%s)" % (type(obj).__name__, ", ".join(
            "%s=%s" % (f.name, _field(getattr(obj, f.name))) for f in dataclasses.fields(obj)
            if f.compare and not isinstance(getattr(obj, f.name), torch.nn.Module)))
    return repr(obj)


def settings_of(spec, named, policy):
    """[(what, value as words)]: what must be equal on every rank of ``spec``'s process set.
    ``named``: [(name, parameter)] (an outer optimizer given as a callable is built over them to
    be described); ``policy``: STELLA_NONFINITE."""
    ls = spec.local_steps
    rows = [("route", spec.route_kind()),
            ("compression", _comp(spec.compression)),
            ("op", getattr(spec.op, "__name__", repr(spec.op))),
            ("engine", _plain(spec.engine)),
            ("adjuster", _plain(spec.adjuster)),
            ("STELLA_NONFINITE", policy),
            ("local_steps", "off" if ls is None else "on")]
    if ls is not None:
        rows += [("local_steps.every", str(ls.every)),
                 ("local_steps.overlap", str(ls.overlap)),
                 ("local_steps.outer", _outer(ls, named)),
                 ("local_steps.compression", _comp(ls.compression)),
                 ("local_steps.fragments", "%d, delay %d, mix %r, groups %s"
                  % (ls.fragments, ls.delay, ls.mix, "balanced" if ls.fragment_groups is None
                     else [list(g) for g in ls.fragment_groups])),
                 ("local_steps.pace", ls.pace),
                 ("local_steps.inner", ls.inner)]
    return rows


def disagreements(per_rank, ranks):
    """The lines naming each setting on which the ranks differ, with each rank's value:
    ``per_rank`` is every rank's :func:`settings_of` (in the order of ``ranks``)."""
    lines = []
    fields = []
    for rows in per_rank:
        for what, _ in rows:
            if what not in fields:
                fields.append(what)
    for what in fields:
        values = {}
        for r, rows in zip(ranks, per_rank):
            values.setdefault(dict(rows).get(what, "(not set)"), []).append(r)
        if len(values) > 1:
            lines.append("  %s: %s" % (what, "; ".join(
                "rank%s %s: %s" % ("s" if len(rs) > 1 else "", _span(rs), v) for v, rs in values.items())))
    return lines


def _span(ranks):
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else "%s, ... (%d ranks)" % (
        ", ".join(map(str, ranks[:6])), len(ranks))


def check_agreement(spec, named):
    """Raise ValueError on every rank of ``spec``'s process set when its ranks built their
    optimizers with different settings (collective over the set; nothing to do outside it or
    alone in it)."""
    pset = spec.process_set
    rt = state.current("hvd.DistributedOptimizer")
    if not pset.included() or pset.size() < 2:
        return
    mine = settings_of(spec, named, rt.config.nonfinite)
    name = rt.auto_name("DistributedOptimizer.settings", pset)
    per_rank = allgather_object(mine, name=name, process_set=pset)
    lines = disagreements(per_rank, list(range(pset.size())) if pset.ranks is None else list(pset.ranks))
    if lines:
        raise ValueError("hvd.DistributedOptimizer: the ranks were given different settings, so their collectives "
                         "would not pair up (refused on every rank):\n%s\nBuild the optimizer with the same "
                         "arguments (and the same STELLA_* environment) on every rank." % "\n".join(lines))
