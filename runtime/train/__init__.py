"""The top floor: training, composed from core/ and the strategies.

    engine.py          DeepSpeedEngine, what initialize() returns
    pipe_engine.py     PipelineEngine, for a deepspeed.pipe.PipelineModule
    checkpoint/        saving, loading and converting checkpoints (DeepSpeed's layout)
    optim.py, ops/     optimizers by name, DeepSpeed's optimizer classes over dslaunch.kernels
    lr_schedules.py    DeepSpeed's learning-rate schedules
    monitor/, profiling/, progress.py   what a run reports
    activation_checkpointing/, compression/, compiling.py, dataloader.py, model_export.py,
    autotuning.py (the hooks `dslaunch --autotuning` trials use), helpers.py

Nothing in core/ or in a strategy imports from here (docs/architecture.md).
"""
