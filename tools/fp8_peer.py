"""PyTorch's fp8 GEMM (`torch._scaled_mm`, cuBLASLt underneath) on this GPU: whether it runs
(per-tensor scales, a bf16 bias, fast and exact accumulation), and its time against bf16
`linear` at FLUX.1-dev's linear shapes (4608 tokens): the peer figure for `--compute fp8`
(issue 39). Needs torch with CUDA; prints one line per check and per shape.

Usage: python3 tools/fp8_peer.py
"""

import time

import torch

DEV = "cuda"
# (tokens, in, out) of FLUX.1-dev's transformer linears at 1024x1024.
SHAPES = [(4608, 3072, 3072), (4608, 3072, 9216), (4608, 3072, 12288), (4608, 12288, 3072),
          (4608, 15360, 3072), (4608, 3072, 21504)]


def seconds(f, n=10):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def main():
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    one = torch.tensor(1.0, device=DEV)
    a = torch.randn(256, 512, device=DEV).to(torch.float8_e4m3fn)
    b = torch.randn(384, 512, device=DEV).to(torch.float8_e4m3fn)
    bias = torch.randn(384, device=DEV, dtype=torch.bfloat16)
    for fast in (True, False):
        try:
            y = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, bias=bias,
                                 out_dtype=torch.bfloat16, use_fast_accum=fast)
            torch.cuda.synchronize()
            print(f"scaled_mm 256x512x384 + bias runs, fast_accum {fast}: mean |y| {y.float().abs().mean():.4f}")
        except RuntimeError as e:
            print(f"scaled_mm 256x512x384 + bias FAILED, fast_accum {fast}: {e!r}")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        bb = torch.randn(n, device=DEV, dtype=torch.bfloat16)
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        t16 = seconds(lambda: torch.nn.functional.linear(x, w, bb))
        t8 = seconds(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, bias=bb,
                                              out_dtype=torch.bfloat16, use_fast_accum=True))
        flops = 2 * m * k * n
        print(f"{m}x{k}x{n}: bf16 {t16 * 1e3:.3f} ms ({flops / t16 / 1e12:.0f} TFLOP/s); "
              f"fp8 {t8 * 1e3:.3f} ms ({flops / t8 / 1e12:.0f} TFLOP/s); fp8/bf16 {t8 / t16:.3f}")


if __name__ == "__main__":
    main()
