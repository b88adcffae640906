"""The 3D mesh: data x pipeline x tensor parallelism with ZeRO-1, composed from chapters 1-5
(chapter 6, `course/06_3d_parallelism.ipynb`; lab 6).

    from labkit import mesh
    mesh.check_world_size(8, dp=2, tp=2, pp=3)         # "world size (8) != dp (2) x tp (2) x pp (3) ..."
    mesh.axis_groups(dp=2, pp=2, tp=2)                  # {"dp": [[0, 4], ...], "tp": [[0, 1], ...], ...}
    dims_mesh = mesh.device_mesh((dp, pp, tp))                  # on a rank: torch's DeviceMesh, once
    stage = mesh.Stage(mesh.make_model(seed=0), pp_rank, pp)    # this stage's layers ...
    mesh.tensor_parallel(stage, dims_mesh["tp"])                # ... split over the tp axis
    mesh.tensor_parallel(stage, dims_mesh["tp"], sequence_parallel=True)   # ... or with SP
    optimizer = mesh.Zero1(stage.parameters(), dp_group)        # ZeRO-1 over the dp axis
    mesh.cost.predict(model, cluster, config, global_batch)     # a configuration's step and memory

| module | what |
|---|---|
| `layout` | plain functions: world size and its errors, a rank's coordinates, each axis's groups, the nodes a group spans (course order: dp, pp, tp, tp innermost) |
| `model` | the bench: a small GPT of chapter 4's blocks, cut into stages, torch's tensor-parallel plan (with or without sequence parallelism), data with ragged token counts, the single-process reference |
| `zero1` | ZeRO stage 1 over the dp group for a stage's local tensors (AdamW or SGD with momentum) |
| `figures` | quoted figures: GPUs and links of DGX A100 / H100 nodes (vendor datasheets), Megatron-LM's 2021 table |
| `cost` | the step-time and memory model of a configuration: compute, bubble, bytes per axis, chapter 3's ledger |
| `widget` | the configuration explorer (ipywidgets) |
| `timing` | one real step against the model: matmul and link rates measured on the ranks, the step's FLOPs and calls, its predicted time; activation bytes a rank keeps (DTensor shards included) |
| `wire` | bytes counted on the wire, summed by how two ranks relate (same tp, pp or dp group, or none) |
| `pictures` | the mesh by node with each axis's groups coloured; one 3D step's timeline |
| `selfcheck` | the chapter's self-checks: the answers, computed when asked, shown after an attempt |
| `checks`, `train_checks` | lab 6's checkers |

Not here (lab 6): a layout for any axes in any order with the node check (task 1), a 3D step with
ragged replicas and a tied embedding (task 2), the search for the best configuration (task 3).
"""
from labkit.mesh import cost, figures, layout, model, pictures, timing, wire  # noqa: F401
from labkit.mesh.figures import CLUSTERS, DGX_A100, DGX_H100, Cluster, Model  # noqa: F401
from labkit.mesh.layout import (AXES, axis_groups, check_world_size, coordinates,  # noqa: F401
                                expert_groups,
                                crosses_nodes, divisors, inside_node, my_groups, node_of,
                                nodes_spanned, rank_of, world_size)
from labkit.mesh.model import (Stage, batches, device_mesh, full_weights,  # noqa: F401
                               is_replicated, local, local_shard, local_weights, make_model,
                               reference_training, split_dim, stage_names, stage_plan,
                               tensor_parallel, tp_plan)


def __getattr__(name):
    # Zero1 imports torch.distributed: loaded on first use.
    if name == "Zero1":
        from labkit.mesh.zero1 import Zero1
        return Zero1
    raise AttributeError(f"module 'labkit.mesh' has no attribute {name!r}")
