"""The process group as expert parallelism sees it: its facts, learned once (`group_facts`), and its
exchange, the steps that move rows, counts and agreement words between its ranks.

A group of several ranks exchanges over torch.distributed (`Exchange`); a group of one rank has
nothing to exchange, so its exchange (`LOCAL`) leaves what a rank would send itself where it is.
The choice is made once, when the group is first seen: the rest of dispatch and combine runs the
same code for one rank as for many.
"""

from __future__ import annotations

import itertools
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupFacts:
    """A process group's facts, read once (group_facts) and shared by every dispatch and combine on it.

    The group itself is held only through weak references (here and in its exchange): nothing of
    permgen keeps a group alive past destroy_process_group, where gloo's group would otherwise be torn
    down at interpreter exit instead, which aborts a process now and then."""

    world: int  # ranks in the group
    rank: int  # this process's rank in it
    backend: str  # torch.distributed's name for its backend
    device_type: Optional[str]  # the device type its collectives need ("cuda" for NCCL), None for any
    group_ref: weakref.ref
    exchange: object  # how its ranks exchange: an Exchange, or LOCAL for one rank
    # The group's eager dispatches, numbered in the order they ran: every rank runs a group's dispatches
    # in the same order, so handles that belong together carry the same number on every rank.
    serials: Iterator[int] = field(default_factory=itertools.count, compare=False)

    def check_device(self, name, device):
        if self.device_type is not None and device.type != self.device_type:
            raise ValueError(f"{name}: the group's backend is {self.backend} but the tokens are on {device}")


# ProcessGroup -> GroupFacts. The facts refer to the group only weakly, so an entry never keeps its key
# alive: it goes with the group.
_FACTS = weakref.WeakKeyDictionary()


def group_facts(name, group) -> GroupFacts:
    """The facts of `group`, after checking it is a process group this process belongs to."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised; call torch.distributed.init_process_group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: group must be a torch.distributed ProcessGroup (dist.group.WORLD for every rank), "
                        f"got {type(group).__name__}")
    facts = _FACTS.get(group)
    if facts is None:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"{name}: this process is not a member of the group")
        world, backend, ref = dist.get_world_size(group), str(dist.get_backend(group)), weakref.ref(group)
        facts = _FACTS[group] = GroupFacts(world, rank, backend, "cuda" if backend == "nccl" else None, ref,
                                           LOCAL if world == 1 else Exchange(ref, world, rank, backend))
    return facts


def live_group(group_ref, name="dispatch"):
    """The group a weak reference refers to, or a ValueError where it was destroyed."""
    group = group_ref()
    if group is None:
        raise ValueError(f"{name}: the process group of this dispatch was destroyed")
    return group


def _wire(t):
    """t as the collectives move it: fp8 as bytes (gloo and NCCL have no fp8 types), the rest as it is."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


# -- the agreement's words ------------------------------------------------------------------------

def word(value) -> int:
    """A setting as one int64 word to compare: ints as they are, None as -1, anything else (a variant's
    name, a dtype) by the CRC32 of its text, the same in every process."""
    if value is None:
        return -1
    if isinstance(value, (bool, int)):
        return int(value)
    return zlib.crc32(str(value).encode())


class Exchange:
    """Several ranks: rows and counts move by all_to_all_single over the group, the agreement's words
    by one all_gather over a host channel."""

    permute_caps = False  # capacity mode packs each destination's rows (see LocalExchange)

    def __init__(self, group_ref, world, rank, backend):
        self.group_ref, self.world, self.rank = group_ref, world, rank
        # The words travel on host memory: over the group itself where it moves CPU tensors (gloo), else
        # over a gloo group of its ranks, made on the first agreement (a call every member makes).
        self._channel = group_ref if "gloo" in backend else None

    def rows(self, x, out_splits, in_splits, rows):
        """all_to_all_single of the rows of x (1-D or 2-D) into `rows` rows; those past the received
        ones are zeros (the regroup's pad and empty rows)."""
        received = sum(out_splits)
        out = got = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        if rows > received:
            got = out[:received]
            out[received:].zero_()
        group = live_group(self.group_ref)
        dist.all_to_all_single(_wire(got), _wire(x.contiguous()), out_splits, in_splits, group=group)
        return out

    def swap(self, sent):
        """sent [W, ...]: row d to rank d; returns the rows received, row s from rank s."""
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=live_group(self.group_ref))
        return received

    def counts(self, counts, local):
        """counts [E + 1]: this rank's routes to each expert, then its bad routes. Sends each rank its
        experts' counts and the bad routes; returns (payload, received [W, L + 1]): the payload, what
        the host reads once, is what was sent then what was received."""
        payload = counts.new_empty((2, self.world, local + 1))
        sent, received = payload
        torch.cat([counts[:-1].view(self.world, local), counts[-1:].expand(self.world, 1)], 1, out=sent)
        dist.all_to_all_single(received, sent, group=live_group(self.group_ref))
        return payload, received

    def rows_per_expert(self, kept, res):
        """int64 [L]: each local expert's rows, kept [W, L] summed over the sources (res: permute's
        result where it ran before the counts were read, else None)."""
        return kept.sum(0, dtype=torch.int64)

    def _host_channel(self):
        channel = self._channel and self._channel()
        if channel is None:  # (held weakly too: torch's group registry keeps it until destroy_process_group)
            group = live_group(self.group_ref)
            channel = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                     use_local_synchronization=True)
            self._channel = weakref.ref(channel)
        return channel

    def agree(self, name, what, refused, agreed, splits=((), ())):
        """Raise on every rank, before any collective sized by the settings, where a rank refused its
        input (`refused`: its own error, or None) or the ranks' settings differ. agreed: (labels,
        values, words), what must be equal on every rank (word(value) for each); splits: (rows this
        rank sends each rank, rows it receives from each), which must be what its peers receive and
        send. One all_gather of int64 words on host memory: no device read."""
        labels, values, words = agreed
        sends, receives = splits
        mine = torch.tensor([int(refused is not None), *words, *sends, *receives], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        channel = self._host_channel()
        dist.all_gather(everyone, mine, group=channel)
        rows = [t.tolist() for t in everyone]
        if refused is not None:
            raise refused
        done = what + ("d" if what.endswith("e") else "ed")
        culprits = [r for r, row in enumerate(rows) if row[0]]
        if culprits:
            raise ValueError(f"{name}: {what} refused the input of rank(s) {culprits} of the group (they raise the "
                             f"details); no rank {done}")
        differ = [i for i in range(len(words)) if len({row[1 + i] for row in rows}) > 1]
        start = 1 + len(words)
        sent = [row[start:start + len(sends)] for row in rows]  # [rank][peer]
        received = [row[start + len(sends):] for row in rows]
        unmatched = [(r, d) for r in range(self.world) for d in range(len(sends)) if sent[r][d] != received[d][r]]
        if not differ and not unmatched:
            return
        parts = []
        if differ:  # every rank read the same words, so every rank is here: the values' text, on this path only
            shown = [None] * self.world
            dist.all_gather_object(shown, [str(values[i]) for i in differ], group=channel)
            parts = ["{}: {}".format(labels[i], ", ".join(f"rank {r} {shown[r][j]}" for r in range(self.world)))
                     for j, i in enumerate(differ)]
        parts += [f"rank {r} sends rank {d} {sent[r][d]} rows, rank {d} expects {received[d][r]}" for r, d in unmatched]
        raise ValueError(f"{name}: the ranks of the group disagree on what sizes the {what}'s collectives, so no "
                         f"rank {done} (rank {self.rank} raises this too): " + "; ".join(parts))


class LocalExchange:
    """One rank: what it would send itself stays where it is. Each step of Exchange without a
    collective: rows and counts come back as they were given (rows are never written to), the
    experts' rows need no sum over sources, the agreement raises this rank's own refusal, and capacity
    mode's per-destination cap is permute's own row cap (one destination: permute keeps the first rows
    in expert order and drops the rest, with no packing gather) where permute's rows are the send
    buffer (unpadded variants)."""

    permute_caps = True

    def rows(self, x, out_splits, in_splits, rows):
        received = out_splits[0]
        x = (x[:received] if x.shape[0] > received else x).contiguous()
        return x if rows == received else torch.cat((x, x.new_zeros((rows - received, *x.shape[1:]))))

    def swap(self, sent):
        return sent

    def counts(self, counts, local):
        payload = counts.view(1, -1)
        return payload, payload

    def rows_per_expert(self, kept, res):
        # One source, nothing to sum: permute's own counts where it ran first, else the route tally's.
        return res.tokens_per_expert if res is not None else kept[0]

    def agree(self, name, what, refused, agreed, splits=((), ())):
        if refused is not None:
            raise refused


LOCAL = LocalExchange()
