"""Training Fast KVzip's gates (policies.fastkvzip) as the official code does, Janghyun1230/FastKVzip @7d78b34
(file:line):

1. Targets (prefill/feature.py:40-56): KVzip's scores of the context positions (the official KVzip, which
   policies.kvzip reproduces), every layer and KV head, with the layer's input hidden states there.
2. Fit (optim.py:121-200, utils.py:12-45): every layer's gate at once; the loss is the binary cross-entropy of the
   gate's score against KVzip's ("cnt", optim.py:215), averaged over positions, summed over KV heads and layers; SGD,
   momentum 0.9, lr 0.2 (optim.py:142, :216), 5000 steps of 1000 positions drawn without replacement per pass
   (optim.py:144-160); the lr warms up over the first 1% of steps (x 0.01 x step), then x 1, x 0.5 from half way,
   x 0.25 from three quarters (utils.py:12-21); every 100th position held out (load_data.py:64-72).

Ours: the gate adds its bias b once, as at inference (prefill/attention/gate.py:88, kvpress fastkvzip_press.py:62);
optim.py:101-103 adds it twice while training with sinks (the trained b is then halved at inference). The official
data are fineweb-edu contexts of about 10k tokens (load_data.py:46-52); ours the lab's texts (scripts/train_kvzap.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.progress import progress_bar
from .base import Prompt
from .fastkvzip import Gates
from .kvzip import KVzip

STEPS, BATCH, LR, MOMENTUM, HELD_OUT_EVERY = 5000, 1000, 0.2, 0.9, 100


def kvzip_targets(prompt: Prompt) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(layers, x (p, layers, hidden_size) float32, y (p, layers, kv_heads) float32) for one prompt prefilled with its
    layer inputs kept (SharedPrefill.run(..., layer_inputs=True)): KVzip's scores of the p context positions (after
    its system prompt) of every compressed layer, and the layer inputs there."""
    kvzip = KVzip()
    start = kvzip.layout(prompt.tokenizer, prompt.ids).start
    scores = kvzip.prompt_scores(prompt)
    layers = sorted(scores)
    x = torch.stack([prompt.layer_inputs[layer][0, start:].float() for layer in layers], 1)
    y = torch.stack([scores[layer][0, :, start:].T for layer in layers], 1)
    return layers, x.cpu(), y.cpu()


def learning_rate_factor(step: int, steps: int) -> float:
    """utils.py:12-21."""
    if step < 0.01 * steps:
        return 0.01 * step
    if step >= 0.75 * steps:
        return 0.25
    return 0.5 if step >= 0.5 * steps else 1.0


def gate_loss(gates: Gates, layers: list[int], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The binary cross-entropy of every layer's gate on x (N, layers, hidden) against y (N, layers, kv_heads), averaged
    over positions, summed over KV heads and layers (utils.py:24-45)."""
    total = x.new_zeros(())
    for i, layer in enumerate(layers):
        predicted = gates(layer, x[:, i].float())  # (kv_heads, N)
        total = total + F.binary_cross_entropy(predicted, y[:, i].T.clamp(0, 1), reduction="none").mean(-1).sum()
    return total


def fit_gates(layers: list[int], x: torch.Tensor, y: torch.Tensor, group: int, *, steps: int = STEPS,
              batch_size: int = BATCH, lr: float = LR, seed: int = 0) -> tuple[Gates, list[float]]:
    """(gates, held-out loss every steps // 20 steps) trained on x (N, layers, hidden), y (N, layers, kv_heads)
    (module doc, 2); group: query heads per KV head."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    gates = Gates(layers, x.shape[-1], y.shape[-1], group)
    held_out = (torch.arange(len(x)) + 1) % HELD_OUT_EVERY == 0
    x_train, y_train, x_test, y_test = x[~held_out], y[~held_out], x[held_out], y[held_out]
    optimizer = torch.optim.SGD(gates.parameters(), lr=lr, momentum=MOMENTUM)
    per_pass = max(1, len(x_train) // batch_size)
    losses = []
    for step in progress_bar(range(steps), desc="gates"):
        if step % per_pass == 0:
            order = torch.randperm(len(x_train), generator=generator)
        rows = order[(step % per_pass) * batch_size:(step % per_pass + 1) * batch_size]
        optimizer.zero_grad(set_to_none=True)
        gate_loss(gates, layers, x_train[rows], y_train[rows]).backward()
        for group_ in optimizer.param_groups:
            group_["lr"] = lr * learning_rate_factor(step, steps)
        optimizer.step()
        if (step + 1) % max(1, steps // 20) == 0 and len(x_test):
            with torch.no_grad():
                losses.append(float(gate_loss(gates, layers, x_test, y_test)))
    return gates.eval(), losses
