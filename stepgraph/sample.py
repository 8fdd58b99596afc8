"""`stepgraph sample`: text from the GPT a `stepgraph train --model gpt` run checkpointed.

The model runs on the device through one predictor compiled for the shape (1, block_size), so
no token recompiles anything: the context is the last block_size tokens, left-aligned and
padded with token 0 when shorter (causal attention keeps the padding from reaching the real
positions), and the next token's logits are read at the last real position. The token is
drawn on the host with NumPy (temperature, then top-k, then softmax) from a Generator seeded
by `seed`: the same checkpoint, prompt and seed give the same text.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import stepgraph as sg

from . import checkpoint as ckpt
from . import models
from .data.text import encode
from .train import DEVICES, TrainConfigError, resolve_device

DEFAULT_PROMPT = "\n"
DEFAULT_TOKENS = 500
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 200


@dataclass(frozen=True)
class SampleConfig:
    """Options of `stepgraph sample`."""

    out: str                    # the training run's output directory
    prompt: str = DEFAULT_PROMPT
    tokens: int = DEFAULT_TOKENS
    temperature: float = DEFAULT_TEMPERATURE   # 0: always the most likely token
    top_k: int | None = DEFAULT_TOP_K          # None or 0: no top-k cut
    seed: int = 0
    device: str = "auto"

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise TrainConfigError(f"--device must be one of {', '.join(DEVICES)}, "
                                   f"got {self.device!r}")
        if self.tokens < 0:
            raise TrainConfigError(f"--tokens must be >= 0, got {self.tokens}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise TrainConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise TrainConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if self.seed < 0:
            raise TrainConfigError(f"--seed must be >= 0, got {self.seed}")


def load_gpt(out_dir: str | Path) -> tuple[models.GPT, str]:
    """The GPT of the checkpoint in `out_dir` (its trained parameters) and its vocabulary."""
    path = Path(out_dir) / ckpt.CHECKPOINT_NAME
    saved = ckpt.load_checkpoint(path)
    config = saved.config
    if config.get("model") != "gpt" or "vocab" not in config:
        raise ckpt.CheckpointError(f"{path} is not the checkpoint of a GPT run (model "
                                   f"{config.get('model')!r}); train one with "
                                   "`stepgraph train --model gpt`")
    vocab = config["vocab"]
    model = models.GPT(models.GPTConfig(len(vocab), config["block_size"], config["n_layer"],
                                        config["n_head"], config["n_embd"], config["dropout"]))
    keys = list(model.state_dict())
    missing = [k for k in keys if k not in saved.state]
    if missing:
        raise ckpt.CheckpointError(f"{path} lacks the model's {', '.join(missing[:6])}")
    model.load_state_dict({k: saved.state[k] for k in keys})
    return model, vocab


def next_token(logits: np.ndarray, temperature: float, top_k: int | None,
               rng: np.random.Generator) -> int:
    """A token drawn from softmax(logits / temperature) restricted to the top_k largest
    logits (ties at the k-th value kept); the argmax when temperature is 0."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    if temperature == 0:
        return int(np.argmax(z))
    z = z / temperature
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(model: models.GPT, vocab: str, prompt: str, tokens: int,
             temperature: float = DEFAULT_TEMPERATURE, top_k: int | None = DEFAULT_TOP_K,
             seed: int = 0, device: str = "cpu",
             on_text: Callable[[str], None] | None = None) -> str:
    """`tokens` characters following `prompt`, drawn one at a time (see the module
    docstring); each is also passed to on_text as it comes. Returns the generated text."""
    block = model.config.block_size
    context = list(encode(prompt or _start(vocab), vocab))
    window = np.zeros((1, block), np.int32)
    predict = sg.compile_predict(model, example_inputs=(window,), device=device)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tokens):
        recent = context[-block:]
        window[0, :len(recent)] = recent
        window[0, len(recent):] = 0
        logits = sg.to_numpy(predict(window)[0, len(recent) - 1])
        token = next_token(logits, temperature, top_k, rng)
        context.append(token)
        out.append(vocab[token])
        if on_text is not None:
            on_text(vocab[token])
    return "".join(out)


def _start(vocab: str) -> str:
    """What an empty prompt starts from: a newline, or the vocabulary's first character."""
    return DEFAULT_PROMPT if DEFAULT_PROMPT in vocab else vocab[0]


def sample(config: SampleConfig, on_text: Callable[[str], None] | None = None) -> str:
    """Load the checkpoint in config.out and generate from config.prompt; returns the
    generated text (the prompt not included). on_text gets the prompt first, once the model
    is loaded and the prompt is known to fit its vocabulary, then each new character."""
    config.validate()
    device = resolve_device(config.device)
    model, vocab = load_gpt(config.out)
    encode(config.prompt, vocab)      # a character outside the vocabulary fails here
    if on_text is not None:
        on_text(config.prompt)
    return generate(model, vocab, config.prompt, config.tokens, config.temperature,
                    config.top_k, config.seed, device, on_text)
