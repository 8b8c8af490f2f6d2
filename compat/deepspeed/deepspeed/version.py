# DeepSpeed's API level this package serves (high enough for the version gates of current
# transformers and accelerate), then "+dslaunch.<dslaunch's version>": honest about what it is.
# tests/compat/test_hf_compat_package.py checks the local part against dslaunch's own version.
__version__ = "0.19.8+dslaunch.0.1.0"
