"""The error of a benchmark that could not run or measured nothing (exit status 1; a user's mistake in the flags is a
ValueError, exit status 2)."""


class BenchmarkError(Exception):
    """The server unreachable or failing, or no request succeeded."""
