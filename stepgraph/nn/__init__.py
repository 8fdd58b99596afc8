"""torch.nn-shaped layers."""
from .init import manual_seed
from .layers import (GELU, AdaptiveAvgPool2d, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d,
                     Dropout, Dropout2d, Embedding, Flatten, Identity, LayerNorm, LeakyReLU,
                     Linear, LogSoftmax, MaxPool2d, ModuleDict, ModuleList, ReLU, Sequential,
                     Sigmoid, SiLU, Tanh)
from .layers import (CELU, ELU, GLU, SELU, Hardsigmoid, Hardswish, Hardtanh, LogSigmoid,
                     Mish, ReLU6, Softplus)
from .layers import (AdaptiveMaxPool2d, Conv1d, ConvTranspose2d, GroupNorm, MultiheadAttention, RMSNorm, Upsample,
                     UpsamplingBilinear2d, UpsamplingNearest2d)
from .loss_modules import (BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, KLDivLoss,
                           L1Loss, MSELoss, NLLLoss, SmoothL1Loss)
from .module import Buffer, Module, Parameter

__all__ = ["Module", "Parameter", "Linear", "Conv2d", "MaxPool2d", "Flatten", "Dropout",
           "Dropout2d", "ReLU", "LeakyReLU", "Sigmoid", "Tanh", "GELU", "LogSoftmax",
           "Sequential", "SiLU", "Identity", "ModuleList", "ModuleDict", "manual_seed", "Buffer",
           "AvgPool2d", "AdaptiveAvgPool2d", "BatchNorm1d", "BatchNorm2d", "Embedding",
           "LayerNorm", "ELU", "CELU", "SELU", "Softplus", "Mish", "Hardswish", "Hardsigmoid",
           "ReLU6", "Hardtanh", "LogSigmoid", "GLU",
           "CrossEntropyLoss", "NLLLoss", "MSELoss", "BCEWithLogitsLoss", "BCELoss", "L1Loss",
           "SmoothL1Loss", "HuberLoss", "KLDivLoss",
           "GroupNorm", "RMSNorm", "Conv1d", "ConvTranspose2d", "Upsample", "UpsamplingNearest2d",
           "UpsamplingBilinear2d", "MultiheadAttention", "AdaptiveMaxPool2d"]
