"""Config files with numbers and keys that poison training or confuse a reader: the cases
tests/runtime/core/test_config_numbers.py holds dslaunch's config reader to, and that
scripts/make_ds_config_number_fixtures.py runs through DeepSpeed 0.19.8 for the record.

Each case is the text of a JSON config file (the text, not a dict: NaN, Infinity and a key
given twice exist only in text) and the one line dslaunch refuses it with, after the file's
name. Every config trains a 4->2 linear layer with AdamW unless it says otherwise.
"""

BATCH = '"train_batch_size": 2'


def with_optimizer(params: str, kind: str = "AdamW") -> str:
    return '{%s, "optimizer": {"type": "%s", "params": {%s}}}' % (BATCH, kind, params)


def with_top(key_values: str) -> str:
    return '{%s, "optimizer": {"type": "AdamW"}, %s}' % (BATCH, key_values)


def with_scheduler(params: str) -> str:
    return ('{%s, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR", "params": {%s}}}'
            % (BATCH, params))


# name -> (config text, dslaunch's line after "FILE: ")
CASES = {
    "lr_nan": (with_optimizer('"lr": NaN'), "optimizer.params.lr: must be finite, got NaN"),
    "lr_infinity": (with_optimizer('"lr": Infinity'), "optimizer.params.lr: must be finite, got Infinity"),
    "lr_string": (with_optimizer('"lr": "0.01"'),
                  'optimizer.params.lr: expected a number, got "0.01" (a string: write the number without quotes)'),
    "lr_negative": (with_optimizer('"lr": -1'), "optimizer.params.lr: must be >= 0, got -1"),
    "lr_true": (with_optimizer('"lr": true'), "optimizer.params.lr: expected a number, got true"),
    "betas_above_one": (with_optimizer('"betas": [1.5, 0.9]'),
                        "optimizer.params.betas[0]: must be >= 0 and < 1, got 1.5"),
    "betas_one_value": (with_optimizer('"betas": [0.9]'),
                        "optimizer.params.betas: expected a list of 2 numbers, got [0.9]"),
    "eps_negative": (with_optimizer('"eps": -1e-8'), "optimizer.params.eps: must be >= 0, got -1e-08"),
    "weight_decay_nan": (with_optimizer('"weight_decay": NaN'),
                         "optimizer.params.weight_decay: must be finite, got NaN"),
    "sgd_momentum_negative": (with_optimizer('"lr": 0.1, "momentum": -0.5', "SGD"),
                              "optimizer.params.momentum: must be >= 0, got -0.5"),
    "clipping_nan": (with_top('"gradient_clipping": NaN'), "gradient_clipping: must be finite, got NaN"),
    "clipping_infinity": (with_top('"gradient_clipping": Infinity'),
                          "gradient_clipping: must be finite, got Infinity"),
    "clipping_string": (with_top('"gradient_clipping": "1.0"'), 'gradient_clipping: expected float, got "1.0"'),
    "clipping_negative": (with_top('"gradient_clipping": -1'), "gradient_clipping: must be >= 0, got -1.0"),
    "warmup_max_lr_nan": (with_scheduler('"warmup_max_lr": NaN'),
                          "scheduler.params.warmup_max_lr: must be finite, got NaN"),
    "warmup_steps_string": (with_scheduler('"warmup_num_steps": "10"'),
                            'scheduler.params.warmup_num_steps: expected a whole number, got "10" (a string: write '
                            'the number without quotes)'),
    "duplicate_top_key": ('{"train_batch_size": 4, "train_batch_size": 8, "optimizer": {"type": "AdamW"}}',
                          "train_batch_size: the key is given twice; DeepSpeed refuses duplicate keys too: keep one"),
    "duplicate_nested_key": (with_optimizer('"lr": 0.1, "lr": 0.2'),
                             "optimizer.params.lr: the key is given twice; DeepSpeed refuses duplicate keys too: "
                             "keep one"),
    "nested_200000_deep": ('{"train_batch_size": 2, "x": ' + "[" * 200000 + "]" * 200000 + "}",
                           "objects and lists nested more than 64 deep; a DeepSpeed config needs only a few levels"),
}
