"""The test bench of chapter 5: a small language model cut into pipeline stages, microbatches
with ragged token counts, and the single-process reference.

    model = make_model(seed=0)                        # labkit.dp's TinyLM, 6 blocks, float64
    pieces = cut(model, S)                            # S consecutive pieces (virtual stages)
    tokens, targets = microbatches(seed=1, m=4)       # each [m, b, T]; padding targets IGNORE
    reference = reference_gradients(model_seed=0, tokens=tokens, targets=targets)

The loss of a step is the mean over every valid token of every microbatch (chapter 2's token
loss): L = sum_i S_i / sum_i n_i, where microbatch i's valid tokens have losses summing to S_i and
number n_i. The last stage, which holds all targets, knows sum_i n_i before the first backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit import dp

IGNORE = dp.IGNORE
LAYERS, HIDDEN = 6, 16
# float64: a correct pipeline agrees with one process to ~1e-15; a wrong scale is off by >1e-3.
RTOL, ATOL = 1e-7, 1e-10


def make_model(seed: int = 0, layers: int = LAYERS, hidden: int = HIDDEN,
               dtype=torch.float64) -> dp.TinyLM:
    """tokens [B, T] -> logits [B, T, V]: embedding, `layers` residual GELU blocks, head."""
    return dp.make_model(seed, layers=layers, hidden=hidden, dtype=dtype)


class Piece(nn.Module):
    """Consecutive layers of a TinyLM (its embedding, blocks and head, in order, or a run of them):
    one pipeline stage's share of the model. `names` maps each parameter to its name in the
    whole model ("blocks.3.weight"), so the stages' gradients can be put side by side with one
    process's."""

    def __init__(self, layers: list):
        super().__init__()
        self.embed = next((m for name, m in layers if name == "embed"), None)
        self.blocks = nn.ModuleList(m for name, m in layers if name.startswith("blocks."))
        self.head = next((m for name, m in layers if name == "head"), None)
        self.names = {id(p): f"{name}.{pname}" for name, module in layers
                      for pname, p in module.named_parameters()}

    @classmethod
    def from_weights(cls, weights: dict) -> "Piece":
        """A piece with fresh modules holding copies of `weights` ({name in the model: tensor},
        as `weights_of` gives): what a rank builds from the share of the model it was sent."""
        layers = {}
        for name, tensor in weights.items():
            layer, _, what = name.rpartition(".")
            layers.setdefault(layer, {})[what] = tensor
        built = []
        for layer in sorted(layers, key=_layer_order):
            held = layers[layer]
            if layer == "embed":
                module = nn.Embedding(*held["weight"].shape, dtype=held["weight"].dtype)
            else:
                out_features, in_features = held["weight"].shape
                module = nn.Linear(in_features, out_features, dtype=held["weight"].dtype)
            with torch.no_grad():
                for what, tensor in held.items():
                    getattr(module, what).copy_(tensor)
            built.append((layer, module))
        return cls(built)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)                       # tokens [b, T] -> x: [b, T, H]
        for block in self.blocks:
            x = x + F.gelu(block(x))                # [b, T, H]
        if self.head is not None:
            x = self.head(x)                        # logits: [b, T, V]
        return x

    def gradients(self) -> dict:
        """{model parameter name: gradient on CPU} (zeros where backward left none)."""
        return {self.names[id(p)]: (p.grad if p.grad is not None else torch.zeros_like(p))
                .detach().cpu().clone() for p in self.parameters()}

    def weights(self) -> dict:
        """{model parameter name: a copy of the weight on CPU}."""
        return {self.names[id(p)]: p.detach().cpu().clone() for p in self.parameters()}


def _layer_order(layer: str):
    if layer == "embed":
        return (0, 0)
    if layer == "head":
        return (2, 0)
    return (1, int(layer.split(".")[1]))


def _layers(model):
    return ([("embed", model.embed)] + [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
            + [("head", model.head)])


def bounds(n_layers: int, S: int, weights=None) -> list:
    """Where S pieces start and end among n_layers layers: as even as possible (the first ones
    one longer), or in proportion to `weights` (each piece at least one layer)."""
    if not 1 <= S <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into S = {S} pieces: need 1 <= S <= "
                         f"{n_layers} (make_model(layers=...) has layers + 2 layers with the "
                         "embedding and the head)")
    if weights is None:
        base, extra = divmod(n_layers, S)
        sizes = [base + (i < extra) for i in range(S)]
    else:
        if len(weights) != S or min(weights) <= 0:
            raise ValueError(f"weights needs S = {S} positive numbers, got {weights!r}")
        total = sum(weights)
        sizes = [max(1, round(n_layers * w / total)) for w in weights]
        sizes[-1] = n_layers - sum(sizes[:-1])
        if sizes[-1] < 1:
            raise ValueError(f"weights {weights!r} leave the last piece no layer of {n_layers}")
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return starts


def cut(model: dp.TinyLM, S: int, weights=None) -> list:
    """The model as S pieces, virtual stage s = pieces[s], in layer order."""
    edges = bounds(len(_layers(model)), S, weights)
    layers = _layers(model)
    return [Piece(layers[edges[s]:edges[s + 1]]) for s in range(S)]


def microbatches(seed: int = 1, m: int = 4, b: int = 2, T: int = 6, min_len: int = 1):
    """(tokens, targets), each [m, b, T] int64: m microbatches of b sequences of 1..T valid tokens
    (the rest padding, target IGNORE). Every microbatch has the same shape, so a stage can
    receive an activation of a known shape [b, T, H]; their token counts differ."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, dp.VOCAB, (m, b, T), generator=g)            # [m, b, T]
    targets = torch.randint(0, dp.VOCAB, (m, b, T), generator=g)           # [m, b, T]
    lengths = torch.randint(min_len, T + 1, (m, b), generator=g)           # valid tokens
    padding = torch.arange(T)[None, None, :] >= lengths[:, :, None]        # [m, b, T]
    tokens[padding] = 0
    targets[padding] = IGNORE
    return tokens, targets


def loss_sum(logits, targets):
    """(S, n): summed cross-entropy over the valid tokens of a microbatch (differentiable), and
    their count. logits [b, T, V], targets [b, T]."""
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    return total, int((targets != IGNORE).sum())


def token_count(targets) -> int:
    """Valid tokens in every microbatch together: the denominator of the step's loss."""
    return int((torch.as_tensor(targets) != IGNORE).sum())


def reference_gradients(model_seed: int, tokens, targets, layers: int = LAYERS,
                        hidden: int = HIDDEN, dtype=torch.float64) -> dict:
    """One process, every microbatch: the gradient of L = sum_i S_i / sum_i n_i."""
    model = make_model(model_seed, layers, hidden, dtype)
    total = sum(loss_sum(model(t), y)[0] for t, y in zip(tokens, targets))
    count = token_count(targets)
    if count == 0:
        raise ValueError("the step has no valid token: the loss is undefined")
    (total / count).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def activation_shape(tokens, hidden: int = HIDDEN) -> tuple:
    """What flows between stages for one microbatch: [b, T, H]."""
    return tuple(tokens.shape[-2:]) + (hidden,)
