"""The gRPC server (`jaxserve.v1.InferenceService`, health, reflection, auth) and its Prometheus metrics."""
