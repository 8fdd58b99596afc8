"""The compiled predictor a training script's evaluation calls run through: compile_predict's
Predictor for a forward that returns any structure of tensors (nanoGPT's `logits, loss`),
every tensor of it an output of the plan."""
from __future__ import annotations

from ..api import Predictor
from ..compile.autocast import PRECISION as BF16_PRECISION
from ..compile.autocast import LOW_DTYPES, as_float32, autocast
from ..compile.build import _mode, advance_predict_rng, predict_tracer, rewrite_forward_attention
from ..compile.feed import Signature
from ..compile.layout import apply_memory_format
from ..ir.graph import TEMP, Graph
from ..ir.trace import Tensor, tensor_of
from .program import tree_map


class TreePredictor(Predictor):
    def __init__(self, *args, **kwargs):
        self._structures: dict[Signature, object] = {}
        super().__init__(*args, **kwargs)

    def build_graph(self, signature: Signature) -> Graph:
        model = self.model
        model.name_parameters()
        tracer = predict_tracer(self.seed)
        xs = [tracer.input(s.shape, s.dtype, s.name) for s in signature]
        with _mode(model, False):
            out = model(*xs)
        advance_predict_rng(tracer)
        outputs: dict = {}

        def name(leaf):
            if isinstance(leaf, Tensor) and leaf.value.role == TEMP:
                outputs[f"output.{len(outputs)}"] = leaf.value
                return _Output(f"output.{len(outputs) - 1}")
            if isinstance(leaf, Tensor):          # an input or parameter returned as is
                raise TypeError("a forward returning its input or a parameter unchanged")
            return leaf
        self._structures[signature] = tree_map(name, out)
        tracer.graph.outputs = outputs
        graph = rewrite_forward_attention(tracer.graph, model, self.device,
                                          values=self.module_values)
        graph = apply_memory_format(graph, self.memory_format)
        if self.precision in LOW_DTYPES:
            autocast(graph, LOW_DTYPES[self.precision])
        if self.precision == BF16_PRECISION:     # float16 outputs stay float16, as torch's
            graph.outputs = {k: as_float32(graph, v) for k, v in graph.outputs.items()}
        return graph

    def __call__(self, *arrays):
        """The forward's result for this batch: its structure, eager tensors for tensors."""
        exe = self._prepare(arrays)
        exe.run(self.use_graph)
        structure = self._structures[exe.key.signature]
        return tree_map(lambda leaf: tensor_of(self.backend.to_numpy(exe.outputs[leaf.name]))
                        if isinstance(leaf, _Output) else leaf, structure)


class _Output:
    def __init__(self, name: str):
        self.name = name
