"""One client's connection: the protocol handler between the transport and the session."""
