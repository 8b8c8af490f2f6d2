"""`python -m dslaunch.runtime.consolidate CKPT_DIR OUT [--tag TAG]`: kept as an entry point;
the command lives in dslaunch.runtime.checkpoint.consolidate (`dslaunch consolidate`)."""
from .train.checkpoint.consolidate import consolidate, consolidate_checkpoint  # noqa: F401

if __name__ == "__main__":
    consolidate.main(prog_name="python -m dslaunch.runtime.consolidate")
