"""Communication layer: launch environments, the runtime, and collectives. Imports nothing above it."""
