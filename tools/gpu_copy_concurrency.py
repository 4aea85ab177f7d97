"""How fast pinned host->device copies run while the GPU computes: 1 GiB copies on a side
stream, alone and behind 300 bf16 8192^3 GEMMs or 300 HBM-bound element-wise passes on the
default stream. Used to tell link contention from scheduling gaps in the streamed Flux
bench (run on the GPU machine; PyTorch only)."""
import torch, time
torch.backends.cuda.matmul.allow_tf32 = True
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
x = torch.randn(1 << 30, device='cuda', dtype=torch.bfloat16)
h = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
d = torch.empty(1 << 30, dtype=torch.uint8, device='cuda')
s = torch.cuda.Stream()
def copies(n):
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        st.record()
        for _ in range(n):
            d.copy_(h, non_blocking=True)
        en.record()
    return st, en
for _ in range(3):
    d.copy_(h, non_blocking=True)
torch.cuda.synchronize()
st, en = copies(10); torch.cuda.synchronize()
print("isolated h2d GB/s", 10 * (1 << 30) / (st.elapsed_time(en) / 1e3) / 1e9)
for name, work in [("gemm", lambda: a @ a), ("hbm elementwise", lambda: x.mul_(1.0))]:
    torch.cuda.synchronize()
    for _ in range(300):
        work()
    st, en = copies(10)
    torch.cuda.synchronize()
    print(f"h2d GB/s during {name}", 10 * (1 << 30) / (st.elapsed_time(en) / 1e3) / 1e9)
