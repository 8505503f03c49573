"""numba CPU/CUDA kernels for GradientFlow, each with a pure-torch reference (leaf: imports nothing of gradientflow)."""
