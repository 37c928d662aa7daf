#!/usr/bin/env python3
"""A minimal "kubelet" on gRPC C-core (the grpcio package), for checking a device plugin against a
gRPC stack other than tonic and with a chosen HTTP/2 :authority.

It serves DIR/kubelet.sock, accepts the first Register, dials the plugin socket named in it with
the given authority, and calls GetDevicePluginOptions and ListAndWatch (first message). Messages
are handled as raw bytes, so no generated code is needed.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install grpcio
    devplug run --config cfg.yaml --kubelet-dir DIR &
    /tmp/venv/bin/python tools/interop/grpcio_kubelet.py DIR [AUTHORITY]

AUTHORITY: omitted = C-core's default for unix: targets; SOCK = the plugin socket's path (what
kubelets up to 1.25 send); anything else is sent as given. Exit status 0 when both calls succeed.
"""
import os
import sys
import threading
from concurrent import futures

import grpc


def endpoint_of(register_request: bytes) -> str:
    """Field 2 (endpoint) of a RegisterRequest; the fields here are short strings."""
    i = 0
    while i < len(register_request):
        tag, length = register_request[i], register_request[i + 1]
        value = register_request[i + 2 : i + 2 + length]
        i += 2 + length
        if tag >> 3 == 2:
            return value.decode()
    raise ValueError("RegisterRequest without an endpoint")


def main() -> int:
    folder = sys.argv[1]
    authority = sys.argv[2] if len(sys.argv) > 2 else None
    requests, registered = [], threading.Event()

    def register(request, _context):
        requests.append(request)
        registered.set()
        return b""

    handler = grpc.method_handlers_generic_handler(
        "v1beta1.Registration",
        {"Register": grpc.unary_unary_rpc_method_handler(register)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port("unix:" + os.path.join(folder, "kubelet.sock"))
    server.start()
    try:
        if not registered.wait(10):
            print("no Register within 10 s")
            return 1
        socket = os.path.join(folder, endpoint_of(requests[0]))
        options = []
        if authority is not None:
            options = [("grpc.default_authority", socket if authority == "SOCK" else authority)]
        channel = grpc.insecure_channel("unix:" + socket, options=options)
        ok = True
        try:
            reply = channel.unary_unary("/v1beta1.DevicePlugin/GetDevicePluginOptions")(b"", timeout=5)
            print("GetDevicePluginOptions: ok,", len(reply), "bytes")
        except grpc.RpcError as err:
            print("GetDevicePluginOptions failed:", err.code(), err.details())
            ok = False
        try:
            for message in channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch")(b"", timeout=5):
                print("ListAndWatch: first list,", len(message), "bytes")
                break
        except grpc.RpcError as err:
            print("ListAndWatch failed:", err.code(), err.details())
            ok = False
        return 0 if ok else 1
    finally:
        server.stop(0)


if __name__ == "__main__":
    sys.exit(main())
