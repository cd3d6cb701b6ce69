"""The controller of one job: reconcile loop, executor, journal, gRPC servicer."""
