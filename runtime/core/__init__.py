"""The ground floor of the runtime: what every strategy and the engine stand on.

    comm/          every collective, on a named process group; the watchdog and flight record
    config/        the DeepSpeed config as typed dataclasses (the monitor and elasticity
                   sections included) and the batch-size rule
    parallel/      the named-axis process mesh (pipe, data, sequence, tensor, expert)
    accelerator/   get_accelerator() and the pinned-memory tally
    strict.py      strict parsing of config sections; ConfigError
    errors.py      CheckpointError
    strategy.py    the GradientStrategy interface the strategies implement, and their registry
    reduction.py   how gradients are summed (bucketing, predivision, the communication dtype)
    nonfinite.py   the non-finite gradient guard
    loss_scaler.py the fp16 loss scaler
    precision.py   mixed precision: what the engine does to a forward's inputs and context
    internals.py   DeepSpeed's internal optimizer wrappers, by name only

Nothing here imports a strategy (zero/, tensor_parallel/, sequence/, pipe/, moe/) or train/:
the layering contract in pyproject.toml checks it (docs/architecture.md).
"""
