"""graphar's Triton kernels. Triton is optional: `pack` falls back to torch copies without it."""
