"""What runs inside a training process started by an elastic agent.

`init()` (JAX is imported only when it is called) returns a `WorkerContext`:
mesh, process index and count, generation, checkpoints, progress, logger.
`ProgressReporter` needs nothing but the standard library.
"""

from elastic.worker.progress import ProgressReporter
from elastic.worker.runtime import WorkerContext, init

__all__ = ["ProgressReporter", "WorkerContext", "init"]
