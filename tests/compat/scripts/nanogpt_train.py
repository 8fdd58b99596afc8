"""A training script written the way nanoGPT's train.py is: global config overridden by
--key=value arguments, get_batch from token arrays, AdamW over decay / no-decay groups,
warmup + cosine learning rate written into param_groups each iteration, gradient accumulation,
GradScaler, clip_grad_norm_, estimate_loss under no_grad, checkpoints with torch.save /
torch.load. The model is gpt.py beside it."""
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from gpt import GPT

# -----------------------------------------------------------------------------
# default config values
out_dir = 'out'
eval_interval = 4
log_interval = 1
eval_iters = 2
init_weights = ''          # a torch.save'd state_dict to start from (written if missing)
data_file = 'tokens.npy'
gradient_accumulation_steps = 2
batch_size = 4
block_size = 16
vocab_size = 64
n_layer = 2
n_head = 2
n_embd = 32
learning_rate = 6e-3
max_iters = 8
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 8
min_lr = 6e-4
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'float32'
seed = 1337
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_')
               and isinstance(v, (int, float, bool, str))]
for arg in sys.argv[1:]:             # nanoGPT's configurator.py, inline
    assert arg.startswith('--'), arg
    key, val = arg[2:].split('=')
    assert key in globals(), key
    globals()[key] = type(globals()[key])(val) if not isinstance(globals()[key], bool) \
        else val == 'True'
config = {k: globals()[k] for k in config_keys}
# -----------------------------------------------------------------------------

os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
ctx = nullcontext() if dtype == 'float32' else torch.amp.autocast(device_type=device_type,
                                                                  dtype=ptdtype)

data = np.load(data_file)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]
batch_rng = np.random.default_rng(seed)


def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = batch_rng.integers(0, len(data) - block_size, batch_size)
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                     for i in ix])
    x, y = x.to(device), y.to(device)
    return x, y


iter_num = 0
model = GPT(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
            n_embd=n_embd)
if init_weights:
    if os.path.exists(init_weights):
        model.load_state_dict(torch.load(init_weights, map_location=device))
    else:
        torch.save(model.state_dict(), init_weights)
model.to(device)

scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))


def configure_optimizers(model, weight_decay, learning_rate, betas):
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {'params': decay_params, 'weight_decay': weight_decay},
        {'params': nodecay_params, 'weight_decay': 0.0}
    ]
    num_decay_params = sum(p.numel() for p in decay_params)
    num_nodecay_params = sum(p.numel() for p in nodecay_params)
    print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} "
          "parameters")
    print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with "
          f"{num_nodecay_params:,} parameters")
    import inspect
    fused_available = 'fused' in inspect.signature(torch.optim.AdamW).parameters
    use_fused = fused_available and device_type == 'cuda'
    extra_args = dict(fused=True) if use_fused else dict()
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)


optimizer = configure_optimizers(model, weight_decay, learning_rate, (beta1, beta2))
model = torch.compile(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


X, Y = get_batch('train')
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.6f}, val loss "
              f"{losses['val']:.6f}")

    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch('train')
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.6f}, lr {lr:.6e}")
    iter_num += 1
    if iter_num > max_iters:
        break

checkpoint = {
    'model': model.state_dict(),
    'optimizer': optimizer.state_dict(),
    'iter_num': iter_num,
    'config': config,
}
torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))
print(f"saved checkpoint to {out_dir}")
