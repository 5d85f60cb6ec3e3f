"""How fast can the GPU write? permute is ~90% writes, so its floor is set by write bandwidth.

    python3 benchmarks/write_bandwidth.py        (needs a CUDA GPU)

Measures, on permute's DeepSeek-V3 traffic (16384 rows of 14 KiB read, each written 8 times):
a device-to-device copy, PyTorch fill, Triton write-only kernels with each store cache hint, and
Triton 1-read-8-writes broadcasts to contiguous and to scattered rows. GB/s counts bytes read +
written, like the copy floor in bench.py.
"""

import torch
import triton
import triton.language as tl

from bench import bench
from copy_patterns import broadcast_kernel, expert_sorted_rows, fill_kernel

N, H, K = 16384, 7168, 8


@triton.jit
def copy_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    for s in range(STEPS):
        offs = base + s * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def broadcast_rowwise_kernel(src_ptr, dst_rows_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Whole row in registers, then K row stores one after another (long contiguous write bursts)."""
    token = tl.program_id(0)
    src = src_ptr + token.to(tl.int64) * hidden
    col = tl.arange(0, BLOCK_H)
    x = tl.load(src + col, mask=col < hidden)
    for j in tl.static_range(K):
        dst = tl.load(dst_rows_ptr + token * K + j).to(tl.int64)
        tl.store(out_ptr + dst * hidden + col, x, mask=col < hidden)


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    tokens = torch.randint(-2**31, 2**31 - 1, (N, H * 2 // 4), dtype=torch.int32, device="cuda")  # bf16 rows as words
    out = torch.empty(N * K, tokens.shape[1], dtype=torch.int32, device="cuda")
    words = tokens.shape[1]
    write_bytes = out.numel() * 4
    total = write_bytes + tokens.numel() * 4

    def report(name, us, nbytes):
        print(f"{name:58s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s", flush=True)

    src = torch.empty(write_bytes // 4, dtype=torch.int32, device="cuda").random_()
    flat = out.view(-1)
    report("torch copy_ (read + write)", bench(lambda: flat.copy_(src)), 2 * write_bytes)
    report("torch fill_ (write only)", bench(lambda: out.fill_(3)), write_bytes)
    report("torch zero_ (memset)", bench(lambda: out.zero_()), write_bytes)
    n = flat.numel()
    for block, steps, warps in [(1024, 4, 4), (2048, 8, 8), (4096, 4, 8), (512, 16, 4)]:
        grid = (triton.cdiv(n, block * steps),)
        report(f"triton copy block={block} steps={steps} warps={warps}",
               bench(lambda: copy_kernel[grid](src, flat, n, BLOCK=block, STEPS=steps, num_warps=warps)), 2 * write_bytes)
        for hint in ("", ".cs", ".cg", ".wt"):
            report(f"triton fill block={block} steps={steps} warps={warps} hint={hint or 'none'}",
                   bench(lambda: fill_kernel[grid](flat, n, BLOCK=block, STEPS=steps, HINT=hint, num_warps=warps)),
                   write_bytes)

    contiguous = torch.arange(N * K, dtype=torch.int32, device="cuda").view(N, K)
    scattered = torch.randperm(N * K, device="cuda").to(torch.int32).view(N, K)
    sorted_rows = expert_sorted_rows(N, 256, K)  # as permute writes them
    for name, rows in [("contiguous", contiguous), ("expert-sorted", sorted_rows), ("random", scattered)]:
        for block_h, warps in [(512, 4), (1024, 8), (256, 2)]:
            for hint in ("", ".cs"):
                report(f"triton broadcast 1->8 {name} BLOCK_H={block_h} warps={warps} hint={hint or 'none'}",
                       bench(lambda: broadcast_kernel[(N,)](tokens, rows, out, N, words, K=K, BLOCK_H=block_h, MODE=0,
                                                            STAGES=1, TOKENS=1, HINT=hint, num_warps=warps)), total)
        for warps in (4, 8, 16):
            report(f"triton broadcast 1->8 {name} row in registers warps={warps}",
                   bench(lambda: broadcast_rowwise_kernel[(N,)](tokens, rows, out, words, K=K,
                                                                   BLOCK_H=triton.next_power_of_2(words),
                                                                   num_warps=warps)), total)


if __name__ == "__main__":
    main()
