"""Device simulator: devices publishing telemetry, subscribers checking that nothing is lost."""

from gateway.sim.errors import SimError
from gateway.sim.simulation import (
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
