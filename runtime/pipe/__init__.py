"""Pipeline parallelism (`deepspeed.pipe`): layers cut into stages over a process topology.

    net = deepspeed.pipe.PipelineModule(layers=model.to_layers(), num_stages=2, loss_fn=criterion)
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
    loss = engine.train_batch(data_iter)        # one global batch, 1F1B over the stages

`module` builds and runs a stage's layers, `partition` decides which stage owns which
layers, `schedule` is the instruction stream of each stage.
"""
from ..core.parallel import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec, from_pipeline_state
from .schedule import InferenceSchedule, TrainSchedule

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineError", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "TrainSchedule", "InferenceSchedule",
           "from_pipeline_state"]
