"""A real gRPC server and client (PyPI's grpcio) for the end-to-end tests of sluice's gRPC answers
(tests/tests/envoy_answers.rs). Messages are raw bytes: no protobuf is needed.

    python peer.py serve
        Serves /sluice.Test/* on 127.0.0.1 (a free port, printed as "PORT <n>" once listening) until its
        standard input closes: every method answers b"ok", except /sluice.Test/Fail, which fails with
        UNAVAILABLE (14) as an overloaded upstream would.

    python peer.py call <host:port> <method> <count> [--until-shed]
        Makes <count> unary calls one after the other, and prints one JSON line per call: its status code (a
        number), details, response and trailing metadata. --until-shed stops after the first answer that
        carries x-sluice-shed (sluice shed it). No retries: the client sees every answer as sent.
"""

import json
import sys
import time
from concurrent import futures

import grpc

OPTIONS = [("grpc.enable_retries", 0)]


def serve():
    def ok(request, context):
        return b"ok"

    def fail(request, context):
        context.abort(grpc.StatusCode.UNAVAILABLE, "upstream down")

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(ok)
        for name in ["Ok", "Limited", "Closed", "Custom"]
    }
    handlers["Fail"] = grpc.unary_unary_rpc_method_handler(fail)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("sluice.Test", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"PORT {port}", flush=True)
    sys.stdin.read()
    server.stop(0)


def call(target, method, count, until_shed):
    with grpc.insecure_channel(target, options=OPTIONS) as channel:
        stub = channel.unary_unary(method)
        for _ in range(count):
            try:
                response, outcome = stub.with_call(b"ping", timeout=5)
                line = {"code": 0, "details": "", "response": response.decode(),
                        "trailing": dict(outcome.trailing_metadata() or ())}
            except grpc.RpcError as error:
                line = {"code": error.code().value[0], "details": error.details() or "", "response": None,
                        "trailing": dict(error.trailing_metadata() or ())}
            print(json.dumps(line), flush=True)
            if until_shed:
                if "x-sluice-shed" in line["trailing"]:
                    return
                time.sleep(0.002)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        call(sys.argv[2], sys.argv[3], int(sys.argv[4]), "--until-shed" in sys.argv[5:])
