"""Exception types that more than one layer raises, kept below them all (no imports), so a
library module can say "this is a usage error" without importing the CLI layer."""


class UsageError(ValueError):
    """A command line that does not parse (exit 2), as against a run that fails (exit 1)."""
