"""The Triton target (NVIDIA GPUs; Triton's interpreter on CPU tensors): the host that allocates and
launches (host), the kernels no variant axis changes (kernels), the gather GEMM (gemm) and the FP8
helpers (fp8)."""
