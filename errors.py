"""The one exception type for input a user can fix.

main.py prints a UserError as a single line (no traceback) on every rank and
exits with status 2, so bad input never turns into a traceback wall or a hang.
"""


class UserError(Exception):
    """Bad configuration, data or snapshot: the message says what and where."""
