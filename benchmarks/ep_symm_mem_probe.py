"""Does this torch have the symmetric-memory MoE all-to-all (torch.distributed._symmetric_memory,
all_to_all_vdev_2d), and does it run on a one-rank NCCL group? Run under torchrun on a GPU:

    torchrun --nproc-per-node 1 benchmarks/ep_symm_mem_probe.py
"""

import traceback

import torch
import torch.distributed as dist

dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
print("torch", torch.__version__)
try:
    import torch.distributed._symmetric_memory as symm_mem
except Exception:  # noqa: BLE001
    print("no torch.distributed._symmetric_memory:", traceback.format_exc(limit=1))
    raise SystemExit(0)
print("module:", [a for a in dir(symm_mem) if "all_to_all" in a or "backend" in a.lower() or "nvshmem" in a.lower()])
print("ops:", [n for n in dir(torch.ops.symm_mem) if "all_to_all" in n])
for name in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset"):
    op = getattr(torch.ops.symm_mem, name, None)
    print(name, None if op is None else op.default._schema)
for probe in ("is_nvshmem_available",):
    fn = getattr(symm_mem, probe, None)
    try:
        print(probe, None if fn is None else fn())
    except Exception as e:  # noqa: BLE001
        print(probe, "raised", repr(e))
try:
    symm_mem.set_backend("NVSHMEM")
    print("set_backend NVSHMEM ok")
except Exception as e:  # noqa: BLE001
    print("set_backend NVSHMEM raised", repr(e)[:300])
try:
    experts, hidden, rows = 4, 16, 64
    group_name = dist.group.WORLD.group_name
    inp = symm_mem.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    out = symm_mem.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    in_splits = symm_mem.empty(experts, dtype=torch.int64, device="cuda")
    out_splits_offsets = symm_mem.empty((2, experts), dtype=torch.int64, device="cuda")
    for t in (inp, out, in_splits, out_splits_offsets):
        symm_mem.rendezvous(t, group_name)
    splits = torch.tensor([3, 1, 0, 5], device="cuda")
    in_splits.copy_(splits)
    inp.copy_(torch.randn(rows, hidden, device="cuda").to(torch.bfloat16))
    torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_splits_offsets, group_name)
    torch.cuda.synchronize()
    print("all_to_all_vdev_2d ran: out_splits_offsets", out_splits_offsets.tolist(),
          "rows equal:", bool(torch.equal(out[:9], inp[:9])))
except Exception:  # noqa: BLE001
    print("all_to_all_vdev_2d at world size 1 failed:", traceback.format_exc()[-800:])
dist.destroy_process_group()
