"""The simulator's one error root."""


class SimError(Exception):
    """The simulation cannot run: bad settings, or the gateway is unreachable or refused us.

    Loss is not an error: it is a finding, reported in the SimReport and the exit code.
    """
