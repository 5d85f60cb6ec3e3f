"""Which way of moving rows runs closest to the copy floor? Routing-free versions of each kernel's
data movement, timed side by side in one run.

    python3 benchmarks/copy_patterns.py        (needs a CUDA GPU)

- broadcast (permute): each token row read once and written to k expert-sorted rows;
- gather (unpermute): k rows read, weighted, summed, one row written;
- scatter-dot (unpermute backward): a grad row read once, k rows read for the prob grads, k rows
  written.
Each pattern is timed as the kernels do it now (one chunk of a row per loop step), with the next
chunk's loads issued before the current chunk's stores (prefetch), with Triton's pipeliner
(`tl.range(num_stages=...)`), with several tokens per program, and, for the broadcast, with TMA
stores. Ratios are to the device-to-device copy of the same run.
"""

import torch
import triton
import triton.language as tl

from bench import bench, copy_bandwidth

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton
    TensorDescriptor = None


@triton.jit
def broadcast_kernel(src_ptr, dst_rows_ptr, out_ptr, num_tokens, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr,
                     MODE: tl.constexpr, STAGES: tl.constexpr, TOKENS: tl.constexpr, HINT: tl.constexpr = ""):
    """MODE 0: load a chunk, store it k times; 1: prefetch the next chunk first; 2: tl.range pipeliner.
    HINT: the stores' cache modifier."""
    for t in tl.static_range(TOKENS):
        token = tl.program_id(0) * TOKENS + t
        if token < num_tokens:
            dst = tl.load(dst_rows_ptr + token * K + tl.arange(0, K)).to(tl.int64)[:, None] * hidden
            src = src_ptr + token.to(tl.int64) * hidden
            col = tl.arange(0, BLOCK_H)
            if MODE == 1:
                x = tl.load(src + col, mask=col < hidden)
                for h0 in range(BLOCK_H, hidden + BLOCK_H, BLOCK_H):
                    nxt = tl.load(src + h0 + col, mask=h0 + col < hidden)
                    c = h0 - BLOCK_H + col
                    tl.store(out_ptr + dst + c[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)),
                             mask=(c < hidden)[None, :], cache_modifier=HINT)
                    x = nxt
            elif MODE == 2:
                for h0 in tl.range(0, hidden, BLOCK_H, num_stages=STAGES):
                    c = h0 + col
                    x = tl.load(src + c, mask=c < hidden)
                    tl.store(out_ptr + dst + c[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)),
                             mask=(c < hidden)[None, :], cache_modifier=HINT)
            else:
                for h0 in range(0, hidden, BLOCK_H):
                    c = h0 + col
                    x = tl.load(src + c, mask=c < hidden)
                    tl.store(out_ptr + dst + c[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)),
                             mask=(c < hidden)[None, :], cache_modifier=HINT)


@triton.jit
def broadcast_persistent_kernel(src_ptr, dst_rows_ptr, out_ptr, num_tokens, hidden, K: tl.constexpr,
                                BLOCK_H: tl.constexpr):
    col = tl.arange(0, BLOCK_H)
    for token in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        dst = tl.load(dst_rows_ptr + token * K + tl.arange(0, K)).to(tl.int64)[:, None] * hidden
        src = src_ptr + token.to(tl.int64) * hidden
        x = tl.load(src + col, mask=col < hidden)
        for h0 in range(BLOCK_H, hidden + BLOCK_H, BLOCK_H):
            nxt = tl.load(src + h0 + col, mask=h0 + col < hidden)
            c = h0 - BLOCK_H + col
            tl.store(out_ptr + dst + c[None, :], tl.broadcast_to(x[None, :], (K, BLOCK_H)), mask=(c < hidden)[None, :])
            x = nxt


@triton.jit
def broadcast_tma_kernel(src_ptr, dst_rows_ptr, out_desc, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Each chunk stored to the k rows by TMA (one bulk copy per row and chunk)."""
    token = tl.program_id(0)
    src = src_ptr + token.to(tl.int64) * hidden
    col = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden, BLOCK_H):
        x = tl.load(src + h0 + col)
        for j in tl.static_range(K):
            dst = tl.load(dst_rows_ptr + token * K + j)
            out_desc.store([dst, h0], x[None, :])


@triton.jit
def scatter_fill_kernel(dst_rows_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """permute's write pattern (k expert-sorted rows per program) with nothing read: constants stored."""
    token = tl.program_id(0)
    dst = tl.load(dst_rows_ptr + token * K + tl.arange(0, K)).to(tl.int64)[:, None] * hidden
    x = tl.full([K, BLOCK_H], 7, out_ptr.dtype.element_ty)
    for h0 in range(0, hidden, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        tl.store(out_ptr + dst + c[None, :], x, mask=(c < hidden)[None, :])


@triton.jit
def _grid_barrier(counter_ptr, target, arrive):
    """Wait until every program of the grid has arrived (the counter reaches target). Needs all
    programs resident at once; gives up after a bounded spin rather than hang if they are not."""
    tl.atomic_add(counter_ptr, arrive, sem="release")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < 20000):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        spins += 1


@triton.jit
def phased_broadcast_kernel(src_ptr, dst_rows_ptr, out_ptr, counter_ptr, num_tokens, hidden, K: tl.constexpr,
                            BLOCK_H: tl.constexpr, TOKENS: tl.constexpr, WRITE_BARRIER: tl.constexpr):
    """The broadcast in grid-wide phases: every program reads TOKENS whole rows, all wait, every
    program writes them (and, with WRITE_BARRIER, all wait again), so that reads and writes reach
    memory apart rather than mixed."""
    programs = tl.num_programs(0)
    col = tl.arange(0, BLOCK_H)
    slot = tl.arange(0, TOKENS)
    phase = 0
    for base in range(0, num_tokens, programs * TOKENS):
        token = base + tl.program_id(0) * TOKENS + slot
        ok = token < num_tokens
        x = tl.load(src_ptr + token.to(tl.int64)[:, None] * hidden + col[None, :],
                    mask=ok[:, None] & (col < hidden)[None, :])
        # Arrive only once the rows are in registers: the arrival depends on their values.
        loaded = (tl.max(tl.max(x, axis=1), axis=0) == 12345.0).to(tl.int32)
        arrivals = (2 if WRITE_BARRIER else 1) * phase + 1
        _grid_barrier(counter_ptr, programs * arrivals, 1 + loaded)
        for j in tl.static_range(K):
            dst = tl.load(dst_rows_ptr + token * K + j, mask=ok).to(tl.int64)
            tl.store(out_ptr + dst[:, None] * hidden + col[None, :], x, mask=ok[:, None] & (col < hidden)[None, :])
        if WRITE_BARRIER:
            _grid_barrier(counter_ptr, programs * (arrivals + 1), 1)
        phase += 1


@triton.jit
def fill_kernel(out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr, HINT: tl.constexpr = ""):
    """Write-only: each program stores STEPS blocks of int32 words (HINT: the stores' cache modifier)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    for s in range(STEPS):
        offs = base + s * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.full([BLOCK], 7, tl.int32), mask=offs < n, cache_modifier=HINT)


@triton.jit
def gather_kernel(rows_ptr, dst_rows_ptr, probs_ptr, out_ptr, num_tokens, hidden, K: tl.constexpr,
                  BLOCK_H: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr, TOKENS: tl.constexpr):
    for t in tl.static_range(TOKENS):
        token = tl.program_id(0) * TOKENS + t
        if token < num_tokens:
            slot = tl.arange(0, K)
            dst = tl.load(dst_rows_ptr + token * K + slot)
            kept = dst >= 0
            prob = tl.load(probs_ptr + token * K + slot, mask=kept, other=0).to(tl.float32)
            src_row = dst.to(tl.int64)[:, None] * hidden
            out = out_ptr + token.to(tl.int64) * hidden
            col = tl.arange(0, BLOCK_H)
            if MODE == 1:
                x = tl.load(rows_ptr + src_row + col[None, :], mask=kept[:, None] & (col < hidden)[None, :], other=0)
                for h0 in range(BLOCK_H, hidden + BLOCK_H, BLOCK_H):
                    c = h0 + col
                    nxt = tl.load(rows_ptr + src_row + c[None, :], mask=kept[:, None] & (c < hidden)[None, :], other=0)
                    acc = tl.sum(x.to(tl.float32) * prob[:, None], axis=0)
                    tl.store(out + c - BLOCK_H, acc.to(out_ptr.dtype.element_ty), mask=c - BLOCK_H < hidden)
                    x = nxt
            elif MODE == 2:
                for h0 in tl.range(0, hidden, BLOCK_H, num_stages=STAGES):
                    c = h0 + col
                    x = tl.load(rows_ptr + src_row + c[None, :], mask=kept[:, None] & (c < hidden)[None, :], other=0)
                    acc = tl.sum(x.to(tl.float32) * prob[:, None], axis=0)
                    tl.store(out + c, acc.to(out_ptr.dtype.element_ty), mask=c < hidden)
            else:
                for h0 in range(0, hidden, BLOCK_H):
                    c = h0 + col
                    x = tl.load(rows_ptr + src_row + c[None, :], mask=kept[:, None] & (c < hidden)[None, :], other=0)
                    acc = tl.sum(x.to(tl.float32) * prob[:, None], axis=0)
                    tl.store(out + c, acc.to(out_ptr.dtype.element_ty), mask=c < hidden)


@triton.jit
def scatter_dot_kernel(grad_ptr, dst_rows_ptr, probs_ptr, permuted_ptr, grad_probs_ptr, grad_rows_ptr, num_tokens,
                       hidden, K: tl.constexpr, BLOCK_H: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.arange(0, K)
    dst = tl.load(dst_rows_ptr + token * K + slot)
    kept = dst >= 0
    prob = tl.load(probs_ptr + token * K + slot, mask=kept, other=0).to(tl.float32)
    src = grad_ptr + token.to(tl.int64) * hidden
    dst_row = dst.to(tl.int64)[:, None] * hidden
    prob_grad = tl.zeros([K], dtype=tl.float32)
    col = tl.arange(0, BLOCK_H)
    if MODE == 1:
        g = tl.load(src + col, mask=col < hidden, other=0)
        x = tl.load(permuted_ptr + dst_row + col[None, :], mask=kept[:, None] & (col < hidden)[None, :], other=0)
        for h0 in range(BLOCK_H, hidden + BLOCK_H, BLOCK_H):
            c = h0 + col
            g_next = tl.load(src + c, mask=c < hidden, other=0)
            x_next = tl.load(permuted_ptr + dst_row + c[None, :], mask=kept[:, None] & (c < hidden)[None, :], other=0)
            gf = g.to(tl.float32)
            prob_grad += tl.sum(x.to(tl.float32) * gf[None, :], axis=1)
            cur = c - BLOCK_H
            tl.store(grad_rows_ptr + dst_row + cur[None, :], (prob[:, None] * gf[None, :]).to(grad_rows_ptr.dtype.element_ty),
                     mask=kept[:, None] & (cur < hidden)[None, :])
            g = g_next
            x = x_next
    else:
        for h0 in tl.range(0, hidden, BLOCK_H, num_stages=STAGES):
            c = h0 + col
            row_mask = kept[:, None] & (c < hidden)[None, :]
            gf = tl.load(src + c, mask=c < hidden, other=0).to(tl.float32)
            x = tl.load(permuted_ptr + dst_row + c[None, :], mask=row_mask, other=0).to(tl.float32)
            prob_grad += tl.sum(x * gf[None, :], axis=1)
            tl.store(grad_rows_ptr + dst_row + c[None, :], (prob[:, None] * gf[None, :]).to(grad_rows_ptr.dtype.element_ty),
                     mask=row_mask)
    tl.store(grad_probs_ptr + token * K + slot, prob_grad)


def expert_sorted_rows(N, E, K):
    """dst rows [N, K] in permute's layout: expert-major, ascending token within an expert."""
    experts = torch.rand(N, E, device="cuda").topk(K, dim=1).indices
    order = experts.flatten().argsort(stable=True)
    rows = torch.empty(N * K, dtype=torch.int32, device="cuda")
    rows[order] = torch.arange(N * K, dtype=torch.int32, device="cuda")
    return rows.view(N, K)


def main():
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    copy_bw = copy_bandwidth()
    words = torch.empty(2**29, dtype=torch.int32, device="cuda")
    fill_bw = words.numel() * 4 / (bench(lambda: fill_kernel[(triton.cdiv(words.numel(), 4096),)](
        words, words.numel(), BLOCK=1024, STEPS=4, num_warps=4)) * 1e-6)
    print(f"copy {copy_bw / 1e9:.0f} GB/s, triton fill {fill_bw / 1e9:.0f} GB/s")
    del words

    def report(name, fn, nbytes):
        try:
            us = bench(fn)
        except Exception as exc:  # a configuration this Triton cannot compile
            print(f"{name:60s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        print(f"{name:60s} {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s  x{us * 1e-6 * copy_bw / nbytes:.3f} floor",
              flush=True)

    for shape, N, H, E, K in [("deepseek_v3", 16384, 7168, 256, 8), ("qwen3", 16384, 2048, 128, 8),
                              ("mixtral", 16384, 4096, 8, 2)]:
        print(f"--- {shape}: N={N} H={H} E={E} k={K}")
        tokens = torch.randn(N, H, device="cuda").to(torch.bfloat16)
        rows = expert_sorted_rows(N, E, K)
        out = torch.empty(N * K, H, device="cuda", dtype=torch.bfloat16)
        nbytes = tokens.numel() * 2 + out.numel() * 2
        for mode, stages, tokens_per, warps, block in [(0, 1, 1, 4, 1024), (1, 1, 1, 4, 1024), (2, 2, 1, 4, 1024),
                                                       (2, 3, 1, 4, 1024), (0, 1, 2, 8, 1024), (1, 1, 2, 4, 1024),
                                                       (1, 1, 1, 8, 2048), (1, 1, 1, 2, 512)]:
            report(f"broadcast mode={mode} stages={stages} tokens={tokens_per} warps={warps} block={block}",
                   lambda: broadcast_kernel[(triton.cdiv(N, tokens_per),)](
                       tokens, rows, out, N, H, K=K, BLOCK_H=block, MODE=mode, STAGES=stages, TOKENS=tokens_per,
                       num_warps=warps), nbytes)
        report("scatter fill: the broadcast's writes, nothing read",
               lambda: scatter_fill_kernel[(N,)](rows, out, H, K=K, BLOCK_H=1024, num_warps=4), out.numel() * 2)
        reference = torch.empty_like(out)
        reference[rows.flatten().long()] = tokens.repeat_interleave(K, dim=0)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        for per_sm, tokens_per, warps, write_barrier in [(1, 4, 8, False), (2, 2, 8, False), (2, 4, 8, False),
                                                         (2, 4, 8, True), (4, 2, 4, False)]:
            grid = (sms * per_sm,)

            def phased():
                counter.zero_()
                phased_broadcast_kernel[grid](tokens, rows, out, counter, N, H, K=K,
                                              BLOCK_H=triton.next_power_of_2(H), TOKENS=tokens_per,
                                              WRITE_BARRIER=write_barrier, num_warps=warps)
            out.zero_()
            phased()
            same = torch.equal(out, reference)
            report(f"phased broadcast {per_sm}/SM tokens={tokens_per} warps={warps} "
                   f"write barrier={write_barrier} {'ok' if same else 'WRONG'}", phased, nbytes)
        del reference
        for regs in (32, 40):
            report(f"broadcast mode=0 warps=4 block=1024 maxnreg={regs}",
                   lambda: broadcast_kernel[(N,)](tokens, rows, out, N, H, K=K, BLOCK_H=1024, MODE=0, STAGES=1,
                                                  TOKENS=1, num_warps=4, maxnreg=regs), nbytes)
        for per_sm in (8, 16):
            report(f"broadcast persistent prefetch {per_sm}/SM",
                   lambda: broadcast_persistent_kernel[(sms * per_sm,)](tokens, rows, out, N, H, K=K, BLOCK_H=1024,
                                                                        num_warps=4), nbytes)
        if TensorDescriptor is not None:
            for block, warps in [(256, 4), (256, 2)]:
                try:
                    desc = TensorDescriptor.from_tensor(out, [1, block])
                except Exception as exc:
                    print(f"TMA descriptor failed: {exc}")
                    continue
                report(f"broadcast TMA store block={block} warps={warps}",
                       lambda: broadcast_tma_kernel[(N,)](tokens, rows, desc, H, K=K, BLOCK_H=block, num_warps=warps),
                       nbytes)

        rows_in = torch.randn(N * K, H, device="cuda").to(torch.bfloat16)
        probs = torch.rand(N, K, device="cuda")
        combined = torch.empty(N, H, device="cuda", dtype=torch.bfloat16)
        gbytes = rows_in.numel() * 2 + combined.numel() * 2
        for mode, stages, tokens_per, warps, block in [(0, 1, 1, 4, 1024), (1, 1, 1, 4, 1024), (2, 2, 1, 4, 1024),
                                                       (2, 3, 1, 4, 1024), (0, 1, 2, 4, 1024), (1, 1, 1, 8, 2048)]:
            report(f"gather mode={mode} stages={stages} tokens={tokens_per} warps={warps} block={block}",
                   lambda: gather_kernel[(triton.cdiv(N, tokens_per),)](
                       rows_in, rows, probs, combined, N, H, K=K, BLOCK_H=block, MODE=mode, STAGES=stages,
                       TOKENS=tokens_per, num_warps=warps), gbytes)
        for regs, block in ((64, 1024), (64, 2048), (80, 2048), (96, 4096), (128, 4096)):
            report(f"gather mode=0 warps=4 block={block} maxnreg={regs}",
                   lambda: gather_kernel[(N,)](rows_in, rows, probs, combined, N, H, K=K, BLOCK_H=block, MODE=0,
                                               STAGES=1, TOKENS=1, num_warps=4, maxnreg=regs), gbytes)
        grad_probs = torch.empty(N, K, device="cuda")
        sbytes = combined.numel() * 2 + 2 * rows_in.numel() * 2
        for mode, stages, warps, block in [(0, 1, 4, 1024), (1, 1, 4, 1024), (2, 2, 4, 1024), (2, 3, 4, 1024),
                                           (1, 1, 8, 2048)]:
            report(f"scatter-dot mode={mode} stages={stages} warps={warps} block={block}",
                   lambda: scatter_dot_kernel[(N,)](combined, rows, probs, rows_in, grad_probs, out, N, H, K=K,
                                                    BLOCK_H=block, MODE=mode, STAGES=stages, num_warps=warps), sbytes)
        for regs in (48, 64, 72):
            report(f"scatter-dot mode=0 warps=4 block=1024 maxnreg={regs}",
                   lambda: scatter_dot_kernel[(N,)](combined, rows, probs, rows_in, grad_probs, out, N, H, K=K,
                                                    BLOCK_H=1024, MODE=0, STAGES=1, num_warps=4, maxnreg=regs), sbytes)
        del tokens, out, rows_in, combined
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
