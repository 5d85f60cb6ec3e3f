"""What permute returns, the same type on every target."""

from typing import NamedTuple, Optional

import torch

from .axes import MAX_PAD
from .variant import Variant


class RowMapLayout(NamedTuple):
    """Where each part of a row map starts, in int32 words: the one statement of the layout, which
    every host takes its offsets from (the kernels' helpers in permgen.triton.kernels and
    permgen.nki.kernels compute the same offsets; a test checks they agree).

        dst rows        [N * W]
        experts         [N * W]  mask routing only
        route counts    [N]      mask routing only
        segment offsets [E + 1]
        segment counts  [E]
        route tallies   [2]      routes dropped, and of them those without a slot
    """

    mask: bool
    num_tokens: int
    width: int
    num_experts: int

    @property
    def dst_rows(self) -> int:
        return 0

    @property
    def experts(self) -> int:
        """Mask routing only."""
        return self.num_tokens * self.width

    @property
    def route_counts(self) -> int:
        """Mask routing only."""
        return 2 * self.num_tokens * self.width

    @property
    def segment_offsets(self) -> int:
        return (2 * self.width + 1) * self.num_tokens if self.mask else self.width * self.num_tokens

    @property
    def segment_counts(self) -> int:
        return self.segment_offsets + self.num_experts + 1

    @property
    def route_tallies(self) -> int:
        return self.segment_offsets + 2 * self.num_experts + 1

    @property
    def end(self) -> int:
        """Words in use."""
        return self.route_tallies + ROUTE_TALLIES

    @property
    def words(self) -> int:
        """Words permute allocates: whole rows, so that TransformerEngine's functions (permgen.integrations.te) can
        read the sizes back from a 2-D view. A mask map is [N + ceil((2E + 3) / (2W + 1)), 2W + 1] words
        ([N + 2, 2E + 1] when W = E), an index map [N + 2E + 3, W]; the words past `end` are never read."""
        tail = 2 * self.num_experts + 1 + ROUTE_TALLIES
        if self.mask:
            row = 2 * self.width + 1
            return (self.num_tokens + -(-tail // row)) * row
        return (self.num_tokens + tail) * max(self.width, 1)


ROUTE_TALLIES = 2  # words after the segment table: routes dropped, routes without a slot


def route_words(mask: bool, num_tokens: int, width: int) -> int:
    """Words of the row map before its segment table (RowMapLayout.segment_offsets)."""
    return RowMapLayout(mask, num_tokens, width, 0).segment_offsets


def row_map_words(mask: bool, num_tokens: int, width: int, num_experts: int) -> int:
    """Words permute allocates for a row map (RowMapLayout.words)."""
    return RowMapLayout(mask, num_tokens, width, num_experts).words


def write_route_tallies(variant, routing, row_map, num_tokens: int, width: int, num_experts: int):
    """Write the row map's route tallies (permgen.core.results.RowIdMap.dropped) with torch ops, for a
    target whose kernels do not count them: routes dropped (slotted routes past the row cap, and
    the routes without a slot), then those without a slot."""
    layout = RowMapLayout(variant.mask, num_tokens, width, num_experts)
    kept = row_map[layout.segment_counts:layout.segment_counts + num_experts].sum()
    if variant.mask:
        routes = (routing != 0).sum(1)
        slotted = routes.clamp(max=width)
        unslotted = (routes - slotted).sum()
        slotted = slotted.sum()
    else:
        slotted = ((routing >= 0) & (routing < num_experts)).sum()
        unslotted = ((routing < -1) | (routing >= num_experts)).sum()
    row_map[layout.route_tallies:layout.end] = torch.stack((slotted - kept + unslotted, unslotted)).to(torch.int32)


class RowIdMap(NamedTuple):
    """What permute leaves for unpermute and the backward passes: O(N*k + E) int32 words.

    `row_map` is one int32 tensor, laid out the same on every target (offsets: RowMapLayout):

        dst rows        [N, W]  row of each route, -1 where it lands nowhere (no route, or dropped)
        experts         [N, W]  mask routing only: the token's experts in ascending order
        route counts    [N]     mask routing only: routes of each token, which fill its first
                                slots; what the slots after them hold is never used, except that
                                on the Triton target the dst rows of those among the first
                                min(W, 8) hold -1 (its gathers read a token's first tile without
                                the count)
        segment offsets [E + 1] first row of each expert's segment; [E] = rows in use
        segment counts  [E]     routed (non-pad) rows at the start of each segment
        route tallies   [2]     routes dropped (past the row cap, or without a slot), and of
                                them those without a slot: ids outside [-1, E) for index
                                routing, routes past a token's first W for mask routing

    W is the routing's k for index routing; for mask routing it is permute's `topk` hint, or E.
    Words after the segment table, if any (see row_map_words), are never read.
    """

    row_map: torch.Tensor
    routing: torch.Tensor  # the routing permute was given (index routing: the experts of each slot)
    num_tokens: int
    width: int  # W, route slots per token
    num_experts: int
    num_rows: int  # rows of the permuted tensor
    variant: str  # name of the variant whose permute made it

    def _part(self, begin, length):
        return self.row_map[begin:begin + length]

    @property
    def is_mask(self) -> bool:
        return Variant.named(self.variant).mask

    @property
    def layout(self) -> RowMapLayout:
        return RowMapLayout(Variant.named(self.variant).mask, self.num_tokens, self.width, self.num_experts)

    @property
    def dst_rows(self) -> torch.Tensor:
        """int32 [N, W]: row of each route, -1 where the route lands nowhere."""
        return self._part(0, self.num_tokens * self.width).view(self.num_tokens, self.width)

    @property
    def experts(self) -> torch.Tensor:
        """[N, W]: expert of each route slot (mask routing: compacted from the mask; see route_counts)."""
        layout = self.layout
        if not layout.mask:
            return self.routing
        return self._part(layout.experts, self.num_tokens * self.width).view(self.num_tokens, self.width)

    @property
    def route_counts(self) -> Optional[torch.Tensor]:
        """int32 [N]: live routes of each token (mask routing), else None (every token has W slots)."""
        layout = self.layout
        return self._part(layout.route_counts, self.num_tokens) if layout.mask else None

    @property
    def live_routes(self) -> torch.Tensor:
        """bool [N, W]: the slots that hold a route (a row >= 0; mask routing: also within the token's
        route count, past which a slot's row is not written)."""
        dst = self.dst_rows
        live = dst >= 0
        if self.layout.mask:
            live &= torch.arange(self.width, device=dst.device)[None, :] < self.route_counts[:, None]
        return live

    @property
    def segment_offsets(self) -> torch.Tensor:
        """int32 [E + 1]: first row of each expert's segment; [E] = rows in use."""
        return self._part(self.layout.segment_offsets, self.num_experts + 1)

    @property
    def segment_counts(self) -> torch.Tensor:
        """int32 [E]: routed (non-pad) rows at the start of each segment."""
        return self._part(self.layout.segment_counts, self.num_experts)

    @property
    def dropped(self) -> torch.Tensor:
        """int32 0-d on the device: the routes permute dropped, past the row cap or without a slot.
        Read it when you want; permute never does (no host sync)."""
        return self.row_map[self.layout.route_tallies]

    @property
    def unslotted(self) -> torch.Tensor:
        """int32 0-d on the device: the dropped routes that had no slot (index routing: ids outside
        [-1, E); mask routing: routes past a token's first W, the topk hint)."""
        return self.row_map[self.layout.route_tallies + 1]

    def rows_by_column(self) -> torch.Tensor:
        """int64 [N, columns of the routing]: the row of route (token, column), -1 where none lands.

        Columns are the routing's: slots for index routing, experts for mask routing (the probs'
        layout). For inspection and tests; the kernels read the compact form."""
        dst = self.dst_rows.long()
        if not self.is_mask:
            return dst
        dense = torch.full((self.num_tokens, self.num_experts + 1), -1, dtype=torch.long, device=dst.device)
        slot = torch.arange(self.width, device=dst.device)
        live = slot[None, :] < self.route_counts.long()[:, None]
        dense.scatter_(1, torch.where(live, self.experts.long(), self.num_experts), torch.where(live, dst, -1))
        return dense[:, :self.num_experts]


class PermuteResult(NamedTuple):
    tokens: torch.Tensor  # [M, H] in the variant's token dtype, expert-major
    probs: Optional[torch.Tensor]  # [M]: each row's router prob, or None (variant without probs)
    scale: Optional[torch.Tensor]  # [M, S]: each row's scales, or None (variant without scales)
    row_id_map: RowIdMap
    tokens_per_expert: torch.Tensor  # int64 [E] on the device: rows of each segment, padding included

    @property
    def dropped(self) -> torch.Tensor:
        """int32 0-d on the device: routes dropped, past num_out_tokens or without a slot (see
        RowIdMap.dropped); a view of the row map, so reading it is the only sync."""
        return self.row_id_map.dropped


# TransformerEngine's functions (permgen.integrations.te) return the row map as one int32 tensor shaped so that
# moe_unpermute reads every size it needs from it, whatever arguments it is given:
#     mask maps    [N + 2, 2E + 1]               the row map (W = E), viewed 2-D (RowMapLayout.words)
#     padded maps  [align_size, N + 2, 2E + 1]   the same, broadcast over a first dimension of
#                                                align_size (stride 0: no memory), the alignment
#     index maps   [N + 1, N + 2E + 3, k, 1]     the row map viewed [N + 2E + 3, k, 1], broadcast over
#                                                a first dimension of N + 1 (stride 0): N; four
#                                                dimensions, so that no index map has a mask map's shape

def te_row_id_map(row_id_map: RowIdMap, map_type: str, pad: int) -> torch.Tensor:
    """The row map of a permute as TransformerEngine's row_id_map (the layout above). Eagerly, the
    row map's memory records the view made of it, so that a part of it is known (te_row_id_map_sizes)."""
    if map_type == "index":
        te_map = row_id_map.row_map.view(-1, row_id_map.width, 1).expand(row_id_map.num_tokens + 1, -1, -1, -1)
    else:
        rows = row_id_map.row_map.view(-1, 2 * row_id_map.num_experts + 1)
        te_map = rows.expand(pad, -1, -1) if pad else rows
    if not torch.compiler.is_compiling():
        te_map._base._permgen_te_view = _view_of(te_map)
    return te_map


def _view_of(t: torch.Tensor) -> tuple:
    """Where a view's elements lie (a dimension of one element has no stride that matters)."""
    return t.shape, tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride())), t.storage_offset()


def _whole(row_id_map: torch.Tensor, words: torch.Tensor) -> bool:
    """Whether row_id_map, whose row map words are `words`, is all of a map: the view the permute made
    (as its memory records), or without that record, a tensor whose words start its memory and fill it,
    contiguous (a padded or index map: its broadcast over the first dimension, or a copy of that)."""
    made = getattr(row_id_map._base, "_permgen_te_view", None)
    if made is not None:
        return made == _view_of(row_id_map)
    stored = row_id_map.untyped_storage().nbytes() // row_id_map.element_size()
    if row_id_map.dim() > 2 and row_id_map.stride(0) != 0:  # a copy of a broadcast map: all of it in memory
        words = row_id_map
    return row_id_map.storage_offset() == 0 and words.is_contiguous() and stored == words.numel()


def te_row_id_map_sizes(row_id_map, map_type: str, where: str):
    """(row map [words], N, W, E, pad) read from a TransformerEngine-style row_id_map's shape.

    A shape that is not the map_type's is refused: an index map read as a mask map (or the reverse)
    would be read at the wrong offsets. Mask maps have 2 or 3 dimensions (a padded one's first is the
    alignment, a power of two <= MAX_PAD; the last is 2E + 1, odd), index maps 4 (the last 1; the
    second less the first is 2E + 2, even and >= 4): the shape alone tells them apart. A part of a
    map (a slice, or another view of it) is refused, eagerly: see _whole. Values are never read, so a
    copy of a part passes as the whole map of fewer tokens."""
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dtype != torch.int32:
        raise TypeError(f"{where}: row_id_map must be the int32 tensor returned by permgen's moe_permute functions")
    shape = list(row_id_map.shape)
    if map_type == "index":
        if row_id_map.dim() != 4 or shape[3] != 1 or shape[2] < 1 or (shape[1] - shape[0]) % 2 \
                or shape[1] - shape[0] < 4:
            raise ValueError(f"{where}: map_type='index', but row_id_map {shape} is not an index map "
                             "[N + 1, N + 2E + 3, k, 1] (is map_type the one given to moe_permute?)")
        num_tokens, width = shape[0] - 1, shape[2]
        num_experts = (shape[1] - num_tokens - 3) // 2
        sizes = num_tokens, width, num_experts, 0
    else:
        pad = shape[0] if row_id_map.dim() == 3 else 0
        if row_id_map.dim() not in (2, 3) or shape[-1] % 2 == 0 or shape[-1] < 3 or shape[-2] < 2 \
                or (row_id_map.dim() == 3 and not (0 < pad <= MAX_PAD and pad & (pad - 1) == 0)):
            raise ValueError(f"{where}: map_type='mask', but row_id_map {shape} is not a mask map [N + 2, 2E + 1] "
                             f"([align_size, N + 2, 2E + 1] padded, align_size a power of two <= {MAX_PAD}) "
                             "(is map_type the one given to moe_permute?)")
        num_experts = (shape[-1] - 1) // 2
        sizes = shape[-2] - 2, num_experts, num_experts, pad
    words = row_id_map if row_id_map.dim() == 2 else row_id_map[0]
    # A part's shape can be a map's: it would be read as the map of other sizes, at other offsets.
    # (Under torch.compile the map is read by its shape alone: Dynamo traces no storage.)
    if not torch.compiler.is_compiling() and not _whole(row_id_map, words):
        raise ValueError(f"{where}: row_id_map {shape} is a part of the map a permute returned (a slice or "
                         "other view); pass the whole map")
    return (words.reshape(-1), *sizes)
