"""The one exception type for every usage error the launcher reports.

A bad hostfile line, an unknown host in --include, a missing .dslaunch_env: all of them
are the user's to fix, so the CLI prints the message as one line and exits 2 without a
traceback. The message carries its own location (file:line, option name, host).
"""


class LaunchConfigError(ValueError):
    """A problem with the launch request; the message names where it is and what is wrong."""

    exit_code = 2
