"""Training KVzap's surrogates (policies.kvzap) as the official code does, NVIDIA/kvpress @8bb29b9 kvzap/ (file:line):

1. Targets, KVzip+ (kvzap/data.py:173-221): the text is fed once as a user turn ending "\\n\\nRepeat the previous
   context exactly." and, teacher-forced, as the assistant's answer (data.py:120-125); in every layer, a prompt
   position i is scored by max over the answer's tokens t of a_hti / ||x_t|| * ||W_o^h v_i|| (a: attention weights;
   x_t: the layer's input hidden state of t, after its input norm; W_o^h: head h's slice of the output projection),
   then the max over each KV head's query heads, then the log. The inputs are the prompt positions' hidden states x_i.
   Per text, `n_tokens` (500, train.py:130) prompt positions are drawn at random (data.py:280).
2. Fits (kvzap/train.py): linear, one ridge regression per layer (sklearn's Ridge(), alpha 1 and an unpenalised
   intercept: train.py:95-120); MLP, every layer's module trained at once on one MSE, AdamW, lr 5e-3, 15 epochs,
   batches of 512, cosine schedule per epoch, gradient norm clipped at 1, 5% held out for validation (train.py:60-80,
   :133-136).

Ours: a model without a chat template (Gemma 3 270M base) gets KVzip's official fallback, "\\n\\nAnswer: " between
the instruction and the repetition (policies.kvzip.BASE_SUFFIX); the pieces are tokenized one by one (the official
code tokenizes the rendered template and finds the spans by character offsets); sliding-window layers, never
compressed, are not trained (their KVzip+ is 0 beyond the window: log 0). Scores in float32 from the layer's own
post-RoPE queries and keys (the lab's intercepted attention call), the same as eager's weights to about 1e-6.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core.attention import AttentionSettings, attention_probs
from ..core.framing import chat_frame
from ..core.hooks import capture_layer_inputs, intercept_attention
from ..core.progress import progress_bar
from ..core.tokens import encode
from .kvzap import HIDDEN_DIM, Surrogate
from .kvzip import BASE_SUFFIX, REPEAT_FIRST

N_TOKENS = 500  # prompt positions drawn per text, kvzap/train.py:130
RIDGE_ALPHA = 1.0  # sklearn's Ridge() default, kvzap/train.py:106
MLP_EPOCHS, MLP_LR, MLP_BATCH, VALID_SHARE, CLIP = 15, 5e-3, 512, 0.05, 1.0  # train.py:133-136, :77-80
ROWS_PER_BLOCK = 256  # repetition queries per block of attention probabilities


def repeat_prompt(tokenizer, text: str) -> tuple[torch.Tensor, slice, slice]:
    """(ids (1, L), prompt, repeat): the text, the instruction, the text again (kvzap/data.py:120-125), and the spans
    of the text's two copies. With a chat template: [user head, text, REPEAT_FIRST, end of turn + assistant head, text];
    without one: [text, REPEAT_FIRST, "\\n\\nAnswer: ", text]."""
    if getattr(tokenizer, "chat_template", None):
        head, tail = (encode(tokenizer, part) for part in chat_frame(tokenizer))
    else:
        head, tail = [], encode(tokenizer, BASE_SUFFIX)
    body = encode(tokenizer, text.strip())
    ids = [*head, *body, *encode(tokenizer, REPEAT_FIRST), *tail]
    prompt, repeat = slice(len(head), len(head) + len(body)), slice(len(ids), len(ids) + len(body))
    return torch.tensor([ids + body]), prompt, repeat


def kvzip_plus(model, ids: torch.Tensor, prompt: slice, repeat: slice):
    """({layer: x (p, hidden_size)}, {layer: y (p, kv_heads)}) float32 for one repeat prompt ids (1, L): every
    full-attention layer's input hidden states over the prompt span and its log KVzip+ scores (module doc, 1)."""
    targets = {}  # inputs_seen: the with statement below binds it before any call

    def record(module, query, key, value, attention_mask, **kwargs):
        settings = AttentionSettings.of_call(module, kwargs)
        layer = module.layer_idx
        if settings.sliding_window is not None:
            return
        hidden = inputs_seen[layer][-1][0].float()  # (L, hidden) this forward's attention input
        heads, kv_heads = query.shape[1], key.shape[1]
        columns = torch.arange(prompt.start, prompt.stop)
        best = torch.zeros(heads, len(columns))
        for start in range(repeat.start, repeat.stop, ROWS_PER_BLOCK):
            rows = torch.arange(start, min(start + ROWS_PER_BLOCK, repeat.stop))
            probs = attention_probs(query[0, :, rows], key[0], settings.scaling, rows, key_index=columns,
                                    softcap=settings.softcap)  # (heads, rows, p)
            best = torch.maximum(best, (probs / hidden[rows].norm(dim=-1)[None, :, None]).amax(dim=1))
        w_o = module.o_proj.weight.float().T.reshape(heads, -1, hidden.shape[-1])  # (heads, head_dim, hidden)
        v = value[0, :, prompt].float().repeat_interleave(heads // kv_heads, dim=0)  # (heads, p, head_dim)
        # ||W_o^h v||^2 = v^T (W_o^h W_o^h^T) v: a (head_dim, head_dim) form per head, not a (p, hidden) product
        gram = w_o @ w_o.mT
        scores = best * torch.einsum("hpd,hde,hpe->hp", v, gram, v).clamp_min(0).sqrt()
        targets[layer] = scores.reshape(kv_heads, heads // kv_heads, -1).amax(dim=1).log().T

    with torch.no_grad(), capture_layer_inputs(model) as inputs_seen, intercept_attention(model, record):
        model.get_decoder()(input_ids=ids, use_cache=False)
    return {layer: inputs_seen[layer][-1][0, prompt].float() for layer in targets}, targets


def collect(model, tokenizer, texts: list[str], n_tokens: int = N_TOKENS, seed: int = 0, desc: str = "KVzip+"):
    """(layers, X (N, layers, hidden) bfloat16, y (N, layers, kv_heads) float32): n_tokens random prompt positions of
    each text (all of a shorter one), drawn with `seed`, the full-attention layers in order."""
    generator = torch.Generator().manual_seed(seed)
    xs, ys, layers = [], [], None
    for text in progress_bar(texts, desc=desc):
        ids, prompt, repeat = repeat_prompt(tokenizer, text)
        x, y = kvzip_plus(model, ids.to(model.device), prompt, repeat)
        layers = sorted(x)
        drawn = torch.randperm(prompt.stop - prompt.start, generator=generator)[:n_tokens]
        xs.append(torch.stack([x[layer][drawn].cpu() for layer in layers], 1).bfloat16())  # kvpress keeps bf16
        ys.append(torch.stack([y[layer][drawn].cpu() for layer in layers], 1))
    return layers, torch.cat(xs), torch.cat(ys)


def fit_linear(layers: list[int], x: torch.Tensor, y: torch.Tensor) -> Surrogate:
    """One ridge regression per layer, alpha 1, intercept unpenalised (sklearn's Ridge()): x (N, layers, hidden),
    y (N, layers, kv_heads)."""
    surrogate = Surrogate(layers, x.shape[-1], y.shape[-1])
    for i, layer in enumerate(progress_bar(layers, desc="ridge")):
        xi, yi = x[:, i].double(), y[:, i].double()
        x_mean, y_mean = xi.mean(0), yi.mean(0)
        centred = xi - x_mean
        gram = centred.T @ centred + RIDGE_ALPHA * torch.eye(xi.shape[1], dtype=torch.float64)
        weight = torch.linalg.solve(gram, centred.T @ (yi - y_mean))  # (hidden, kv_heads)
        module = surrogate.layers[str(layer)]
        module.weight.data = weight.T.float()
        module.bias.data = (y_mean - x_mean @ weight).float()
    return surrogate.eval()


def fit_mlp(layers: list[int], x: torch.Tensor, y: torch.Tensor, *, hidden_dim: int = HIDDEN_DIM,
            epochs: int = MLP_EPOCHS, lr: float = MLP_LR, batch_size: int = MLP_BATCH, seed: int = 0,
            steps: int | None = None) -> tuple[Surrogate, list[float]]:
    """(surrogate, validation MSE after each epoch): every layer's MLP at once on one MSE (module doc, 2); x, y as
    `fit_linear`'s. steps: stop after this many batches (a test's budget), else `epochs` whole epochs."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    surrogate = Surrogate(layers, x.shape[-1], y.shape[-1], hidden_dim)
    order = torch.randperm(len(x), generator=generator)
    n_valid = max(1, int(VALID_SHARE * len(x)))
    valid, train = order[:n_valid], order[n_valid:]
    optimizer = torch.optim.AdamW(surrogate.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    loss_of = nn.MSELoss()

    def predict(rows):
        inputs = x[rows].float()
        return torch.stack([surrogate(layer, inputs[:, i]) for i, layer in enumerate(layers)], 1)

    losses, done = [], 0
    for _ in progress_bar(range(epochs), desc="MLP epochs"):
        surrogate.train()
        shuffled = train[torch.randperm(len(train), generator=generator)]
        for start in range(0, len(shuffled), batch_size):
            rows = shuffled[start:start + batch_size]
            loss = loss_of(predict(rows), y[rows])
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(surrogate.parameters(), CLIP)
            optimizer.step()
            done += 1
            if steps is not None and done >= steps:
                break
        schedule.step()
        surrogate.eval()
        with torch.no_grad():
            losses.append(float(loss_of(predict(valid), y[valid])))
        if steps is not None and done >= steps:
            break
    return surrogate.eval(), losses


def r_squared(surrogate: Surrogate, layers: list[int], x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each layer's R^2 of the surrogate's predictions of y (N, layers, kv_heads), over all heads."""
    values = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            predicted, target = surrogate(layer, x[:, i].float()), y[:, i]
            residual = (target - predicted).pow(2).sum()
            values.append(float(1 - residual / (target - target.mean(0)).pow(2).sum()) if math.isfinite(residual)
                          else float("nan"))
    return values
