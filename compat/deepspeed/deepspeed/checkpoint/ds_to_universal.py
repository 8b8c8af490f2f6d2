"""deepspeed.checkpoint.ds_to_universal: dslaunch's converter to DeepSpeed's universal layout
(dslaunch.runtime.checkpoint.ds_to_universal). A file, not an alias, so that
`python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...` runs."""
from dslaunch.runtime.train.checkpoint.ds_to_universal import (  # noqa: F401
    _aggregate_autoep_zero12_metadata, _group_per_tp_shapes, _merge_zero_shards, _validate_autotp_conversion_support,
    ds_to_universal, main, merge_tp_slices, parse_arguments)

if __name__ == "__main__":
    ds_to_universal.main(prog_name="python -m deepspeed.checkpoint.ds_to_universal")
