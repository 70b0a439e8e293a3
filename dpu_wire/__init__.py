"""What crosses the wire between host and DPU, shared by both sides.

- `dpu_wire.v1`: generated protobuf/gRPC stubs of the `dpu.v1` API (from `proto/`).
- `dpu_wire.names`: resource-name grammar shared by validation on both sides.

This package depends on neither `dpu_agent` nor `host_client`.
"""

API_PACKAGE = "dpu.v1"
"""The protobuf package of the API this distribution speaks."""

REQUEST_ID_METADATA_KEY = "x-request-id"
"""gRPC metadata key carrying the request id from the SDK through the agent's logs."""

__all__ = ["API_PACKAGE", "REQUEST_ID_METADATA_KEY"]
