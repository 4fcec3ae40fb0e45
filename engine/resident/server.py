"""The resident engine's process: an Engine behind a socket, serving every client that attaches.

    python -m engine.resident FOLDER        (started by engine.resident.start_resident)

It holds its folder's lock for life, starts the Engine from record.json, binds the folder's
socket and marks the record ready. Each request is a task on this process's event loop, so
the engine batches the requests of every client together; a client that drops a request
(`abort`) cancels its task, which aborts it in the engine and frees its KV pages. SIGTERM
(stop_resident) ends the tasks, shuts the engine down and removes the folder; an engine whose
scheduler or detokenizer died stops too, and leaves its folder marked failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

import engine.resident.protocol as protocol
from engine.frontend.engine import Engine
from engine.resident.registry import ResidentRecord, remove, take_lock
from engine.runtime.messages import ControlCall, GetInfo

logger = logging.getLogger("engine.resident")

_WATCH_SECONDS = 1.0


class ResidentServer:
    def __init__(self, record: ResidentRecord, engine: Engine) -> None:
        self.record = record
        self.engine = engine
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(record.endpoint)
        self.tasks: dict[tuple[bytes, int], asyncio.Task] = {}
        self.requests_served = 0
        self.clients: set[bytes] = set()
        self.started = time.time()
        self.stopping = asyncio.Event()
        self.failure: str | None = None  # why the engine stopped working, if it did

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        receiving = asyncio.ensure_future(self._receive())
        watching = asyncio.ensure_future(self._watch())
        await self.stopping.wait()
        receiving.cancel()
        watching.cancel()
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(receiving, watching, *self.tasks.values(), return_exceptions=True)

    async def _watch(self) -> None:
        """An engine whose scheduler or detokenizer died serves nobody: stop, and say why."""
        while True:
            await asyncio.sleep(_WATCH_SECONDS)
            try:
                self.engine.tokenizer_manager.check_usable()
            except RuntimeError as e:
                logger.error("the engine stopped working: %s", e)
                self.failure = str(e)
                self.stopping.set()
                return

    async def _receive(self) -> None:
        while True:
            client, payload = await self.socket.recv_multipart()
            op, call_id, body = _load(payload)
            self.clients.add(client)
            if op == protocol.GENERATE:
                work = self.engine.async_run_generate(body)
                self.tasks[client, call_id] = asyncio.ensure_future(
                    self._run(client, call_id, work)
                )
            elif op == protocol.ENCODE:
                work = self.engine.async_encode(**dataclasses.asdict(body))
                self.tasks[client, call_id] = asyncio.ensure_future(
                    self._run(client, call_id, work)
                )
            elif op == protocol.ABORT:
                task = self.tasks.get((client, call_id))
                if task is not None:
                    task.cancel()  # the engine aborts the request and frees its pages
            elif op == protocol.CONTROL:
                await self._reply(client, call_id, functools.partial(self._control, body))
            elif op == protocol.CHAT_TEMPLATE:
                await self._reply(client, call_id, functools.partial(self._chat_template, *body))
            else:  # a client of another version: an answer, never a silent wait
                error = RuntimeError(
                    f"this resident engine speaks protocol {protocol.VERSION} and does not "
                    f"know {op!r}: the client is of another version of gristmill"
                )
                await self._send(client, protocol.error_reply(call_id, error))

    async def _run(self, client: bytes, call_id: int, work: Any) -> None:
        """A request's call (generate or encode) on the Engine, answered when it is done; a
        cancelled one (the client aborted it) is not answered."""
        try:
            result = await work
            reply = (protocol.RESULT, call_id, result)
            self.requests_served += len(result) if isinstance(result, list) else 1
        except asyncio.CancelledError:
            return
        except Exception as e:
            reply = protocol.error_reply(call_id, e)
        finally:
            self.tasks.pop((client, call_id), None)
        await self._send(client, reply)

    async def _reply(self, client: bytes, call_id: int, fn: Any) -> None:
        try:
            value = await asyncio.to_thread(fn)  # (engine control calls block)
            await self._send(client, (protocol.RESULT, call_id, value))
        except Exception as e:
            await self._send(client, protocol.error_reply(call_id, e))

    def _control(self, call: ControlCall) -> Any:
        """A management call, run on the Engine by its type; get_server_info adds this
        process's own "resident" section."""
        if not isinstance(call, ControlCall):
            raise TypeError(f"a resident engine does not serve {call!r}")
        return self.info() if isinstance(call, GetInfo) else self.engine.run_control(call)

    def _chat_template(self, conversation: Any, kwargs: dict[str, Any]) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this resident engine has skip_tokenizer_init=True: no chat template")
        return tokenizer.apply_chat_template(conversation, **kwargs)

    async def _send(self, client: bytes, reply: tuple) -> None:
        await self.socket.send_multipart([client, pickle.dumps(reply)])

    def info(self) -> dict[str, Any]:
        return {
            **self.engine.get_server_info(),
            "resident": {
                "id": self.record.id,
                "pid": self.record.pid,
                "uptime_seconds": time.time() - self.started,
                "requests_served": self.requests_served,
                "requests_running": len(self.tasks),
                "clients_seen": len(self.clients),
            },
        }

    def close(self) -> None:
        self.socket.close(linger=0)
        self.ctx.term()


async def _serve(record: ResidentRecord, engine: Engine) -> str | None:
    """Serve until stopped; why the engine stopped working, if that is why."""
    server = ResidentServer(record, engine)  # (its sockets belong to this event loop)
    try:
        await server.serve()
    finally:
        server.close()
    return server.failure


def _load(payload: bytes) -> tuple[str, int, Any]:
    return pickle.loads(payload)


def main(folder: str) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    path = Path(folder)
    try:
        lock = take_lock(path)  # noqa: F841 (held until this process ends)
    except BlockingIOError:
        logger.error("another process serves %s", folder)
        return 1
    record = ResidentRecord.load(path)
    record.pid = os.getpid()
    record.save()
    try:
        engine = Engine(**record.args)
    except Exception as e:
        logger.exception("the engine did not start")
        record.state, record.error = "failed", f"{type(e).__name__}: {e}"
        record.save()
        return 1
    info = engine.get_server_info()
    record.info = {
        "device": info["device"],
        "max_total_num_tokens": info["max_total_num_tokens"],
        "max_running_requests": info["max_running_requests"],
        "engine_startup_seconds": engine.startup_seconds,
        "pids": info["pids"],
    }
    record.state, record.ready_seconds = "ready", time.time() - record.started
    record.save()
    logger.info("resident engine %s ready in %.1fs", record.id, record.ready_seconds)
    try:
        failure = asyncio.run(_serve(record, engine))
    finally:
        engine.shutdown()
    if failure is not None:  # the folder stays, for `gristmill engine status` to show
        record.state, record.error = "failed", failure
        record.save()
        return 1
    logger.info("resident engine %s stopped", record.id)
    remove(record)
    return 0
