"""The attention family: own flash-style kernels (attention.py) and cuDNN's fused attention
(attention_cudnn.py)."""
