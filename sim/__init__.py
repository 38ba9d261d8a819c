"""Device simulator: devices publishing telemetry, subscribers checking that nothing is lost."""

from sim.errors import SimError
from sim.simulation import (
    SimConfig,
    SimReport,
    SimSnapshot,
    Simulation,
    SubscriberReport,
    run_simulation,
)

__all__ = [
    "SimConfig",
    "SimError",
    "SimReport",
    "SimSnapshot",
    "Simulation",
    "SubscriberReport",
    "run_simulation",
]
