"""The serving processes: the Serve ingress (HTTP and gRPC), the model group's bring-up, the
coordinator streams, metrics, the API key, and ``specserve serve`` with its ports and cores."""
