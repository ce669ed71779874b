"""omnifeed.loader.service: the sidecar — server, streams, shared-memory arena, protocol, metrics endpoint."""

from ._arena import DTYPES, batch_hook, build_template, merge, read_layout, read_reference
from ._attempts import resume_marker
from ._config import ServiceConfig, default_socket
from ._listener import MAX_SOCKET_PATH
from ._metrics import start_metrics_server
from ._protocol import (
    MAX_REPLY_BYTES,
    PROTOCOL,
    FrameReader,
    ProtocolError,
    ServiceError,
    ServiceUnavailableError,
    UntrustedServiceError,
    check_reply,
    connect,
    decode,
    next_request,
    receive,
    receive_frame,
    request_metrics,
    send,
    wait_until_serving,
)
from ._server import FeedService

__all__ = [
    "DTYPES",
    "FeedService",
    "FrameReader",
    "MAX_REPLY_BYTES",
    "MAX_SOCKET_PATH",
    "PROTOCOL",
    "ProtocolError",
    "ServiceConfig",
    "ServiceError",
    "ServiceUnavailableError",
    "UntrustedServiceError",
    "batch_hook",
    "build_template",
    "check_reply",
    "connect",
    "decode",
    "default_socket",
    "merge",
    "next_request",
    "read_layout",
    "read_reference",
    "receive",
    "receive_frame",
    "request_metrics",
    "resume_marker",
    "send",
    "start_metrics_server",
    "wait_until_serving",
]
