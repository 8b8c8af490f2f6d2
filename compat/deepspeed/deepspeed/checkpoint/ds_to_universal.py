"""deepspeed.checkpoint.ds_to_universal: dslaunch's converter to DeepSpeed's universal layout
(dslaunch.runtime.checkpoint.ds_to_universal). A file, not an alias, so that
`python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...` runs."""
from dslaunch.runtime.train.checkpoint.ds_to_universal import (  # noqa: F401
    _aggregate_autoep_zero12_metadata, ds_to_universal, main, parse_arguments)

if __name__ == "__main__":
    ds_to_universal.main(prog_name="python -m deepspeed.checkpoint.ds_to_universal")
