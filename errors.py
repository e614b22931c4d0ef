"""The one exception type for input a user can fix.

main.py prints a UserError as a single line (no traceback) on every rank and
exits with status 2, so bad input never turns into a traceback wall or a hang.
"""


class UserError(Exception):
    """Bad configuration, data or snapshot: the message says what and where."""


def missing_package(asked, package, install=None):
    """The one line for an optional feature whose package is not installed (requirements.txt
    holds what training needs; requirements-dev.txt adds each feature's package)."""
    return UserError(f"{asked} needs {package}, which is not installed here: "
                     f"pip install {install or package} (requirements-dev.txt has it)")
