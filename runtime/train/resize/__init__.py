"""The runtime's side of a job whose size changes (`dslaunch --min_nodes`, docs/elastic.md).

    contract.py  the variables the launcher sets for it, read and checked in one place
    batch.py     the same global batch at every world size: accumulation grows as data
                 ranks shrink (or the config's `elasticity` section decides)
    link.py      the datagram socket to this host's node agent: progress out, requests in
    ../resize_driver.py  at every optimizer step: save every N steps, stop for a resize after
                 a checkpoint; at initialize(): resume from the latest complete checkpoint

A script that loops over the engine's data loader, or until engine.global_steps reaches its
total, needs no change: the engine saves, resumes and re-cuts its state by itself.
"""
from .contract import ResizeEnv

__all__ = ["ResizeEnv"]
