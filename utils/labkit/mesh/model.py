"""The chapter-6 bench: a small GPT, cut into pipeline stages, each stage split by torch's tensor
parallelism (chapter 6, `course/06_3d_parallelism.ipynb`, section 3; lab 6, task 2).

    model = make_model(seed=0)                      # one process: tokens [b, T] -> logits [b, T, V]
    stage = Stage(make_model(seed=0), pp_rank, pp)  # this rank's layers: embedding first, head last
    tensor_parallel(stage, tp_mesh)                 # q/k/v and fc1 by columns, o and fc2 by rows
    data = batches(seed=1, steps=2, dp=2, m=4)          # tokens, targets: [steps, dp, m, b, T]
    history = reference_training(data, seed=0)          # one process, the whole global batch

The model: an embedding [V, H], `layers` pre-LayerNorm transformer blocks (chapter 4's
`tensor_parallel.Block`: causal attention split by heads, a GELU MLP), a final LayerNorm and an
output layer [V, H] without bias, optionally tied to the embedding (`tied=True`, one matrix used
twice, as in GPT-2). Every size tensor parallelism divides is a multiple of 2, 3 and 4: HEADS = 12,
FFN = 48 (attention width A = 12 x 3 = 36, never H = 24: a split on the wrong dim fails).

What tensor parallelism leaves whole on every tp rank (embedding, LayerNorms, the biases of o and
fc2, the head) are *replicated* parameters: each tp rank computes the same full gradient for
them, so they are reduced over dp only. The rest are `DTensor`s sharded over the tp axis.

The loss of a step (chapter 2's token loss, over every replica and microbatch): L = sum S / N with
S the summed cross-entropy of the valid tokens and N their count in the whole global batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit import tensor_parallel as tpk
from labkit.pipeline import bench as pipeline_bench

VOCAB, HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS = 24, 24, 12, 3, 48, 4
MICRO_BATCH, SEQ = 2, 6
IGNORE = pipeline_bench.IGNORE


class TinyGPT(nn.Module):
    """tokens [b, T] -> logits [b, T, V]: embed, blocks, norm, head."""

    def __init__(self, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM, ffn=FFN,
                 layers=LAYERS, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)                          # [V, H]
        self.blocks = nn.ModuleList(tpk.Block(hidden, heads, head_dim, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)                  # [V, H]
        if tied:
            self.head.weight = self.embed.weight                          # one matrix, two uses

    def forward(self, tokens):                                            # tokens: [b, T]
        x = self.embed(tokens)                                            # [b, T, H]
        for block in self.blocks:
            x = block(x)                                                  # [b, T, H]
        return self.head(self.norm(x))                                    # [b, T, V]


def make_model(seed=0, layers=LAYERS, tied=False, dtype=torch.float64, device="cpu") -> TinyGPT:
    """A TinyGPT whose weights depend only on `seed` (every process that calls this agrees)."""
    model = TinyGPT(layers=layers, tied=tied).to(torch.float64)     # filled in float64, then cast
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        model.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))
        for i in range(layers):
            model.blocks[i].load_state_dict(tpk.make_block(
                seed=1000 * seed + i, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM,
                ffn=FFN).state_dict())
        model.norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64))
        model.norm.bias.copy_(0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64))
        if not tied:
            model.head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
                                    / math.sqrt(HIDDEN))
    return model.to(dtype=dtype, device=device)


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The blocks of pipeline stage `stage` of `pp`: as even as possible, the first ones one
    longer (chapter 5's cut). The embedding goes with stage 0, the norm and head with stage pp-1."""
    if not 1 <= pp <= layers:
        raise ValueError(f"cannot cut {layers} blocks into pp ({pp}) stages: need 1 <= pp <= "
                         f"layers ({layers})")
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    edges = pipeline_bench.bounds(layers, pp)
    return range(edges[stage], edges[stage + 1])


class Stage(nn.Module):
    """Pipeline stage `stage` of `pp` of a TinyGPT: x [b, T, H] (tokens [b, T] on stage 0) ->
    x [b, T, H] (logits [b, T, V] on the last stage).

    `named()` lists each parameter with its name in the whole model ("blocks.2.attn.q.weight"). A
    tied head on the last stage is named "embed.weight", like the embedding on stage 0: with pp > 1
    the two stages hold two copies of one parameter, and its gradient is the sum of theirs."""

    def __init__(self, model: TinyGPT, stage: int, pp: int):
        super().__init__()
        layers = stage_layers(len(model.blocks), pp, stage)
        self.stage, self.pp = stage, pp
        self.embed = model.embed if stage == 0 else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in layers)
        last = stage == pp - 1
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.layers = list(layers)
        self.tied = model.head.weight is model.embed.weight
        self.block_names = [f"blocks.{i}" for i in layers]

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)                              # tokens [b, T] -> [b, T, H]
        for block in self.blocks:
            x = block(x)                                   # [b, T, H]
        if self.head is not None:
            x = self.head(self.norm(x))                    # logits: [b, T, V]
        return x

    def model_name(self, name: str) -> str:
        """The name in the whole model of this stage's parameter `name` ("blocks.0.mlp.fc1.weight"
        of stage 1 is "blocks.2.mlp.fc1.weight" of the model)."""
        if name.startswith("blocks."):
            _, j, rest = name.split(".", 2)
            return f"blocks.{self.layers[int(j)]}.{rest}"
        if name == "head.weight" and self.tied:
            return "embed.weight"
        return name

    def named(self):
        """[(name in the model, parameter)] of this stage (parameters swapped for DTensors by
        tensor parallelism included)."""
        return [(self.model_name(n), p) for n, p in self.named_parameters()]


_MESHES = {}


def device_mesh(dims):
    """Rank side: torch's DeviceMesh of shape dims = (dp, pp, tp), axes named ("dp", "pp", "tp"),
    on this rank's device; made once per shape per world and reused. `init_device_mesh` makes new
    process groups every time it is called (a collective; each gloo group keeps threads), while
    DTensor's caches keep using the first mesh of an equal shape: make meshes once, not per step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from labkit import device
    key = (tuple(dims), id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device().type, tuple(dims),
                                        mesh_dim_names=("dp", "pp", "tp"))
    return _MESHES[key]


def tp_plan(sequence_parallel: bool = False) -> dict:
    """torch's tensor-parallel plan for one `tensor_parallel.Block`, keyed by submodule (chapter
    4, section 6): q, k, v and fc1 split by output features (Shard(0): Megatron's column cut,
    f on the input), o and fc2 by input features (Shard(1): the row cut, g on the output). The
    attention and the MLP convert their input to a replicated DTensor once, so the three input
    gradients of q, k, v are added before one all-reduce.

    sequence_parallel=True (chapter 4, section 4; Korthikanti et al. 2022): the activations
    between sub-blocks are [b, T/t, H], split along the sequence (dim 1). The LayerNorms run on
    this rank's tokens (`SequenceParallel`: their weights become Replicate DTensors, their
    gradients `Partial(sum)`: pending a sum over tp), the attention's and the MLP's input is
    all-gathered (`PrepareModuleInput(input_layouts=Shard(1))`), and o and fc2 reduce-scatter
    their output (`RowwiseParallel(output_layouts=Shard(1))`). torchtitan's Llama plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    between = Shard(1) if sequence_parallel else Replicate()      # x: [b, T/t, H] or [b, T, H]
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=between),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=between)}
    for sub in ("attn", "mlp"):
        plan[sub] = PrepareModuleInput(input_layouts=(between,),
                                       desired_input_layouts=(Replicate(),), use_local_output=False)
    if sequence_parallel:
        plan["ln1"], plan["ln2"] = SequenceParallel(), SequenceParallel()
    return plan


def stage_plan(stage: Stage) -> dict:
    """The sequence-parallel plan of what a stage holds outside its blocks (torch's styles):
    the embedding's output [b, T, H], the same on every tp rank, cut to this rank's [b, T/t, H]
    (`PrepareModuleOutput`: Replicate -> Shard(1), no bytes forward; its backward all-gathers
    the gradient, so the embedding's gradient is whole on every tp rank); the final LayerNorm on
    this rank's tokens (`SequenceParallel`); the head's input all-gathered back to [b, T, H]
    (`PrepareModuleInput`: Shard(1) -> Replicate), so that the head, the logits and the loss are
    the same on every tp rank, as without sequence parallelism. Activations between stages are
    [b, T/t, H]: each tp rank sends its own shard to the next stage."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleOutput,
                                                   SequenceParallel)
    plan = {}
    if stage.embed is not None:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=Shard(1))
    if stage.norm is not None:
        plan["norm"] = SequenceParallel()
        plan["head"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return plan


def tensor_parallel(stage: Stage, tp_mesh, sequence_parallel: bool = False) -> Stage:
    """Split every block of `stage` over the 1-D device mesh `tp_mesh` (rank side; a no-op when
    the mesh has one rank). Embedding, LayerNorms and head stay whole: replicated.

    sequence_parallel=True: `tp_plan(sequence_parallel=True)` on the blocks and `stage_plan` on
    the rest; the stage then takes and gives [b, T/t, H] between stages (T divisible by t), and
    the LayerNorms' gradients are `Partial(sum)` DTensors: sum them over tp before reading
    `to_local()` (chapter 6, section 3)."""
    if tp_mesh.size() == 1:
        return stage
    from torch.distributed.tensor.parallel import parallelize_module
    for block in stage.blocks:
        parallelize_module(block, tp_mesh, tp_plan(sequence_parallel))
    if sequence_parallel:
        parallelize_module(stage, tp_mesh, stage_plan(stage))
    return stage


def local(tensor):
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_replicated(parameter) -> bool:
    """True for a parameter every tp rank holds whole (a plain tensor, or a Replicate DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate
    if not isinstance(parameter, DTensor):
        return True
    return all(isinstance(p, Replicate) for p in parameter.placements)


# The dim each tensor-parallel weight is split along (tp_plan: Colwise = Shard(0), Rowwise =
# Shard(1) for the weight, and the Colwise bias); every other parameter is replicated.
SPLIT_DIM = {"attn.q.weight": 0, "attn.q.bias": 0, "attn.k.weight": 0, "attn.k.bias": 0,
             "attn.v.weight": 0, "attn.v.bias": 0, "attn.o.weight": 1,
             "mlp.fc1.weight": 0, "mlp.fc1.bias": 0, "mlp.fc2.weight": 1}


def split_dim(name: str):
    """The dim `tp_plan` splits the parameter `name` (a model name) along, or None (replicated)."""
    if not name.startswith("blocks."):
        return None
    return SPLIT_DIM.get(name.split(".", 2)[2])


def local_shard(name: str, whole: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """What tp rank `tp_rank` of `tp` holds of the model's parameter `name` under `tp_plan`:
    block tp_rank of `whole` along its split dim ([out, in] -> [out/tp, in] or [out, in/tp]), or
    all of it for a replicated parameter."""
    dim = split_dim(name)
    if dim is None or tp == 1:
        return whole
    return whole.chunk(tp, dim=dim)[tp_rank]


def stage_names(stage: int, pp: int, layers: int = LAYERS, tied: bool = False) -> list:
    """The model names of the parameters stage `stage` of `pp` holds (sorted)."""
    model = make_model(0, layers=layers, tied=tied)
    return sorted(name for name, _ in Stage(model, stage, pp).named())


def local_weights(stage: Stage) -> dict:
    """{name in the model: this rank's tensor (its tp shard, or the whole replicated tensor)},
    detached copies on CPU. No communication."""
    return {name: local(p).detach().cpu().clone() for name, p in stage.named()}


def full_weights(stage: Stage) -> dict:
    """{name in the model: whole weight, float64, CPU}; rank side (a DTensor is all-gathered over
    its tp group: every tp rank of the stage must call this)."""
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in stage.named():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = whole.detach().to("cpu", torch.float64).clone()
    return out


# ---- data and the single-process reference -----------------------------------------------------

def batches(seed=1, steps=1, dp=1, m=4, b=MICRO_BATCH, T=SEQ, ragged=False):
    """(tokens, targets), each [steps, dp, m, b, T] int64: replica d's microbatch i of step s is
    [s, d, i]. ragged=True: each sequence has 1..T valid tokens (the rest padding, target IGNORE),
    so replicas and microbatches hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    shape = (steps, dp, m, b, T)
    tokens = torch.randint(0, VOCAB, shape, generator=g)
    targets = torch.randint(0, VOCAB, shape, generator=g)
    if ragged:
        lengths = torch.randint(1, T + 1, shape[:-1], generator=g)          # [steps, dp, m, b]
        padding = torch.arange(T) >= lengths.unsqueeze(-1)                  # [steps, dp, m, b, T]
        tokens[padding] = 0
        targets[padding] = IGNORE
    return tokens, targets


def step_loss(model, tokens, targets):
    """L = sum S / N over every replica and microbatch of a step: tokens, targets [dp, m, b, T]."""
    logits = model(tokens.reshape(-1, tokens.shape[-1]))                  # [dp m b, T, V]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    count = int((targets != IGNORE).sum())
    if count == 0:
        raise ValueError("the step has no valid token: the loss is undefined")
    return total / count


OPTIMIZERS = ("adamw", "sgd")


def make_optimizer(params, kind="adamw", lr=1e-2, momentum=0.9, weight_decay=0.0):
    """The chapter's optimizers: AdamW (betas 0.9, 0.999, eps 1e-8) or SGD with momentum. Used by
    the reference and, on 1/dp of the parameters, by `Zero1`: element-wise, so a shard steps
    exactly as the whole would."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                               foreach=False)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")


def reference_training(data, seed=0, layers=LAYERS, tied=False, optimizer="adamw", lr=1e-2,
                       dtype=torch.float64, max_norm=None) -> list:
    """One process, the whole global batch of every step: {name: weight} after each step.
    data: (tokens, targets) from `batches`. max_norm: each step's gradient clipped by its global
    norm first (`torch.nn.utils.clip_grad_norm_`; a tied embedding is one parameter there)."""
    tokens, targets = data
    model = make_model(seed, layers=layers, tied=tied, dtype=dtype)
    opt = make_optimizer(model.parameters(), optimizer, lr=lr)
    history = []
    for s in range(tokens.shape[0]):
        opt.zero_grad()
        step_loss(model, tokens[s], targets[s]).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def reference_gradients(data, step=0, seed=0, layers=LAYERS, tied=False, dtype=torch.float64):
    """One process: {name: gradient} of step `step`'s loss at the initial weights."""
    tokens, targets = data
    model = make_model(seed, layers=layers, tied=tied, dtype=dtype)
    step_loss(model, tokens[step], targets[step]).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}
