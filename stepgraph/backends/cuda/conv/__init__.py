"""The convolution family: own kernels (conv.py), cuDNN plans (conv_cudnn.py), tiled kernels
(conv_tiled.py), each path chosen per problem by timing."""
