"""The worker's service edge: settings, bootstrap, the gRPC server and servicer, and the
operations they call."""
