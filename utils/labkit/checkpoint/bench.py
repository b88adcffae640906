"""The training bench of chapter 8: every kind of state a strict resume must bring back.

    trainer = bench.Trainer(bench.CONFIG)              # same config -> same run, on any rank
    for _ in range(5):
        trainer.step()                                  # one optimizer step of data parallelism

What it holds, and where each piece of state lives (chapter 8, section 4):

| state | where | drawn or changed by |
|---|---|---|
| weights | `trainer.model` (tiny LM, float32) | the optimizer |
| AdamW moments | `trainer.optimizer` (torch AdamW, or ZeRO-1 shards: zero.Zero1AdamW) | the optimizer |
| learning rate | `trainer.scheduler` (warm-up, then cosine) | each step |
| loss scale | `trainer.scaler` (torch.amp.GradScaler on CPU: grows every 2 steps) | each step |
| dropout masks | torch's global RNG | the forward pass |
| window offsets | Python's global `random` | the data pipeline |
| epoch order | NumPy's global RNG (a new permutation each epoch) | the data pipeline |
| data cursor | `trainer.data.epoch`, `.position`, `.order` | the data pipeline |
| what the run is | tokenizer hash, config hash, code version, world size | nothing (checked on resume) |

Every rank draws the same random numbers (same seeds, same shapes), so the RNG states are the same
on every rank and a resume at another world size knows which to restore. Rank r trains on samples
r, r + P, r + 2P, ... of each global batch of `batch` samples.
"""
from __future__ import annotations

import hashlib
import json
import math
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

CONFIG = {"seed": 0, "vocab": "abcdefghijklmnopqrstuvwxyz .,", "hidden": 32, "seq_len": 16,
          "batch": 12, "documents": 30, "lr": 3e-3, "warmup": 3, "total_steps": 60,
          "weight_decay": 0.01, "dropout": 0.1, "init_scale": 2.0 ** 10, "growth_interval": 2,
          "optimizer": "adamw"}
WORDS = ("the model saves its state to disk and loads it back after a crash while the optimizer "
         "keeps two moments per weight and the data cursor remembers where it was").split()


def stable_hash(obj) -> str:
    """SHA-256 of a JSON-able object, keys sorted: the same on every machine and run."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def code_version() -> str:
    """Which training code made a snapshot: this module's source and torch's version."""
    import inspect
    import sys
    return stable_hash([inspect.getsource(sys.modules[__name__]), torch.__version__])[:16]


class Tokenizer:
    """Characters to ids. Its hash goes into every snapshot: a resume with another vocabulary
    would silently read every token as another one."""

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError(f"vocab has repeated characters: {vocab!r}")
        self.vocab = vocab
        self.ids = {ch: i for i, ch in enumerate(vocab)}

    def encode(self, text: str) -> list[int]:
        return [self.ids[ch] for ch in text]

    def digest(self) -> str:
        return stable_hash({"kind": "char", "vocab": self.vocab})


def corpus(seed: int, documents: int) -> list[str]:
    """Deterministic documents of 40-90 characters made of WORDS."""
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        words = []
        while len(" ".join(words)) < rng.randint(40, 90):
            words.append(rng.choice(WORDS))
        texts.append(" ".join(words) + ".")
    return texts


class Data:
    """Global batches of `batch` windows of seq_len + 1 tokens; the cursor is (epoch, position)
    into `order`, a permutation of the documents drawn from NumPy's global RNG at each epoch;
    each window's offset comes from Python's global `random`."""

    def __init__(self, tokens: list[list[int]], batch: int, seq_len: int):
        self.tokens, self.batch, self.seq_len = tokens, batch, seq_len
        self.epoch, self.position = 0, 0
        self.order = np.random.permutation(len(tokens)).tolist()

    def next_batch(self, rank: int, world_size: int):
        """This rank's share of the next global batch: x, y: [batch/P, seq_len] (int64)."""
        if self.batch % world_size:
            raise ValueError(f"global batch ({self.batch}) is not divisible by the world size "
                             f"({world_size})")
        rows = []
        for _ in range(self.batch):                     # every rank draws for every sample
            if self.position == len(self.order):
                self.epoch += 1
                self.position = 0
                self.order = np.random.permutation(len(self.tokens)).tolist()
            doc = self.tokens[self.order[self.position]]
            self.position += 1
            start = random.randrange(len(doc) - self.seq_len)
            rows.append(doc[start:start + self.seq_len + 1])
        mine = torch.tensor(rows[rank::world_size], dtype=torch.int64)  # [batch/P, seq_len + 1]
        return mine[:, :-1], mine[:, 1:]


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.drop = nn.Dropout(dropout)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):                                # x: [B, T] -> logits [B, T, V]
        return self.head(torch.nn.functional.gelu(self.mix(self.drop(self.embed(x)))))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up for `warmup` steps, then cosine decay to 10% at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Trainer:
    """Data-parallel training of TinyLM; the same on every rank that passes the same config.

    config["optimizer"]: "adamw" (torch's AdamW, every rank holds all moments) or "zero1"
    (zero.Zero1AdamW: rank r holds only its range of the flat moments, chapter 8, section 5).
    """

    def __init__(self, config: dict = CONFIG):
        self.config = dict(config)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        seed = self.config["seed"]
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.tokenizer = Tokenizer(self.config["vocab"])
        tokens = [self.tokenizer.encode(text) for text in corpus(seed, self.config["documents"])]
        self.data = Data(tokens, self.config["batch"], self.config["seq_len"])
        self.model = TinyLM(len(self.config["vocab"]), self.config["hidden"],
                            self.config["dropout"])
        if self.config["optimizer"] == "zero1":
            from labkit.checkpoint.zero import Zero1AdamW
            self.optimizer = Zero1AdamW(self.model.named_parameters(), lr=self.config["lr"],
                                        weight_decay=self.config["weight_decay"])
        elif self.config["optimizer"] == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config["lr"],
                                               weight_decay=self.config["weight_decay"])
        else:
            raise ValueError(f"optimizer must be 'adamw' or 'zero1', got "
                             f"{self.config['optimizer']!r}")
        warmup, total = self.config["warmup"], self.config["total_steps"]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, warmup, total))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=self.config["init_scale"],
                                           growth_interval=self.config["growth_interval"])
        self.steps = 0

    def identity(self) -> dict:
        """What must match for a snapshot to be resumed by this trainer."""
        return {"tokenizer": self.tokenizer.digest(), "config": stable_hash(self.config),
                "code": code_version()}

    def step(self) -> float:
        """One step: forward/backward on this rank's share, all_reduce, scaled AdamW, LR."""
        x, y = self.data.next_batch(self.rank, self.world_size)     # x, y: [batch/P, T]
        logits = self.model(x)                                       # [batch/P, T, V]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.world_size > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= self.world_size
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.steps += 1
        return loss.item()

    def train(self, steps: int) -> list[float]:
        return [self.step() for _ in range(steps)]


def fingerprint(trainer: Trainer) -> dict:
    """Everything a continued run depends on, as plain data: two trainers whose fingerprints are
    equal continue bit for bit alike. (Weights equal bit for bit are not enough: see s. 4.)"""
    optimizer = trainer.optimizer
    if trainer.config["optimizer"] == "zero1":
        moments = {"exp_avg": optimizer.exp_avg.clone(), "exp_avg_sq": optimizer.exp_avg_sq.clone(),
                   "step": optimizer.step_count}
    else:
        moments = {name: [v.clone() if torch.is_tensor(v) else v for v in state.values()]
                   for name, state in zip([n for n, _ in trainer.model.named_parameters()],
                                          [optimizer.state.get(p, {}) for p in
                                           trainer.model.parameters()])}
    return {"weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "optimizer": moments,
            "lr": trainer.scheduler.get_last_lr()[0],
            "group_lr": optimizer.param_groups[0]["lr"],      # what the next step will use
            "scaler": {k: v for k, v in trainer.scaler.state_dict().items()},
            "torch_rng": torch.get_rng_state(),
            "python_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
            "numpy_rng": hashlib.sha256(repr(np.random.get_state()).encode()).hexdigest(),
            "cursor": [trainer.data.epoch, trainer.data.position, list(trainer.data.order)],
            "steps": trainer.steps}


def differences(a: dict, b: dict) -> list[str]:
    """The top-level fingerprint entries that differ (bitwise for tensors)."""
    def same(x, y):
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype \
                and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(same, x, y))
        return x == y
    return [key for key in a if key not in b or not same(a[key], b[key])]
