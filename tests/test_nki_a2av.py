"""permute_a2av / unpermute_a2av (permgen.nki.a2av), the NKI expert-parallel dispatch and combine,
on EP ranks of the emulator's multi-rank driver, on both Trainium generations.

Each rank packs its routed rows by destination rank and the ranks exchange them by the exchange
each generation's documentation allows (trn2: all_to_all_v into receive slots, then a compaction;
trn3: all_to_all on slots; all_to_all_v with receive displacements where the caller asks for it, on
whole devices); the emulator's Platform enforces the same restrictions. The kernels run at LNC 1 and
2 (two cores per rank sharing HBM, rows split between them, nisa.core_barrier between their writes
and reads). The reference concatenates, on
every rank, the segments each source rank sends it, in source order, then zero rows up to the
capacity; metadata is checked to the element. The combine's reference is the probability-weighted
sum of each token's routed rows (identity experts). (The real nki.simulate runs one rank, so
these tests run on the emulator only.)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import importlib.util

from permgen.nki import emulator as nki_emulator

nki_emulator.install()

from cases import bits, load, stable_seed, variants_for  # noqa: E402
from permgen.nki.emulator import EmulatorError, Platform, jit, run_ranks  # noqa: E402
from permgen.nki.emulator.collectives import ReplicaGroup  # noqa: E402
from permgen.nki.emulator.testing import REAL_NKI, ROOT, nki_modules_restored  # noqa: E402
from permgen.core import axes  # noqa: E402
from permgen.nki.host import from_kernel, to_kernel  # noqa: E402


def _a2av_on_the_emulator():
    """permgen.nki.a2av running on the emulator: the real nki.simulate implements no collectives, so
    where the real `nki` imports (a Trainium host) these tests load a private copy over the emulator."""
    if not REAL_NKI:
        from permgen.nki import a2av as nki_a2av
        return nki_a2av
    with nki_modules_restored():
        nki_emulator.install(force=True)
        path = ROOT / "permgen" / "nki" / "a2av.py"
        spec = importlib.util.spec_from_file_location("permgen.nki._emulated_a2av", path)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "permgen.nki"
        spec.loader.exec_module(module)
    return module


nki_a2av = _a2av_on_the_emulator()
permute_a2av, unpermute_a2av = nki_a2av.permute_a2av, nki_a2av.unpermute_a2av

TORCH_DTYPES = {d: getattr(torch, n) for d, n in axes.TOKEN_DTYPE_NAMES.items()}
DEEP = ["bf16", "fp32", "fp8_e4m3"]  # token dtypes the deep tests run (the kernel depends on no other axis)
GENERATIONS = ["trn2", "trn3"]
LNCS = [1, 2]


def make_rank_inputs(dtype, ep, seed, hidden=72, top_k=2, experts_per_rank=2, empty_rank=None, silent_pairs=()):
    """Per rank: routed rows (one per token slot), their destination-major packing and counts.

    Tokens pick top_k distinct experts; expert e lives on rank e // experts_per_rank. A rank in
    `empty_rank` has no tokens; (src, dst) in `silent_pairs` means src sends dst nothing.
    """
    gen = torch.Generator().manual_seed(seed)
    num_experts = ep * experts_per_rank
    ranks = []
    for r in range(ep):
        num_tokens = 0 if r == empty_rank else int(torch.randint(1, 90, (1,), generator=gen))
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        for src, dst in silent_pairs:
            if src == r:
                scores[:, dst * experts_per_rank:(dst + 1) * experts_per_rank] = -1.0
        experts = scores.topk(top_k, dim=1).indices  # distinct experts per token
        dest = (experts // experts_per_rank).reshape(-1)
        tokens = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(TORCH_DTYPES[dtype])
        rows = tokens.repeat_interleave(top_k, dim=0)  # routed rows: token t's slots are rows t*k .. t*k+k-1
        order = torch.sort(dest, stable=True).indices.to(torch.int32)
        counts = torch.bincount(dest, minlength=ep).to(torch.int32)[None]
        ranks.append((rows, order, counts, num_tokens))
    total_tokens = sum(n for *_, n in ranks)
    capacity = max(1, total_tokens * min(top_k, experts_per_rank))  # the dropless bound
    return ranks, capacity


def reference(ranks, ep, hidden, capacity, group=None):
    """(recv [capacity, H], metadata uint32 [4, EP]) per rank, for rank-lists `group` (default: one list)."""
    group = group or [list(range(ep))]
    out = {}
    for ranks_of_list in group:
        for me_pos, me in enumerate(ranks_of_list):
            segments, recv_counts = [], []
            for src in ranks_of_list:
                rows, order, counts, _ = ranks[src]
                start = int(counts[0, :me_pos].sum())
                segment = rows[order.long()][start:start + int(counts[0, me_pos])]
                segments.append(segment)
                recv_counts.append(segment.shape[0])
            received = torch.cat(segments)
            recv = torch.zeros((capacity, hidden), dtype=received.dtype)
            recv[:received.shape[0]] = received
            send = ranks[me][2][0].long()
            recv_c = torch.tensor(recv_counts)
            meta = torch.stack([send, torch.cumsum(send, 0) - send, recv_c, torch.cumsum(recv_c, 0) - recv_c]) * hidden
            out[me] = (recv, meta.numpy().astype(np.uint32), int(recv_c.sum()))
    return out


def run_dispatch(ranks, capacity, group=None, generation="trn2", platform=None, exchange=None, lnc=None):
    ep = len(ranks)
    replica_group = ReplicaGroup(group or [list(range(ep))])
    args = [(to_kernel(rows), order.numpy(), counts.numpy(), capacity, replica_group) for rows, order, counts, _ in ranks]
    return run_ranks(permute_a2av, args, [dict(generation=generation, exchange=exchange)] * ep,
                     platform=platform or Platform(generation, lnc=lnc))


def check(results, want, hidden):
    for rank, (recv, meta) in enumerate(results):
        want_recv, want_meta, received = want[rank]
        assert meta.dtype == np.uint32 and meta.shape == want_meta.shape
        np.testing.assert_array_equal(meta, want_meta)
        got = from_kernel(recv)
        assert got.shape == want_recv.shape
        assert torch.equal(bits(got), bits(want_recv)), f"rank {rank}"
        # Deterministic padding: every row past what arrived is exact (+0.0) zeros.
        assert not bits(got)[received:].any()


def busiest(ranks, ep, hidden=72):
    """Rows the busiest rank receives: the tightest capacity that holds every send."""
    return max(received for *_, received in reference(ranks, ep, hidden, 10 ** 5).values())


@pytest.mark.parametrize("lnc", LNCS)
@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("sends", ["uneven", "empty", "full"])
def test_permute_a2av_matches_reference(generation, ep, sends, lnc):
    """uneven: random counts per peer; empty: one rank without tokens and sources that skip a peer;
    full: the capacity is exactly the busiest rank's receive count (its buffer ends with no padding)."""
    dtype = DEEP[0]
    empty = 1 if sends == "empty" else None
    silent = [(0, ep - 1), (ep - 1, 0)] if sends == "empty" else []
    ranks, capacity = make_rank_inputs(dtype, ep, stable_seed(generation, ep, sends), hidden=72, empty_rank=empty,
                                       silent_pairs=silent)
    if sends == "full":
        capacity = busiest(ranks, ep)
    want = reference(ranks, ep, 72, capacity)
    if silent:
        assert want[ep - 1][1][2, 0] == 0 and want[0][1][2, ep - 1] == 0
    check(run_dispatch(ranks, capacity, generation=generation, lnc=lnc), want, 72)


def test_dispatch_on_neuron_sdk_2_32():
    """The a2av kernels on the other release they are written for, SDK 2.32 (NKI 0.6): Trn3's all_to_all, and
    Trn2's all_to_all_v on an inter-node rank-list (2.32 allows it on no other); within one instance it fails."""
    ranks, capacity = make_rank_inputs(DEEP[0], 4, stable_seed("sdk 2.32"), hidden=24)
    want = reference(ranks, 4, 24, capacity)
    check(run_dispatch(ranks, capacity, generation="trn3", platform=Platform("trn3", lnc=2, sdk="2.32")), want, 24)
    check(run_dispatch(ranks, capacity, platform=Platform("trn2", ranks_per_node=1, sdk="2.32")), want, 24)
    with pytest.raises(EmulatorError, match="on SDK 2.32 on trn2 needs an inter-node rank-list"):
        run_dispatch(ranks, capacity, platform=Platform("trn2", sdk="2.32"))


@pytest.mark.parametrize("ep", [8, 16])
def test_packed_exchange_on_whole_trn3_devices(ep):
    """exchange="all_to_all_v_packed" where the caller vouches for whole devices (rank-lists of 4 ranks per
    device at LNC=2): all_to_all_v with receive displacements, dispatch and combine."""
    ranks, capacity = make_rank_inputs(DEEP[0], ep, stable_seed("packed", ep), hidden=24)
    check(run_dispatch(ranks, capacity, generation="trn3", exchange="all_to_all_v_packed", lnc=2),
          reference(ranks, ep, 24, capacity), 24)
    with pytest.raises(ValueError, match="needs LNC=2"):
        run_dispatch(ranks, capacity, generation="trn3", exchange="all_to_all_v_packed", lnc=1)


def test_the_cores_wait_for_each_others_writes(monkeypatch):
    """At LNC=2 each core writes its tiles of shared buffers that both then read (and collectives read
    and write): without the core barriers the emulator reports the race."""
    ranks, capacity = make_rank_inputs(DEEP[0], 2, 9, hidden=24)
    check(run_dispatch(ranks, capacity, lnc=2), reference(ranks, 2, 24, capacity), 24)
    monkeypatch.setattr(nki_a2av, "_sync", lambda data: None)
    with pytest.raises(EmulatorError, match="core_barrier"):
        run_dispatch(ranks, capacity, lnc=2)


@pytest.mark.parametrize("dtype", axes.DTYPES)
def test_every_token_dtype_dispatches(dtype):
    ranks, capacity = make_rank_inputs(dtype, 2, stable_seed(dtype), hidden=40)
    check(run_dispatch(ranks, capacity), reference(ranks, 2, 40, capacity), 40)


def test_receive_displacements_fail_on_one_trn2_instance():
    """The trn3 exchange (all_to_all_v with has_rdispls=True) on a Trainium2 instance is what the
    documentation rules out: receive displacements only on inter-node rank-lists there."""
    ranks, capacity = make_rank_inputs(DEEP[0], 8, 21, hidden=16)
    with pytest.raises(EmulatorError, match="inter-node rank-list"):
        run_dispatch(ranks, capacity, exchange="all_to_all_v_packed", platform=Platform("trn2"))
    # On eight instances (one rank each) the same rank-list is inter-node, and it runs.
    check(run_dispatch(ranks, capacity, exchange="all_to_all_v_packed", platform=Platform("trn2", ranks_per_node=1)),
          reference(ranks, 8, 16, capacity), 16)
    # The trn2 exchange uses all_to_all_v, which a NeuronSwitch rejects within one device.
    small, capacity = make_rank_inputs(DEEP[0], 4, 22, hidden=16)
    with pytest.raises(EmulatorError, match="more than one participating device"):
        run_dispatch(small, capacity, generation="trn2", platform=Platform("trn3"))


# --- combine -----------------------------------------------------------------------------------
def make_combine_inputs(dtype, ep, seed, hidden=48, top_k=2, empty_rank=None):
    """Per rank: distinct routed rows (token t's slot j is row t * k + j), their destination-major
    packing and counts, and fp32 merging probs [T, k]."""
    gen = torch.Generator().manual_seed(seed)
    ranks = []
    for r in range(ep):
        num_tokens = 0 if r == empty_rank else int(torch.randint(1, 40, (1,), generator=gen))
        dest = torch.randint(0, ep, (num_tokens * top_k,), generator=gen)
        rows = (torch.randn(num_tokens * top_k, hidden, generator=gen) * 4).to(TORCH_DTYPES[dtype])
        order = torch.sort(dest, stable=True).indices.to(torch.int32)
        counts = torch.bincount(dest, minlength=ep).to(torch.int32)[None]
        probs = torch.rand(num_tokens, top_k, generator=gen)
        ranks.append((rows, order, counts, probs))
    capacity = max(1, sum(r[0].shape[0] for r in ranks))
    return ranks, capacity


@pytest.mark.parametrize("generation,ep,dtype,lnc,exchange",
                         [(g, ep, "bf16", lnc, None) for g in GENERATIONS for ep in (2, 4, 8) for lnc in LNCS]
                         + [("trn2", 4, "fp32", 2, None), ("trn3", 8, "fp32", 2, "all_to_all_v_packed")])
def test_dispatch_identity_experts_combine_returns_the_weighted_rows(generation, ep, dtype, lnc, exchange):
    """dispatch -> identity experts -> combine: every token gets sum_j p[t, j] * its routed row j back,
    on its own rank (the rows of a token differ, so a row returned to the wrong slot shows)."""
    ranks, capacity = make_combine_inputs(dtype, ep, stable_seed("combine", generation, ep), empty_rank=ep - 1)
    replica_group = ReplicaGroup([list(range(ep))])

    def rank(rows, order, counts, probs):
        recv, _ = permute_a2av(to_kernel(rows), order.numpy(), counts.numpy(), capacity, replica_group,
                               generation=generation, exchange=exchange)
        return unpermute_a2av(recv, order.numpy(), counts.numpy(), probs.numpy(), replica_group, generation=generation,
                              exchange=exchange)

    results = run_ranks(rank, ranks, platform=Platform(generation, lnc=lnc))
    for r, ((rows, _, _, probs), got) in enumerate(zip(ranks, results)):
        num_tokens, top_k = probs.shape
        slots = rows.float().reshape(num_tokens, top_k, rows.shape[1])
        want = torch.zeros(num_tokens, rows.shape[1])
        for j in range(top_k):  # the kernel's order: fp32 multiply-adds, slot by slot
            want = slots[:, j] * probs[:, j:j + 1] + want
        got = from_kernel(got)
        assert got.shape == (num_tokens, rows.shape[1]), f"rank {r}"
        torch.testing.assert_close(got.float(), want.to(TORCH_DTYPES[dtype]).float(), rtol=1e-2, atol=1e-2)


def test_combine_checks_its_arguments():
    ranks, capacity = make_combine_inputs("fp32", 2, 31)
    rows, order, counts, probs = ranks[0]
    group = ReplicaGroup([[0, 1]])
    expert_output = np.zeros((capacity, rows.shape[1]), np.float32)
    with pytest.raises(ValueError, match=r"packed_source_indices must have shape \["):
        unpermute_a2av(expert_output, order.numpy(), counts.numpy(), probs.numpy()[:-1], group)
    with pytest.raises(ValueError, match="must sum to"):
        unpermute_a2av(expert_output, order.numpy(), counts.numpy() * 2, probs.numpy(), group)
    with pytest.raises(TypeError, match="float32"):
        unpermute_a2av(expert_output, order.numpy(), counts.numpy(), probs.numpy().astype(np.float16), group)
    with pytest.raises(ValueError, match="generation must be one of"):
        unpermute_a2av(expert_output, order.numpy(), counts.numpy(), probs.numpy(), group, generation="trn1")
    # The combine computes with its rows: float8_e4m3fn is no Trainium2 data type (NCC_EVRF051).
    with pytest.raises(TypeError, match="float8_e4m3fn.*NCC_EVRF051"):
        unpermute_a2av(expert_output.astype(ml_dtypes.float8_e4m3fn), order.numpy(), counts.numpy(), probs.numpy(),
                       group)
    # One column per rank of the rank-list: ReplicaGroup documents no field to read the rank-lists from, so
    # the kernel's first collective (one count per peer) is what refuses two columns for three ranks.
    three = ReplicaGroup([[0, 1, 2]])
    with pytest.raises(EmulatorError, match="all_to_all"):
        run_ranks(unpermute_a2av, [(expert_output, order.numpy(), counts.numpy(), probs.numpy(), three)] * 3)


@pytest.mark.parametrize("name", variants_for("nki"))
def test_generated_modules_reexport_the_one_kernel(name):
    from permgen.nki import a2av as imported
    module = load("nki", name)
    assert module.permute_a2av is imported.permute_a2av and module.unpermute_a2av is imported.unpermute_a2av


@pytest.mark.parametrize("generation", GENERATIONS)
def test_exact_capacity_and_hidden_tiles(monkeypatch, generation):
    """Capacity equal to the busiest rank's rows; H split across SBUF tiles with a partial last one;
    more than one 128-row tile per rank."""
    monkeypatch.setattr(nki_a2av, "H_TILE", 64)
    ranks, _ = make_rank_inputs(DEEP[0], 4, 11, hidden=200, top_k=3)
    capacity = busiest(ranks, 4, 200)
    check(run_dispatch(ranks, capacity, generation=generation), reference(ranks, 4, 200, capacity), 200)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_strided_rank_lists(generation):
    """Four ranks in two independent EP=2 rank-lists [[0, 2], [1, 3]]."""
    group = [[0, 2], [1, 3]]
    ranks, capacity = make_rank_inputs(DEEP[0], 4, 5, experts_per_rank=4)
    # Re-route for EP=2: each rank's rows go to position 0 or 1 of its own rank-list.
    gen = torch.Generator().manual_seed(6)
    rerouted = []
    for rows, _, _, n in ranks:
        dest = torch.randint(0, 2, (rows.shape[0],), generator=gen)
        rerouted.append((rows, torch.sort(dest, stable=True).indices.to(torch.int32),
                         torch.bincount(dest, minlength=2).to(torch.int32)[None], n))
    capacity = sum(r[0].shape[0] for r in rerouted)
    check(run_dispatch(rerouted, capacity, group, generation=generation), reference(rerouted, 4, 72, capacity, group), 72)


@pytest.mark.parametrize("generation,ep,exchange", [("trn2", 2, None), ("trn3", 2, None), ("trn3", 8, "all_to_all_v_packed")])
def test_receive_capacity_overflow_is_an_error(generation, ep, exchange):
    """One row more than the capacity fails on the device: in the collective (receive displacements)
    or in the capacity check before the compaction (receive slots)."""
    ranks, _ = make_rank_inputs(DEEP[0], ep, 3, hidden=16)
    with pytest.raises(EmulatorError, match="receive capacity exceeded|out of bounds"):
        run_dispatch(ranks, busiest(ranks, ep, 16) - 1, generation=generation, exchange=exchange)


def test_bad_counts_and_indices():
    ranks, capacity = make_rank_inputs(DEEP[0], 2, 4)
    rows, order, counts, _ = ranks[0]
    group = ReplicaGroup([[0, 1]])
    args = (to_kernel(rows), order.numpy(), counts.numpy(), capacity, group)
    bad = counts.numpy().copy()
    bad[0, 0] += 1
    with pytest.raises(ValueError, match="must sum to"):
        permute_a2av(args[0], args[1], bad, capacity, group)
    with pytest.raises(ValueError, match="non-negative"):
        permute_a2av(args[0], args[1], np.array([[-1, rows.shape[0] + 1]], dtype=np.int32), capacity, group)
    out_of_range = order.numpy().copy()
    out_of_range[0] = rows.shape[0]
    with pytest.raises(ValueError, match=r"must lie in \[0,"):
        permute_a2av(args[0], out_of_range, args[2], capacity, group)
    with pytest.raises(TypeError, match="must be a NumPy array"):
        permute_a2av(rows, args[1], args[2], capacity, group)
    with pytest.raises(TypeError, match="int32 or uint32"):
        permute_a2av(args[0], args[1], args[2].astype(np.int64), capacity, group)
    with pytest.raises(ValueError, match="recv_capacity"):
        permute_a2av(args[0], args[1], args[2], 0, group)
    with pytest.raises(ValueError, match="generation must be one of"):
        permute_a2av(*args, generation="inf2")

    # Past the host checks, the kernel itself is strict: counts beyond the send buffer (one receive
    # slot: max(N, capacity) rows; the receiver's capacity check, before the exchange, or the collective
    # fails), indices out of range.
    kernel = nki_a2av.permute_a2av_kernel[nki_a2av.logical_cores()]
    other = ranks[1]
    peer = (to_kernel(other[0]), other[1].numpy(), other[2].numpy(), capacity, group)
    beyond = counts.numpy().copy()
    beyond[0, 0] += max(rows.shape[0], capacity)
    with pytest.raises(EmulatorError, match="past the end of its|index out of bounds"):
        run_ranks(kernel, [(args[0], args[1], beyond, capacity, group), peer])
    with pytest.raises(EmulatorError, match="out of bounds"):
        run_ranks(kernel, [(args[0], out_of_range, args[2], capacity, group), peer])


def test_metadata_elements_are_exact_past_fp32(monkeypatch):
    """rows * H beyond 2^24 (fp32's exact integers) still comes out exact (one core: LNC=1)."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    module = nki_a2av
    rows = np.array([[499_999, 3, 131_071, 0]], dtype=np.float32)

    def body(counts):
        tile = module.nl.ndarray((1, 4), dtype=module.nl.float32, buffer=module.nl.sbuf)
        module.nisa.dma_copy(dst=tile, src=counts)
        out = module.nl.ndarray((1, 4), dtype=module.nl.uint32, buffer=module.nl.shared_hbm)
        module._store_elements(out, tile, 7168)
        return out

    got = jit(body)(rows)
    np.testing.assert_array_equal(got, (rows.astype(np.int64) * 7168).astype(np.uint32))


def test_each_generation_picks_a_documented_exchange():
    """trn2: all_to_all_v into receive slots (SDK 2.33's rule); trn3: all_to_all on slots, which no page
    restricts. Receive displacements only when asked (no page says which ranks share a device), and on
    trn3 only at LNC=2 ("requires LNC=2")."""
    exchange_for = nki_a2av.exchange_for
    group = ReplicaGroup([list(range(8))])
    assert exchange_for(group, "trn2") == "all_to_all_v"
    assert exchange_for(group, "trn3") == "all_to_all"
    assert exchange_for(ReplicaGroup([[0, 4], [1, 5], [2, 6], [3, 7]]), "trn3") == "all_to_all"
    assert exchange_for(group, "trn3", "all_to_all_v_packed", lnc=2) == "all_to_all_v_packed"
    assert exchange_for(group, "trn2", "all_to_all_v_packed", lnc=1) == "all_to_all_v_packed"
    assert exchange_for(group, "trn3", "all_to_all", lnc=1) == "all_to_all"
    for exchange in ("all_to_all_v", "all_to_all_v_packed"):
        with pytest.raises(ValueError, match="needs LNC=2"):
            exchange_for(group, "trn3", exchange, lnc=1)
    with pytest.raises(ValueError, match="exchange must be one of"):
        exchange_for(group, "trn2", "alltoall")
    with pytest.raises(TypeError, match="ncc.ReplicaGroup"):
        exchange_for([[0, 1]], "trn2")


def test_trn2_receive_buffers_are_ep_times_the_send_buffer(monkeypatch):
    """Without receive displacements the trn2 exchange sizes dst = EP x src (one slot per source, each
    as long as the send buffer): what a Trn2 driver is reported to require for all_to_all_v without
    receive displacements (not in the documentation, so the emulator does not enforce it)."""
    ncc = nki_a2av.ncc
    seen = []
    original = ncc.all_to_all_v

    def recording(srcs, dsts, replica_group, metadata_tensor, **flags):
        seen.append((srcs[0].shape, dsts[0].shape, len(replica_group.rank_list(ncc.rank_id())), flags["has_rdispls"]))
        return original(srcs, dsts, replica_group, metadata_tensor, **flags)

    monkeypatch.setattr(ncc, "all_to_all_v", recording)
    ranks, capacity = make_combine_inputs("bf16", 4, 41)
    group = ReplicaGroup([[0, 1, 2, 3]])

    def rank(rows, order, counts, probs):
        recv, _ = permute_a2av(to_kernel(rows), order.numpy(), counts.numpy(), capacity, group)
        return unpermute_a2av(recv, order.numpy(), counts.numpy(), probs.numpy(), group)

    run_ranks(rank, ranks)
    assert len(seen) == 8 * nki_a2av.logical_cores()  # a dispatch and a combine on each of 4 ranks, by each core
    for src, dst, ep, has_rdispls in seen:
        assert not has_rdispls and dst == (ep * src[0], src[1])
