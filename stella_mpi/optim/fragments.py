"""Streaming DiLoCo's fragments of local steps (``hvd.LocalSteps(fragments=F)``): which
parameters each fragment holds, its outer optimizer and its exchange, and the one exchange in
flight (optim/outer_sync.py runs the schedule).

The model's trainable parameters are cut into F fragments, each a contiguous run of parameters
in the optimizer's order, balanced by element count: the boundary between fragments k-1 and k
falls after the parameter whose running total of elements comes closest to k/F of the whole (a
greedy cut: each fragment holds at least one parameter, so the sizes are as even as whole
parameters allow). Or the user names them: ``fragment_groups``, F lists of parameter names that
cover every trainable parameter exactly once (in each fragment, the optimizer's order holds).
"""
import bisect

__all__ = ["Fragment", "InFlight", "as_exchange", "balanced_cut", "plan_fragments"]


class Fragment:
    """Fragment ``index`` of ``count``: its [(name, parameter)], its outer torch optimizer, its
    exchange (launch/wait, collectives of its own name) and the exchanges it took."""

    def __init__(self, index, count, named, outer, exchange):
        self.index = index
        self.count = count
        self.named = named
        self.outer = outer
        self.exchange = exchange
        self.exchanges = 0

    @property
    def names(self):
        return [n for n, _ in self.named]

    def describe(self):
        """"fragment 2 of 4 (2.weight to 3.bias)": the words a message names it by (numbered
        from 0, as its collectives' names ``<name>.f<index>`` are)."""
        names = self.names
        span = names[0] if len(names) == 1 else "%s to %s" % (names[0], names[-1])
        return "fragment %d of %d (%s)" % (self.index, self.count, span)


class InFlight:
    """An exchange launched and not yet applied: its fragment, its pending handle, the inner
    steps left before it is applied, the fragment's parameters at the launch (``mix="progress"``;
    else None), and the clock at its launch and at its arrival (None until seen)."""

    def __init__(self, fragment, handle, left, kept=None, launched=0.0):
        self.fragment = fragment
        self.handle = handle
        self.left = left
        self.kept = kept
        self.launched = launched
        self.arrived = None


class _Blocking:
    """A blocking exchange ``deltas -> means`` seen as launch/wait: the launch keeps the deltas,
    the wait exchanges them (the same values, exchanged when they are applied)."""

    def __init__(self, exchange):
        self.exchange = exchange

    def launch(self, deltas):
        return deltas

    def wait(self, pending):
        return self.exchange(pending)

    def drop(self, pending):
        pass


def as_exchange(exchange, index, count, qualified=False):
    """Fragment ``index`` of ``count``'s exchange: ``exchange.fragment(index)`` where it names
    its collectives per fragment (optim/tuning.py; ``qualified``: ``fragment(index, count)``, a
    name that also holds F, for the adjuster's schedules, whose F changes between phases),
    ``exchange`` itself for one fragment; a plain function is wrapped as launch/wait."""
    if count > 1 and hasattr(exchange, "fragment"):
        exchange = exchange.fragment(index, count) if qualified else exchange.fragment(index)
    if hasattr(exchange, "launch"):
        return exchange
    return _Blocking(exchange)


def balanced_cut(sizes, parts):
    """The ``parts - 1`` boundaries (indices into ``sizes``) cutting ``sizes`` into contiguous
    runs balanced by sum: boundary k is the prefix whose sum comes closest to k/parts of the
    whole, at least one entry after the previous boundary and leaving one for each run after."""
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    total, cuts = prefix[-1], []
    for k in range(1, parts):
        lo = (cuts[-1] if cuts else 0) + 1
        hi = len(sizes) - (parts - k)
        target = total * k / parts
        i = bisect.bisect_left(prefix, target, lo, hi + 1)
        best = min((j for j in (i - 1, i) if lo <= j <= hi), key=lambda j: abs(prefix[j] - target), default=lo)
        cuts.append(best)
    return cuts


def plan_fragments(named, fragments, groups=None):
    """[[(name, parameter)] per fragment] of the trainable parameters ``named`` (in the
    optimizer's order): ``groups`` (lists of names) checked against them, or the balanced cut.
    ValueError naming what does not fit."""
    if groups is not None:
        return _named_groups(named, groups)
    if fragments > len(named):
        raise ValueError("LocalSteps(fragments=%d): the optimizer has %d trainable parameters; a fragment holds at "
                         "least one: pass fragments <= %d" % (fragments, len(named), len(named)))
    cuts = [0] + balanced_cut([p.numel() for _, p in named], fragments) + [len(named)]
    return [named[a:b] for a, b in zip(cuts, cuts[1:])]


def fragment_shares(named, fragments):
    """Each fragment's fraction of the entries of ``named`` under the balanced cut into
    ``fragments`` (the adjuster's schedules: the delay hides the largest one's exchange)."""
    sizes = [sum(p.numel() for _, p in part) for part in plan_fragments(named, fragments)]
    total = float(sum(sizes)) or 1.0
    return tuple(n / total for n in sizes)


def _named_groups(named, groups):
    by_name = dict(named)
    order = {n: i for i, (n, _) in enumerate(named)}
    given = [n for g in groups for n in g]
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        raise ValueError("LocalSteps(fragment_groups=...): %s %s not among the optimizer's trainable parameters (%s); "
                         "name them as the optimizer does (named_parameters)"
                         % (", ".join(unknown), "is" if len(unknown) == 1 else "are", ", ".join(order)))
    missing = [n for n in order if n not in set(given)]
    if missing:
        raise ValueError("LocalSteps(fragment_groups=...): %s %s in no fragment; every trainable parameter goes in "
                         "exactly one" % (", ".join(missing), "is" if len(missing) == 1 else "are"))
    return [[(n, by_name[n]) for n in sorted(g, key=order.get)] for g in groups]
