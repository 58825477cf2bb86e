"""A stand-in engine served by vLLM's own HTTP launcher, behind fabric's drain middleware.

``python tests/launch/vllm_http_engine.py PORT`` serves ``/health`` and a
slow streamed ``POST /v1/completions`` (``max_tokens`` tokens, 0.1 s apart)
through ``vllm.entrypoints.launchers.launcher.serve_http`` -- vLLM's signal
handlers included -- with no engine behind it (``engine_client`` None), and
with ``EngineDrain`` added the way ``vllm serve --middleware`` adds it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from fabric.launch.drain import EngineDrain

TOKEN_DELAY_S = 0.1


def build_app() -> FastAPI:
    app = FastAPI()
    app.state.engine_client = None

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(_tokens(int(body["max_tokens"])), media_type="text/event-stream")

    app.add_middleware(EngineDrain)  # NOTE: what vLLM's --middleware does with a class
    return app


async def _tokens(count: int) -> AsyncIterator[bytes]:
    for i in range(count):
        await asyncio.sleep(TOKEN_DELAY_S)
        yield b"data: " + json.dumps({"text": f" t{i}"}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


async def serve(port: int) -> None:
    from vllm.entrypoints.launchers.launcher import create_server_socket, serve_http

    sock = create_server_socket(("127.0.0.1", port), reuse_port=False)
    # NOTE: as vllm/entrypoints/launchers/api_server/entry.py run_server_worker does.
    shutdown = await serve_http(build_app(), sock, host="127.0.0.1", port=port, log_level="warning")
    await shutdown
    sock.close()


if __name__ == "__main__":
    import uvloop

    uvloop.run(serve(int(sys.argv[1])))
