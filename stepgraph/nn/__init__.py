"""torch.nn-shaped layers."""
from . import init
from .container import ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential
from .init import manual_seed
from .layers import (GELU, AdaptiveAvgPool2d, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d,
                     Dropout, Dropout2d, Embedding, Flatten, Identity, LayerNorm, LeakyReLU,
                     Linear, LogSoftmax, MaxPool2d, ReLU, Sigmoid, SiLU, Tanh)
from .layers import (CELU, ELU, GLU, SELU, Hardsigmoid, Hardswish, Hardtanh, LogSigmoid,
                     Mish, ReLU6, Softplus)
from .layers import (AdaptiveMaxPool2d, Conv1d, ConvTranspose2d, GroupNorm, MultiheadAttention,
                     RMSNorm, Upsample, UpsamplingBilinear2d, UpsamplingNearest2d)
from .layers import (ConstantPad1d, ConstantPad2d, CosineSimilarity, PairwiseDistance,
                     PixelShuffle, PixelUnshuffle, ReflectionPad1d, ReflectionPad2d,
                     ReplicationPad1d, ReplicationPad2d, Softmax, Softmin, Unflatten, ZeroPad2d)
from .layers import AdaptiveAvgPool3d, AvgPool3d, BatchNorm3d, Conv3d, MaxPool3d
from .layers import (AdaptiveAvgPool1d, AvgPool1d, Bilinear, ConvTranspose1d, Dropout1d,
                     InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, MaxPool1d, PReLU, Softsign,
                     Tanhshrink, Threshold)
from .loss_modules import (BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, KLDivLoss,
                           L1Loss, MSELoss, NLLLoss, SmoothL1Loss)
from .loss_modules import (CosineEmbeddingLoss, GaussianNLLLoss, HingeEmbeddingLoss,
                           MarginRankingLoss, MultiLabelSoftMarginLoss, PoissonNLLLoss,
                           SoftMarginLoss, TripletMarginLoss)
from .module import Buffer, Module, Parameter
from .recurrent import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNBase, RNNCell, RNNCellBase
from .sync_batch_norm import SyncBatchNorm
from .transformer import (Transformer, TransformerDecoder, TransformerDecoderLayer,
                          TransformerEncoder, TransformerEncoderLayer)

__all__ = ["Module", "Parameter", "Linear", "Conv2d", "MaxPool2d", "Flatten", "Dropout",
           "Dropout2d", "ReLU", "LeakyReLU", "Sigmoid", "Tanh", "GELU", "LogSoftmax",
           "Sequential", "SiLU", "Identity", "ModuleList", "ModuleDict", "manual_seed", "Buffer",
           "AvgPool2d", "AdaptiveAvgPool2d", "BatchNorm1d", "BatchNorm2d", "Embedding",
           "LayerNorm", "ELU", "CELU", "SELU", "Softplus", "Mish", "Hardswish", "Hardsigmoid",
           "ReLU6", "Hardtanh", "LogSigmoid", "GLU", "ParameterList", "ParameterDict", "init",
           "CrossEntropyLoss", "NLLLoss", "MSELoss", "BCEWithLogitsLoss", "BCELoss", "L1Loss",
           "SmoothL1Loss", "HuberLoss", "KLDivLoss",
           "GroupNorm", "RMSNorm", "Conv1d", "ConvTranspose2d", "Upsample", "UpsamplingNearest2d",
           "UpsamplingBilinear2d", "MultiheadAttention", "AdaptiveMaxPool2d",
           "Softmax", "Softmin", "PixelShuffle", "PixelUnshuffle", "Unflatten",
           "CosineSimilarity", "PairwiseDistance", "ConstantPad1d", "ConstantPad2d", "ZeroPad2d",
           "ReflectionPad1d", "ReflectionPad2d", "ReplicationPad1d", "ReplicationPad2d",
           "RNNBase", "RNN", "LSTM", "GRU", "RNNCellBase", "RNNCell", "LSTMCell", "GRUCell",
           "Conv3d", "BatchNorm3d", "MaxPool3d", "AvgPool3d", "AdaptiveAvgPool3d",
           "SyncBatchNorm", "Transformer", "TransformerEncoder", "TransformerEncoderLayer",
           "TransformerDecoder", "TransformerDecoderLayer",
           "Softsign", "Tanhshrink", "Threshold", "PReLU", "Dropout1d", "Bilinear", "MaxPool1d",
           "AvgPool1d", "AdaptiveAvgPool1d", "ConvTranspose1d", "InstanceNorm1d",
           "InstanceNorm2d", "InstanceNorm3d", "MarginRankingLoss", "HingeEmbeddingLoss",
           "SoftMarginLoss", "MultiLabelSoftMarginLoss", "CosineEmbeddingLoss",
           "TripletMarginLoss", "PoissonNLLLoss", "GaussianNLLLoss"]


def __getattr__(name: str):
    """A torch.nn name stepgraph lacks: UnsupportedOpError, which is an AttributeError."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.nn", name)
