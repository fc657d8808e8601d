"""The training layer: the fit loop, callbacks, metrics, learning-rate rules and checkpoints."""
