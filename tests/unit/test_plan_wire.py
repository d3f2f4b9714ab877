"""The wire model (stella_mpi/plan/wire.py) on small layouts computed by hand, and its refusals.
The real runtime's counters are compared with it in tests/test_plan_ground_truth.py."""
import math

import pytest
import torch

from stella_mpi._native import compress as codec
from stella_mpi.comm.buffers import split_counts
from stella_mpi.compression import get_compressor
from stella_mpi.compression.thc import THCCompressor
from stella_mpi.optim.tuning import payload_per_entry
from stella_mpi.plan import wire
from stella_mpi.plan.wire import Route, step_traffic

H = codec.HEADER_BYTES   # the payload header, and the 16-bit offsets' segment length, are the codec's own
SEG = codec.SEGMENT


def row(sent, received, messages, elements, entries):
    return {"wan_bytes_sent": sent, "wan_bytes_received": received, "wan_messages": messages, "elements": elements,
            "entries_sent": entries}


ZERO = row(0, 0, 0, 0, 0)


def seg16(n, k, value=4):
    return H + 4 * math.ceil(n / SEG) + 2 * k + value * k


# ---------------- dense and fp16


def test_dense_two_clusters_of_one_swaps_the_whole_bucket():
    assert step_traffic(Route("dense"), [1, 1], [10]) == [row(40, 40, 1, 10, 10)] * 2


def test_dense_two_clusters_of_two_each_rank_swaps_its_shard():
    # params [10, 3] -> one bucket of 13 (reverse order), shards 7 and 6 inside each cluster
    rows = step_traffic(Route("dense"), [2, 2], [10, 3])
    assert rows == [row(28, 28, 1, 7, 7), row(24, 24, 1, 6, 6)] * 2


def test_dense_four_clusters_counts_the_ring():
    # 2 (C-1)/C of 400 bytes
    assert step_traffic(Route("dense"), [1, 1, 1, 1], [100]) == [row(600, 600, 1, 100, 100)] * 4


def test_dense_buckets_follow_the_fusion_threshold():
    assert wire.buckets([100, 100, 50], fusion_bytes=400) == [50, 100, 100]
    rows = step_traffic(Route("dense"), [1, 1], [100, 100, 50], fusion_bytes=400)
    assert rows == [row(1000, 1000, 3, 250, 250)] * 2


def test_dense_an_empty_shard_moves_nothing():
    # 3 elements over clusters of 4: the fourth rank of each cluster owns no element
    rows = step_traffic(Route("dense"), [4, 4], [3])
    assert rows[3] == rows[7] == ZERO
    assert rows[0] == row(4, 4, 1, 1, 1)


def test_fp16_is_all_gathered_at_16_bits():
    assert step_traffic(Route("fp16"), [1, 1, 1], [10]) == [row(40, 40, 1, 10, 10)] * 3


def test_unequal_clusters_only_the_leaders_count():
    rows = step_traffic(Route("dense"), [2, 1], [10])
    assert rows == [row(40, 40, 1, 10, 10), ZERO, row(40, 40, 1, 10, 10)]


def test_one_cluster_crosses_nothing():
    assert step_traffic(Route("thc"), [3], [1000]) == [ZERO] * 3


# ---------------- sparse


def test_topk_allgather_two_clusters():
    # k = 50 of 100: 16-bit offsets (one segment) beat 32-bit indices; the 8-byte size besides
    p = seg16(100, 50)
    assert p < H + 8 * 50
    rows = step_traffic(Route("sparse", "topk", 0.5, warmup=0), [1, 1], [100])
    assert rows == [row(p + 8, p + 8, 2, 100, 50)] * 2


def test_topk_allgather_three_clusters_sends_to_each_other():
    p = seg16(100, 50)
    rows = step_traffic(Route("sparse", "topk", 0.5, warmup=0), [1, 1, 1], [100])
    assert rows == [row(2 * p + 16, 2 * p + 16, 2, 100, 50)] * 3


def test_randomk_sends_values_only():
    p = H + 4 * 50
    rows = step_traffic(Route("sparse", "randomk", 0.5, warmup=0), [1, 1], [100])
    assert rows == [row(p + 8, p + 8, 2, 100, 50)] * 2


def test_randomk_on_a_small_shard_is_the_exact_topk():
    # 20 elements < 16 / 0.5: selected by top-k, explicit indices
    p = seg16(20, 10)
    rows = step_traffic(Route("sparse", "randomk", 0.5, warmup=0), [1, 1], [20])
    assert rows == [row(p + 8, p + 8, 2, 20, 10)] * 2


def test_tree_forced_four_clusters_two_rounds():
    p = seg16(100, 50)
    rows = step_traffic(Route("sparse", "topk", 0.5, warmup=0, algorithm="tree"), [1, 1, 1, 1], [100])
    assert rows == [row(2 * (p + 8), 2 * (p + 8), 4, 100, 50)] * 4


def test_tree_needs_a_power_of_two():
    p = seg16(100, 50)
    rows = step_traffic(Route("sparse", "topk", 0.5, warmup=0, algorithm="tree"), [1, 1, 1], [100])
    assert rows == [row(2 * p + 16, 2 * p + 16, 2, 100, 50)] * 3   # the all-gather


def test_auto_takes_the_tree_from_8_clusters_for_64_kib_payloads():
    big, small = 8192 * 100, 8191 * 100   # k = 8192 entries -> 8 * k = 64 KiB
    auto = Route("sparse", "topk", 0.01, warmup=0)
    assert step_traffic(auto, [1] * 8, [big])[0]["wan_messages"] == 6
    assert step_traffic(auto, [1] * 8, [small])[0]["wan_messages"] == 2
    assert step_traffic(auto, [1] * 4, [big])[0]["wan_messages"] == 2


def test_density_warmup_starts_at_25_percent():
    r = Route("sparse", "topk", 0.01, warmup=50)
    assert step_traffic(r, [1, 1], [1000], step=0)[0]["entries_sent"] == 250
    assert step_traffic(r, [1, 1], [1000], step=50)[0]["entries_sent"] == 10
    k1 = round(1000 * 0.25 ** (1 - 1 / 50) * 0.01 ** (1 / 50))
    assert step_traffic(r, [1, 1], [1000], step=1)[0]["entries_sent"] == k1


def test_density_one_crosses_as_dense():
    assert step_traffic(Route("sparse", "topk", 1.0), [1, 1], [10]) == [row(40, 40, 1, 10, 10)] * 2


def test_data_dependent_compressors_need_a_payload_callable():
    with pytest.raises(ValueError, match="'cacheaware'.*payload="):
        step_traffic(Route("sparse", "cacheaware", 0.01, warmup=0), [1, 1], [100000])
    with pytest.raises(ValueError, match="'threshold'.*payload="):
        step_traffic(Route("sparse", "threshold", 0.01, warmup=0), [1, 1], [100000])


def test_a_payload_callable_from_real_selections():
    """Virtual participants: each cluster's shard is a real tensor; its payload comes from the
    real select and encode."""
    torch.manual_seed(0)
    shards = [torch.randn(100000) for _ in range(2)]
    route = Route("sparse", "cacheaware", 0.01, warmup=0)
    asked = []

    def payload(q):
        asked.append(q)
        return wire.measured_payload(q.compressor, shards[q.cluster])

    rows = step_traffic(route, [1, 1], [100000], payload=payload)
    comp = get_compressor("cacheaware", density=0.01)
    sizes = [wire.measured_payload(comp, s) for s in shards]
    assert rows[0] == row(sizes[0].bytes + 8, sizes[1].bytes + 8, 2, 100000, sizes[0].entries)
    assert rows[1] == row(sizes[1].bytes + 8, sizes[0].bytes + 8, 2, 100000, sizes[1].entries)
    assert [(q.cluster, q.n, q.round, q.bucket) for q in asked] == [(0, 100000, 1, 0), (1, 100000, 1, 0)]


def test_sized_topk_payload_assumes_no_whole_block():
    """The caveat: a top-k selection that holds a whole aligned 16-block is sent smaller (block
    ids, the codec's mixed scheme) than the size from (n, k) alone."""
    comp = get_compressor("topk", density=0.01)
    n = 10000
    g = torch.rand(n, generator=torch.Generator().manual_seed(0))   # the largest 100 are scattered
    assert wire.measured_payload(comp, g).bytes == wire.sized_payload(comp, n).bytes
    g[160:176] = 2.0   # one whole block among the largest
    assert wire.measured_payload(comp, g).bytes == wire.sized_payload(comp, n).bytes - 30


# ---------------- sparseloco and dct: a quantised payload of their own


@pytest.mark.parametrize("name,kw,n", [
    ("sparseloco", dict(density=0.01, chunk=4096, bits=2), 3 * 4096 + 1000),   # a short tail chunk
    ("sparseloco", dict(density=0.01, chunk=4096, bits=2), 300000),            # more than one 16-bit segment
    ("sparseloco", dict(density=0.05, chunk=64, bits=4), 1000),
    ("sparseloco", dict(density=0.02, chunk=256, bits=8), 5000),
    ("sparseloco", dict(density=0.01, chunk=4096, bits=2), 20),                 # one short chunk: one entry
    ("dct", dict(density=0.01, chunk=1024, bits=2), 10000),
    ("dct", dict(density=0.01, chunk=1024, bits=None), 10000),                  # float32 values
])
def test_sized_payload_is_what_the_compressor_encodes(name, kw, n):
    """The wire model's size of a quantised payload is the compressor's own payload_size, and
    that is what its real select and encode write (k_for(n) entries)."""
    comp = get_compressor(name, **kw)
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    real = wire.measured_payload(comp, g)
    assert wire.sized_payload(comp, n) == real == wire.Payload(comp.payload_size(n, comp.k_for(n)), comp.k_for(n))
    assert wire.sized_payload(comp, n, round=2) == real   # a tree round re-selects k entries: the same size


def sparseloco(**kw):
    return Route("sparse", "sparseloco", 0.01, chunk=4096, bits=2, feedback_decay=0.95, **kw)


def test_local_steps_sparseloco_pseudo_gradient_is_gathered_bucket_by_bucket():
    """Each pseudo-gradient bucket's shard crosses as the payload the real encoder writes for a
    shard of its size, gathered from the other cluster (its 8-byte size besides)."""
    numels, fusion = [200000, 3000, 150000, 64], 1 << 20
    r = Route("local", every=4, pseudo=sparseloco())
    comp = r.pseudo.make_compressor()
    assert (comp.name, comp.density, comp.chunk, comp.bits, comp.feedback_decay) == ("sparseloco", 0.01, 4096, 2, 0.95)
    gen = torch.Generator().manual_seed(1)
    want = [row(0, 0, 0, 0, 0) for _ in range(4)]
    for n in wire.pseudo_buckets(numels, fusion):
        assert n > 0
        for shard, m in enumerate(split_counts(n, 2)):   # clusters of two: each rank owns one shard
            p = wire.measured_payload(comp, torch.randn(m, generator=gen))
            for rank in (shard, 2 + shard):
                for key, v in zip(("wan_bytes_sent", "wan_bytes_received", "wan_messages", "elements", "entries_sent"),
                                  (p.bytes + 8, p.bytes + 8, 2, m, p.entries)):
                    want[rank][key] += v
    assert len(wire.pseudo_buckets(numels, fusion)) == 2
    assert step_traffic(r, [2, 2], numels, fusion_bytes=fusion, step=4) == want
    assert step_traffic(r, [2, 2], numels, fusion_bytes=fusion, step=3) == [ZERO] * 4


@pytest.mark.parametrize("nclusters", [2, 4])
def test_sparseloco_bytes_per_element_are_the_adjusters_payload_per_entry(nclusters):
    """The adjuster's rate (optim/tuning.py payload_per_entry, from the compressor's entry_bytes)
    and the wire model's exact count agree on a large shard, up to the header and the 16-bit
    segments' offsets."""
    n = 1 << 22
    comp = sparseloco().make_compressor()
    sent = step_traffic(Route("local", every=1, pseudo=sparseloco()), [1] * nclusters, [n], fusion_bytes=4 * n,
                        step=1)[0]["wan_bytes_sent"]
    assert sent / n == pytest.approx(payload_per_entry(comp, nclusters), rel=0.01)
    assert sent < step_traffic(Route("thc", bits=2), [1] * nclusters, [n])[0]["wan_bytes_sent"] / 4


def test_route_fields_left_none_read_as_the_compressors_own():
    assert Route("thc").bits == THCCompressor().bits
    default = get_compressor("sparseloco")
    r = Route("sparse", "sparseloco")
    assert (r.bits, r.chunk, r.feedback_decay) == (default.bits, default.chunk, default.feedback_decay)
    assert Route("sparse", "topk").bits is None and Route("thc") == Route("thc", bits=THCCompressor().bits)


# ---------------- THC


@pytest.mark.parametrize("nclusters", [2, 3, 8])
def test_thc_scales_then_words(nclusters):
    n, bits = 2048, 4
    lane = bits + (nclusters - 1).bit_length()           # one lane bit per doubling of the clusters
    words = math.ceil(n / (64 // lane))
    scales = 4 * (n // 1024 + 1)                          # a float32 maximum per 1024 entries, and the flag

    def ring(b):
        return b * (nclusters - 1) if nclusters == 2 else 2 * b * (nclusters - 1) // nclusters
    moved = ring(scales) + ring(8 * words)
    assert step_traffic(Route("thc", bits=bits), [1] * nclusters, [n]) == [row(moved, moved, 2, n, n)] * nclusters


# ---------------- local steps


def test_local_steps_count_the_exchange_in_the_next_steps_record():
    r = Route("local", every=2)
    per = [step_traffic(r, [1, 1], [10], step=s) for s in range(5)]
    assert per[0] == per[1] == per[3] == [ZERO] * 2
    assert per[2] == per[4] == [row(40, 40, 1, 10, 10)] * 2


def test_local_steps_pseudo_gradient_through_thc():
    r = Route("local", every=3, pseudo=Route("thc", bits=4))
    assert step_traffic(r, [1, 1], [2048], step=3) == step_traffic(Route("thc", bits=4), [1, 1], [2048])


def test_local_steps_overlap_allreduces_each_part_and_its_flag():
    r = Route("local", every=1, overlap=True)
    # clusters of 2: parts of 5 elements + the flag, 4 bytes each, swapped between 2 clusters
    assert step_traffic(r, [2, 2], [10], step=1) == [row(24, 24, 1, 0, 0)] * 4


def test_fragments_cross_one_each_slot_in_the_next_steps_record():
    """LocalSteps(every=4, fragments=2): fragment 1 after the update of step 2, fragment 0 after
    step 4's; each as the exchange of its own parameters (the runtime's balanced cut). A delayed
    one is placed in the same record (the runtime's is that one or the next: exact per period)."""
    numels = [5000, 100, 3000, 2000, 60]
    thc = Route("thc", bits=4)
    r = Route("local", every=4, fragments=2, pseudo=thc)
    members = wire.fragment_members(numels, 2)
    assert members == [[5000, 100], [3000, 2000, 60]] and sum(members, []) == numels
    per = [step_traffic(r, [1, 1], numels, step=s) for s in range(9)]
    assert per[0] == per[1] == per[3] == per[5] == per[7] == [ZERO] * 2
    for s, f in ((2, 1), (4, 0), (6, 1), (8, 0)):
        assert per[s] == step_traffic(Route("local", every=1, pseudo=thc), [1, 1], members[f], step=1)
    assert step_traffic(Route("local", every=4, fragments=2, delay=1, pseudo=thc), [1, 1], numels, step=2) == per[2]


def test_fragments_carry_the_same_total_per_period():
    """Dense float32 fragments: the bytes of one period are the whole model's, as F exchanges."""
    numels = [5000, 100, 3000, 2000, 60]
    frag = Route("local", every=4, fragments=2)
    period = [step_traffic(frag, [1, 1], numels, step=s) for s in range(4, 8)]
    whole = step_traffic(Route("local", every=4), [1, 1], numels, step=4)
    for rank in range(2):
        for key in ("wan_bytes_sent", "wan_bytes_received", "elements", "entries_sent"):
            assert sum(p[rank][key] for p in period) == whole[rank][key]
        assert sum(p[rank]["wan_messages"] for p in period) == 2 * whole[rank]["wan_messages"]


# ---------------- the bottleneck


def test_bottleneck_groups_by_shard_channel():
    sizes = [2, 2]
    rows = step_traffic(Route("dense"), sizes, [10, 3])
    b = wire.bottleneck(rows, sizes)
    assert (b["bytes"], b["messages"], b["elements"], b["channel"]) == (28, 1, 7, 0)
    assert b["channels"][1] == {"bytes": 24, "messages": 1, "elements": 6}
    nothing = wire.bottleneck(step_traffic(Route("dense"), [2], [10]), [2])
    assert nothing["bytes"] == 0 and nothing["channel"] is None


def test_layout_is_stelluns():
    assert wire.layout(16, 8) == [2] * 8
    assert wire.layout(7, 3) == [3, 2, 2]


# ---------------- refusals name the value


@pytest.mark.parametrize("make,match", [
    (lambda: Route("ring"), "kind must be one of .*'ring'"),
    (lambda: Route("sparse", density=0.0), r"density must be in \(0, 1\], got 0.0"),
    (lambda: Route("sparse", density=1.5), r"density must be in \(0, 1\], got 1.5"),
    (lambda: Route("thc", bits=9), r"bits must be an integer in \[2, 8\], got 9"),
    (lambda: Route("thc", bits=1), r"bits must be an integer in \[2, 8\], got 1"),
    (lambda: Route("sparse", compressor="zip"), "unknown compressor 'zip'"),
    (lambda: Route("sparse", compressor="fp16"), "'fp16' is not a sparse selection"),
    (lambda: Route("sparse", algorithm="ring"), "algorithm .* got 'ring'"),
    (lambda: Route("local", every=0), "every must be an int >= 1.*got 0"),
    (lambda: Route("local", pseudo=Route("local")), "pseudo-gradient's route"),
    (lambda: Route("local", overlap=True, pseudo=Route("thc")), "overlap take compression none.*'thc'"),
    (lambda: step_traffic(Route("dense"), [2, 0], [10]), r"cluster_sizes\[1\] is 0"),
    (lambda: step_traffic(Route("dense"), [], [10]), "cluster_sizes is empty"),
    (lambda: step_traffic(Route("dense"), [1, 1], [10, -1]), r"param_numels\[1\] is -1"),
    (lambda: step_traffic(Route("dense"), [1, 1], [10], step=-1), "step .* got -1"),
    (lambda: wire.bottleneck([ZERO], [1, 1]), "1 rows for a layout of 2 ranks"),
    (lambda: Route("sparse", "topk", bits=2), "compressor 'topk' takes no bits=2"),
    (lambda: Route("sparse", "sparseloco", bits=3), r"bits must be one of 2, 4, 8.*got 3"),
    (lambda: Route("sparse", "sparseloco", chunk=1000), r"chunk must be a power of two.*got 1000"),
    (lambda: Route("sparse", "sparseloco", feedback_decay=1.5), r"feedback_decay must be in \(0, 1\].*got 1.5"),
    (lambda: Route("thc", chunk=64), "Route\\(kind='thc'\\): chunk and feedback_decay .*chunk=64"),
    (lambda: Route("dense", fragments=2), "fragments, delay and inner are local steps'.*fragments=2"),
    (lambda: Route("thc", inner="rank"), "fragments, delay and inner are local steps'.*inner='rank'"),
    (lambda: Route("local", every=8, inner="node"), "inner must be one of cluster, rank.*'node'"),
    (lambda: Route("local", every=8, inner="rank", overlap=True), r"LocalSteps\(inner='rank', overlap=True"),
    (lambda: Route("local", every=8, fragments=3), "every=8, fragments=3"),
    (lambda: Route("local", every=8, fragments=4, delay=2), "delay must be an int in .*2"),
    (lambda: Route("local", every=8, fragments=2, overlap=True), "overlap=True, fragments=2"),
    (lambda: wire.fragment_members([10, 20], 3), "fragments=3.*2 trainable parameters"),
])
def test_refusals_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()
