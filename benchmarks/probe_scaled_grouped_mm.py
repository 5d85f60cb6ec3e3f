"""What the installed torch's torch._scaled_grouped_mm accepts on this GPU, and how fast it is against
torch._grouped_mm at the layer shapes. Prints a short table (python3 benchmarks/probe_scaled_grouped_mm.py)."""
import sys
import torch
import triton

dev = "cuda"
f8 = torch.float8_e4m3fn
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
try:
    print("schema:", torch.ops.aten._scaled_grouped_mm.default._schema)
except Exception as e:
    print("schema: ?", e)
import torch.nn.functional as F
print("F.scaled_grouped_mm:", hasattr(F, "scaled_grouped_mm"), " F.scaled_mm:", hasattr(F, "scaled_mm"))
if hasattr(F, "scaled_grouped_mm"):
    import inspect
    try:
        print("  sig:", inspect.signature(F.scaled_grouped_mm))
    except Exception as e:
        print("  sig ?", e)
    import torch.nn.functional as FF
    for n in ("ScalingType", "SwizzleType"):
        t = getattr(FF, n, None)
        print(" ", n, list(t.__members__) if t is not None else None)


def q_rows(x):  # rowwise along last dim
    amax = x.float().abs().amax(-1).clamp(min=1e-4)
    s = amax / 448.0
    return (x.float() / s[..., None]).clamp(-448, 448).to(f8), s


def try_(label, fn):
    try:
        r = fn()
        print(f"OK   {label}" + (f": {r}" if r is not None else ""))
        return True
    except Exception as e:
        msg = str(e).strip().splitlines()
        print(f"FAIL {label}: {type(e).__name__}: {' | '.join(msg[:2])[:300]}")
        return False


def sqnr(ref, x):
    ref, x = ref.float(), x.float()
    return f"{(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum())).item():.1f} dB"


torch.manual_seed(0)
M, K, N, E = 256, 512, 384, 4
offs = torch.tensor([64, 96, 192, 256], dtype=torch.int32, device=dev)
a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
b = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / 20
aq, sa = q_rows(a)
bq_t, sb = q_rows(b.transpose(-2, -1).contiguous())  # [E, N, K], scales [E, N]
bq = bq_t.transpose(-2, -1)  # [E, K, N] column-major
ref = torch._grouped_mm(a, b, offs=offs)


def run2d3d(aq=aq, sa=sa, bq=bq, sb=sb, offs=offs, **kw):
    return torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16, **kw)


try_("2d-3d rowwise, A row-major, B col-major, sa[M] sb[E,N]", lambda: sqnr(ref, run2d3d()))
try_("  use_fast_accum=True", lambda: sqnr(ref, run2d3d(use_fast_accum=True)))
try_("  B row-major (contiguous [E,K,N])", lambda: sqnr(ref, run2d3d(bq=bq.contiguous())))
try_("  sa as [M,1]", lambda: sqnr(ref, run2d3d(sa=sa[:, None])))
try_("  sb as [E,1,N]", lambda: sqnr(ref, run2d3d(sb=sb[:, None, :])))
try_("  out_dtype=float32", lambda: torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.float32).dtype)
try_("  e5m2 A", lambda: sqnr(ref, run2d3d(aq=aq.float().to(torch.float8_e5m2))))
for o in ([5, 37, 200, 256], [0, 64, 64, 256], [64, 96, 192, 240]):
    oo = torch.tensor(o, dtype=torch.int32, device=dev)
    r = torch._grouped_mm(a, b, offs=oo)
    def f(oo=oo, r=r, o=o):
        out = run2d3d(offs=oo)
        tail = out[o[-1]:]
        return (sqnr(r[:o[-1]], out[:o[-1]]) + (f", rows past offs[-1]: finite={bool(torch.isfinite(tail).all())} max={tail.float().abs().max().item() if tail.numel() else 0}" if tail.numel() else ""))
    try_(f"  offs {o}", f)
# pad rows with zero scale
def zero_scale():
    sa2 = sa.clone(); sa2[60:64] = 0
    aq2 = aq.clone(); aq2[60:64] = 0
    out = run2d3d(aq=aq2, sa=sa2)
    return f"pad rows out={out[60:64].abs().max().item()} rest {sqnr(ref[:60], out[:60])}"
try_("  zero rows with zero scale", zero_scale)
# blockwise 1x128 / 128x128
try_("2d-3d blockwise sa[M,K/128] sb[E,N/128,K/128]", lambda: sqnr(ref, run2d3d(
    sa=sa[:, None].expand(M, K // 128).contiguous(), sb=sb.reshape(E, N // 128, 128)[:, :, :1].expand(E, N // 128, K // 128).contiguous())))
try_("2d-3d blockwise sa[M,K/128] sb[E,N,K/128]", lambda: sqnr(ref, run2d3d(
    sa=sa[:, None].expand(M, K // 128).contiguous(), sb=sb[:, :, None].expand(E, N, K // 128).contiguous())))
if hasattr(F, "scaled_grouped_mm"):
    try:
        ST = F.ScalingType
        try_("F.scaled_grouped_mm RowWise", lambda: sqnr(ref, F.scaled_grouped_mm(aq, bq, sa, ST.RowWise, sb, ST.RowWise, offs=offs, output_dtype=torch.bfloat16)))
        try_("F.scaled_grouped_mm BlockWise1x128", lambda: sqnr(ref, F.scaled_grouped_mm(
            aq, bq, sa[:, None].expand(M, K // 128).contiguous(), ST.BlockWise1x128,
            sb[:, :, None].expand(E, N, K // 128).contiguous(), ST.BlockWise1x128, offs=offs, output_dtype=torch.bfloat16)))
    except Exception as e:
        print("F.scaled_grouped_mm probe failed:", e)

# 2d-2d (wgrad): out[e] = A[:, group e]^T-ish. torchao: grad_w = grad_out_t [N, M] @ x [M, K], offs along M.
go = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
ref_w = torch._grouped_mm(go.t(), a, offs=offs)  # [E, N, K]
def q_groups_cols(x, offs):  # x [M, C]: scales per (group, column) along M -> [E*C]
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    qs, ss = [], []
    out = torch.empty_like(x, dtype=f8)
    for e in range(len(offs)):
        s0, s1 = int(starts[e]), int(offs[e])
        amax = x[s0:s1].float().abs().amax(0).clamp(min=1e-4)
        s = amax / 448
        out[s0:s1] = (x[s0:s1].float() / s).clamp(-448, 448).to(f8)
        ss.append(s)
    return out, torch.cat(ss)
goq, sgo = q_groups_cols(go, offs)
xq, sx = q_groups_cols(a, offs)
try_("2d-2d: A=goq.t() [N,M] (col-major view), B=xq [M,K] (row-major), sa[E*N], sb[E*K]", lambda: sqnr(ref_w, torch._scaled_grouped_mm(
    goq.t(), xq, sgo, sx, offs=offs, out_dtype=torch.bfloat16)))
try_("2d-2d: A=goq.t().contiguous() row-major, B=xq.t().contiguous().t() col-major", lambda: sqnr(ref_w, torch._scaled_grouped_mm(
    goq.t().contiguous(), xq.t().contiguous().t(), sgo, sx, offs=offs, out_dtype=torch.bfloat16)))
# compile
def fn(aq, bq, sa, sb, offs):
    return torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16) * 2
try_("torch.compile(fullgraph=True) of _scaled_grouped_mm", lambda: sqnr(ref * 2, torch.compile(fn, fullgraph=True)(aq, bq, sa, sb, offs)))

# timings
from triton.testing import do_bench
shapes = {"qwen3": (16384 * 8, 2048, 768, 128), "dsv3": (16384 * 8, 7168, 2048, 256), "mixtral": (16384 * 2, 4096, 14336, 8)}
print(f"\n{'shape':8} {'gemm':22} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8 fast':>8} {'ratio':>6}")
for name, (M, H, Fw, E) in shapes.items():
    g = torch.full((E,), M // E, dtype=torch.int64)
    offs = torch.cumsum(g, 0).to(torch.int32).to(dev)
    for label, K, N in (("fwd1 x@w1 [H->2F]", H, 2 * Fw), ("fwd2 a@w2 [F->H]", Fw, H), ("dgrad1 dh@w1T [2F->H]", 2 * Fw, H), ("dgrad2 dy@w2T [H->F]", H, Fw)):
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
        aq = a.to(f8); bq = b.to(f8); sa = torch.ones(M, device=dev); sb = torch.ones(E, N, device=dev)
        tb = do_bench(lambda: torch._grouped_mm(a, b, offs=offs), warmup=3, rep=15)
        tf = do_bench(lambda: torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16), warmup=3, rep=15)
        try:
            tff = do_bench(lambda: torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True), warmup=3, rep=15)
        except Exception:
            tff = float("nan")
        print(f"{name:8} {label:22} {tb:8.3f} {tf:8.3f} {tff:8.3f} {tf / tb:6.2f}")
        del a, b, aq, bq
    for label, K, N in (("wgrad1 xT@dh [E,H,2F]", H, 2 * Fw), ("wgrad2 aT@dy [E,F,H]", Fw, H)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        d = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        tb = do_bench(lambda: torch._grouped_mm(x.t(), d, offs=offs), warmup=3, rep=15)
        xq = x.t().contiguous().to(f8); dq = d.t().contiguous().t().to(f8)
        try:
            tf = do_bench(lambda: torch._scaled_grouped_mm(xq, dq, torch.ones(E * K, device=dev), torch.ones(E * N, device=dev), offs=offs, out_dtype=torch.bfloat16), warmup=3, rep=15)
        except Exception as e:
            print("  wgrad fp8 failed:", str(e)[:200]); tf = float("nan")
        print(f"{name:8} {label:22} {tb:8.3f} {tf:8.3f} {'':>8} {tf / tb:6.2f}")
        del x, d, xq, dq
    # weight quantisation with torch ops (amax over K, transpose to column-major), one direction
    w = torch.randn(E, H, 2 * Fw, device=dev, dtype=torch.bfloat16)
    def quant_w():
        amax = w.abs().amax(1).float().clamp(min=1e-4)
        return (w / (amax / 448)[:, None, :]).to(f8), amax
    tq = do_bench(quant_w, warmup=1, rep=8)
    tc = do_bench(lambda: w.clone(), warmup=1, rep=8)
    print(f"{name:8} w1 quant (torch ops)   {tq:8.3f} ms; clone of w1 {tc:.3f} ms ({w.numel() * 2 / 2**30:.2f} GiB)")
    del w
    torch.cuda.empty_cache()
