"""lmqtt package."""

# First of all (its import decides it): whether the mypyc-compiled modules run compiled.
import accelerators.compiled  # noqa: F401
