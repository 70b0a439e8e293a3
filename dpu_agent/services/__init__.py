"""gRPC servicers of the agent, one module per API service."""
