"""Exception types that more than one layer raises, kept below them all (no imports), so a
library module can say "this is a usage error" without importing the CLI layer."""


class UsageError(ValueError):
    """A command line that does not parse (exit 2), as against a run that fails (exit 1)."""


class SettingError(UsageError):
    """A config field its class refuses when it is built (``Class.field=value: why``): the
    run is refused before anything runs, exit 2 like a flag that does not parse."""


class SettingTypeError(SettingError, TypeError):
    """A config field of the wrong type (``Class.field=value: expected an int``)."""
