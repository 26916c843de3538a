"""Errors of the deployment kit, rooted in :class:`KitError`.

::

    KitError
    ├── KitUsageError (ValueError)       a bad name, host, port or option combination
    ├── KitExistsError (FileExistsError) refusing to replace a CA, certificate or password
    └── KitStateError                    the kit folder is missing or holds unreadable files

The command line turns every one of them into one line on stderr and exit status 2.
"""

from __future__ import annotations

__all__ = ["KitError", "KitExistsError", "KitStateError", "KitUsageError"]


class KitError(Exception):
    """Base class of every error the deployment kit raises."""


class KitUsageError(KitError, ValueError):
    """An invalid fleet name, device id, host name, port or combination of options."""


class KitExistsError(KitError, FileExistsError):
    """The file exists and replacing it would invalidate credentials; ``--force`` does."""


class KitStateError(KitError):
    """The kit folder is not there, or a file in it cannot be read or parsed."""
