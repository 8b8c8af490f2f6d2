"""`deepspeed.runtime.sequence_parallel`: the Hugging Face path of Ulysses sequence
parallelism (ulysses_sp.py), where Accelerate and ArcticTraining look for it. The attention
exchange itself is dslaunch.runtime.sequence."""
