"""`deepspeed.launcher.multinode_runner`: DeepSpeed's per-backend command builders, refused.

DeepSpeed's runner builds a pdsh / mpirun / srun command line with these classes and hands
it to its own per-node launcher (`deepspeed.launcher.launch --world_info=...`). dslaunch's
launcher builds, runs and supervises those commands itself (`dslaunch --launcher
pdsh|openmpi|mpich|mvapich|slurm`, the same as `deepspeed --launcher ...` here), with its
own per-node agent, so a command from DeepSpeed's builders would start a launcher that is
not there. Importing this module says so in one line.
"""
raise ImportError("deepspeed.launcher.multinode_runner (PDSHRunner, OpenMPIRunner, MPICHRunner, SlurmRunner, "
                  "MVAPICHRunner, MultiNodeRunner) is not provided: dslaunch's launcher builds and supervises the "
                  "pdsh/mpirun/srun commands itself; run `deepspeed --launcher NAME ...` (or `dslaunch --launcher "
                  "NAME ...`) instead of building the command")
