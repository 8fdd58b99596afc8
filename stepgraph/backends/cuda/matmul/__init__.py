"""The matrix-product family: cuBLASLt GEMMs (gemm.py), linear layers (linear.py) with the
small-matmul kernels (small_matmul.py), batched products (bmm.py)."""
