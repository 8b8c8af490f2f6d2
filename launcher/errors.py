"""The one exception type for every usage error the launcher reports, and the one-line rule.

A bad hostfile line, an unknown host in --include, a missing .dslaunch_env: all of them
are the user's to fix, so the CLI prints the message as one line and exits 2 without a
traceback. The message carries its own location (file:line, option name, host).

Messages quote what the user (or a file from another machine) wrote, and that text may hold
line breaks, carriage returns or terminal escapes. OneLineMessage makes an error's text one
printable line whatever it quotes: every character that is not printable is written as its
Python escape (`\\r`, `\\x85`, `\\x1b`), so one refusal is always one line on the terminal and
cannot forge another line or move the cursor.
"""


def one_line(text: str) -> str:
    """`text` with every non-printable character (line and paragraph breaks, controls) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class OneLineMessage(Exception):
    """Mixed into every error type whose message the user sees as one line."""

    def __str__(self) -> str:
        return one_line(super().__str__())


class LaunchConfigError(OneLineMessage, ValueError):
    """A problem with the launch request; the message names where it is and what is wrong."""

    exit_code = 2
