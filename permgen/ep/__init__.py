"""Expert parallelism on GPUs: `dispatch` and `combine` over torch.distributed, written once for
every Triton variant (each generated module binds them: `module.dispatch`, `module.combine`).

The experts are split evenly over the group's ranks in rank order: rank r owns experts
[r * L, (r + 1) * L), L = num_experts / world size. dispatch sends every route of this rank's
tokens to the rank owning its expert and returns, on each rank, the rows of its L experts:

    permute (the variant's kernels: rows expert-major, so destination-rank-major: the send buffer
             as it is, except for padded variants and capacity mode over several ranks, which pack
             it with one row gather)
      -> all_to_all_single of the rows (probs, scales beside them), split sizes per rank
      -> regroup the received rows from (source, local expert) to (local expert, source) order:
         one chunk sort (the variant's kernel, one pass at the copy floor), left out where the
         received rows already are in that order (one rank, or one local expert without capacity
         slots; never for padded variants)

Received rows are grouped by local expert; within an expert by source rank, then token (then
slot): the rows single-rank `permute` gives over all ranks' tokens concatenated in rank order,
restricted to this rank's experts. Padded variants pad on the receiver: each local expert's
segment, all sources together, is padded to a multiple of pad with zero rows, as single-rank
permute pads it (the sender's per-expert padding is not sent). combine runs the same steps
backwards (the inverse chunk sort, the reverse all-to-all) and merges with the variant's unpermute
kernels, which read the send buffer directly through permute's row map (padded variants and
packed sends: a copy of it whose routes point at their send rows, `send_map`, dropped routes at
-1). Both are differentiable: the backward pass of one is the other's data path, then permute's
(unpermute's) backward kernels over the same map.

Two modes:

- dropless (recv_capacity=None): the route counts per expert are counted on the device (by
  permute's routing kernel where permute's rows are known before the counts, else by a pass over
  the routing), exchanged with one small all-to-all and read back once, with the counts received
  and the routing check (the one device-to-host read, as Megatron's all-to-all dispatcher does);
  permute's rows move while the host waits for them and works out the split sizes. Nothing is
  dropped; expert ids out of range raise on every rank (check_routing=False skips it).
- fixed capacity (recv_capacity=C): C is per rank pair. Each rank sends every other rank (and
  itself) exactly C rows, so all split sizes are static: nothing is read back and nothing is
  allocated by data, so it is capturable in a CUDA graph and traces under
  torch.compile(fullgraph=True) (as custom ops: compiled.py). A sender keeps, per destination, its
  first C rows in its packed order (local expert, then token); the rest are dropped, never written
  anywhere, and contribute nothing in combine. The output has world_size * C rows (plus
  num_local_experts * (pad - 1) for padded variants): the kept rows in the layout above, then zero
  rows. `DispatchResult.dropped` counts, per source rank, the rows routed to this rank that did not
  fit. Mask routing sizes the sender's buffer by its routes per token: pass topk (permute's hint) or
  it is sized for num_experts routes per token. The routing is checked only with
  check_routing=True (one host read).

With one rank nothing is exchanged: the group's exchange is then the local one (group.py), whose
steps hand back what a rank would send itself, so a one-rank group costs what permute and unpermute
cost and runs the same code as any other.

Before any collective sized by them, eager dispatch and combine swap a few words on the host (the
ranks' input refusals, their settings; for combine the dispatch each handle comes from and its split
sizes) so that a rank refusing its input, or ranks that disagree, raise on every rank instead of
aborting gloo, leaving a peer waiting or reading rows at the wrong offsets (Exchange.agree).

The collectives move bytes, so every dtype goes through gloo (CPU) and NCCL (GPU) alike.

The package: group.py (a process group's facts and its exchange, the one-rank one included, and the
ranks' agreement), plan.py (a dispatch's plan: split sizes, send row map, regroup table, kept in its
handle), rows.py (the rows' paths of dispatch, combine and their backward passes, each written once),
api.py (the public functions: checks, agreement, autograd), compiled.py (capacity mode as custom ops).
"""

from .api import expert_parallel, run_combine, run_dispatch
from .group import GroupFacts
from .plan import DispatchResult, EpHandle

__all__ = ["DispatchResult", "EpHandle", "GroupFacts", "expert_parallel", "run_combine", "run_dispatch"]
