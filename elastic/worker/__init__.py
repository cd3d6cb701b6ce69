"""What runs inside a training process started by an elastic agent.

`ProgressReporter` needs nothing but the standard library; the JAX runtime
(`init`) imports JAX only when called.
"""

from elastic.worker.progress import ProgressReporter

__all__ = ["ProgressReporter"]
