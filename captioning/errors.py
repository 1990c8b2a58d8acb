"""capflow's own errors: raised on purpose, with a message written for the user - what failed and what to do.

- :class:`InputError`: input capflow refuses (a config, a dataset, a store, a checkpoint, a results file, a model
  reference). ``capflow`` prints the message and exits 2.
- :class:`InfrastructureError`: the environment failed (the tracking server, Prefect, a Dask scheduler, the disk,
  another run holding the workdir). ``capflow`` prints the message and exits 3; finished work is kept and the same
  command resumes once the cause is fixed.
- Any other :class:`CapflowError` (a model gave non-finite numbers, a training rank failed): the message, exit 1.

Every class keeps the built-in base it had (``ValueError``, ``RuntimeError``, ``OSError``), so code that catches
those still does.
"""

from __future__ import annotations


class CapflowError(Exception):
    """An error capflow raises on purpose (its message is for the user)."""


class InputError(CapflowError):
    """Input capflow refuses: ``capflow`` exit status 2."""


class InfrastructureError(CapflowError):
    """The environment failed, not the input: ``capflow`` exit status 3, finished work kept."""
