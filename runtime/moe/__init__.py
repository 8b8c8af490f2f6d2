"""Mixture of Experts with expert parallelism (`deepspeed.moe`).

    gating.py   the routing decisions and the load-balancing loss (pure tensor functions)
    experts.py  the experts one rank holds (copies of the given module, marked as expert params)
    layer.py    MoE / MOELayer / TopKGate: gate, encode, all-to-all over the mesh's `expert`
                group, experts, all-to-all back, decode
    utils.py    is_moe_param and the optimizer param-group split (`"moe": True` groups reduce
                over the mesh's `expert_data` axis; runtime/core/strategy.py)
    autoep/     AutoEP (the config's `expert_parallel` section): a Hugging Face MoE model's
                blocks swapped for expert-parallel layers at initialize

The engine finds MoE layers in the model, builds its mesh with `expert = ep_size`
(runtime/core/parallel/) and gives every layer its expert-parallel group.
"""
