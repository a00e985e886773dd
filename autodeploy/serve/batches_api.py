"""OpenAI's Files and Batch APIs on the server (``autodeploy serve --batch-dir DIR``), persisted in ``DIR``.

``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files``, ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``; ``POST /v1/batches`` (``input_file_id``, ``endpoint``,
``completion_window`` "24h", ``metadata``), ``GET /v1/batches/{id}``, ``GET /v1/batches`` (``limit``, ``after``),
``POST /v1/batches/{id}/cancel``. Objects have OpenAI's fields, so the official client's ``files`` and ``batches``
work as they do against OpenAI.

A batch runs in the server's process, one at a time in the order created, through the same routes as online
requests (``batch_file.send_lines``): its requests share the engine's batches with online traffic. Its lines are
checked first (``parse_batch_lines``; a line for another endpoint than the batch's is an error record). Results with
status 200 go to its output file, the rest to its error file, appended a whole line at a time. Every object is a JSON
file in ``DIR`` written atomically (a temporary file renamed over it). A server started again on the same ``DIR``
carries on with the batch that was running, from the results already written (``finished_keys``): each request's
result is written once. ``cancel`` stops the batch's requests in flight (aborted in the engine) and keeps the results
written so far; a batch not done within its 24-hour window ends ``expired`` the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path

from fastapi import File, Form, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel

from autodeploy.serve.batch_file import (
    BatchLine, EngineStopped, ResultWriter, finished_keys, parse_batch_lines, result_record, send_lines,
)
from autodeploy.serve.openai_errors import APIError

logger = logging.getLogger(__name__)

WINDOW_S = 24 * 3600
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
_ID = re.compile(r"^(file|batch)-[0-9a-f]{24}$")
DONE = ("completed", "failed", "cancelled", "expired")


def _new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def _write_json(path: Path, value: dict) -> None:
    """Whole or not at all: a temporary file renamed over the old one."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value))
    os.replace(temporary, path)


class BatchStore:
    """Files and batches under ``folder`` (``files/ID.json`` + ``files/ID.data``, ``batches/ID.json``), and the task that
    runs the batches."""

    def __init__(self, folder: str | Path, served_model_name: str, concurrency: int, endpoints: tuple[str, ...] = ENDPOINTS[:2]):
        self.folder = Path(folder)
        self.served_model_name = served_model_name
        self.concurrency = concurrency
        self.endpoints = endpoints  # the routes a batch may name: those of what this deployment serves
        for kind in ("files", "batches"):
            (self.folder / kind).mkdir(parents=True, exist_ok=True)
        self._wake: asyncio.Event | None = None  # made in the server's loop (start)
        self._current: dict | None = None  # the batch running now: the one copy its status and counts are kept in
        self._running: asyncio.Task | None = None  # its requests (send_lines), cancelled by cancel_batch
        self._runner: asyncio.Task | None = None

    # files

    def _file_path(self, file_id: str, suffix: str) -> Path:
        if not _ID.match(file_id) or not file_id.startswith("file-"):
            raise APIError(404, f"no file {file_id!r}", code="file_not_found")
        return self.folder / "files" / f"{file_id}{suffix}"

    def add_file(self, data: bytes, filename: str, purpose: str) -> dict:
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch' (the only files this server takes), got {purpose!r}", param="purpose")
        return self._store_file(data, filename, purpose)

    def _store_file(self, data: bytes | Path, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """A file from ``data``: bytes, or a file of this folder's moved in as it is."""
        file_id = file_id or _new_id("file")
        destination = self._file_path(file_id, ".data")
        if isinstance(data, Path):
            os.replace(data, destination)
        else:
            destination.write_bytes(data)
        card = {"id": file_id, "object": "file", "bytes": destination.stat().st_size, "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        _write_json(self._file_path(file_id, ".json"), card)
        return card

    def file(self, file_id: str) -> dict:
        path = self._file_path(file_id, ".json")
        if not path.exists():
            raise APIError(404, f"no file {file_id!r}", code="file_not_found")
        return json.loads(path.read_text())

    def file_content(self, file_id: str) -> Path:
        self.file(file_id)
        return self._file_path(file_id, ".data")

    def files(self, purpose: str | None = None) -> list[dict]:
        cards = [json.loads(path.read_text()) for path in (self.folder / "files").glob("*.json")]
        return sorted((c for c in cards if purpose is None or c["purpose"] == purpose), key=lambda c: (c["created_at"], c["id"]))

    def delete_file(self, file_id: str) -> dict:
        self.file(file_id)
        for suffix in (".json", ".data"):
            self._file_path(file_id, suffix).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # batches

    def _batch_path(self, batch_id: str) -> Path:
        if not _ID.match(batch_id) or not batch_id.startswith("batch-"):
            raise APIError(404, f"no batch {batch_id!r}", code="batch_not_found")
        return self.folder / "batches" / f"{batch_id}.json"

    def batch(self, batch_id: str) -> dict:
        if self._current is not None and self._current["id"] == batch_id:
            return dict(self._current, request_counts=dict(self._current["request_counts"]))  # its counts as of now
        path = self._batch_path(batch_id)
        if not path.exists():
            raise APIError(404, f"no batch {batch_id!r}", code="batch_not_found")
        return json.loads(path.read_text())

    def batches(self) -> list[dict]:
        cards = [json.loads(path.read_text()) for path in (self.folder / "batches").glob("*.json")]
        return sorted(cards, key=lambda c: (c["created_at"], c["id"]), reverse=True)  # newest first, as OpenAI lists

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None) -> dict:
        if endpoint not in self.endpoints:
            raise APIError(400, f"endpoint must be one of {', '.join(self.endpoints)} (what this model serves), got {endpoint!r}",
                           param="endpoint")
        if completion_window != "24h":
            raise APIError(400, f"completion_window must be '24h', got {completion_window!r}", param="completion_window")
        card = self.file(input_file_id)
        if card["purpose"] != "batch":
            raise APIError(400, f"file {input_file_id} has purpose {card['purpose']!r}; a batch's input needs 'batch'",
                           param="input_file_id")
        now = int(time.time())
        batch = {"id": _new_id("batch"), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        self._save(batch)
        if self._wake is not None:
            self._wake.set()
        return batch

    def cancel_batch(self, batch_id: str) -> dict:
        running = self._current is not None and self._current["id"] == batch_id
        batch = self._current if running else self.batch(batch_id)
        if batch["status"] in (*DONE, "cancelling"):
            return batch
        batch.update(status="cancelling", cancelling_at=int(time.time()))
        self._save(batch)
        if running and self._running is not None:
            self._running.cancel()  # its requests in flight are aborted; the runner then ends it "cancelled"
        elif self._wake is not None:
            self._wake.set()
        return dict(batch)

    def _save(self, batch: dict) -> None:
        _write_json(self._batch_path(batch["id"]), batch)

    # the runner

    def start(self, app) -> None:
        """Run the batches (those a previous server left unfinished first) in the app's event loop."""
        for batch in self.batches():
            if batch["status"] in DONE:
                self._adopt_results(batch)  # a stop between a batch's end and the move of its results
        self._wake = asyncio.Event()
        self._runner = asyncio.ensure_future(self._run(app))

    async def stop(self) -> None:
        """Stop running batches (before the engine stops): the one in flight keeps its status, to go on next start."""
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    async def _run(self, app) -> None:
        while True:
            self._wake.clear()
            waiting = [b for b in reversed(self.batches()) if b["status"] not in DONE]
            if not waiting:
                await self._wake.wait()
                continue
            batch = waiting[0]
            try:
                await self._run_batch(app, batch)
            except asyncio.CancelledError:
                raise
            except EngineStopped:  # the engine is going away: the batch stays in progress, for the next start
                logger.warning("batch %s stopped with the engine; it goes on when the server starts again", batch["id"])
                return
            except Exception as error:  # the batch fails; the server and the next batches go on
                logger.exception("batch %s failed", batch["id"])
                self._fail(self.batch(batch["id"]), "server_error", str(error), None)  # with the results it has

    async def _run_batch(self, app, batch: dict) -> None:
        batch_id = batch["id"]
        if batch["status"] == "cancelling":
            return self._finish(batch, "cancelled")
        if time.time() > batch["expires_at"]:
            return self._finish(batch, "expired")
        try:
            text = self.file_content(batch["input_file_id"]).read_text(encoding="utf-8-sig", errors="replace")  # a BOM is not JSON
        except APIError:
            return self._fail(batch, "file_not_found", f"the input file {batch['input_file_id']} was deleted", "input_file_id")
        lines = parse_batch_lines(text.splitlines())
        for line in lines:
            if line.error is None and line.url != batch["endpoint"]:
                line.error = ("mismatched_url", f"line {line.number}'s url {line.url} is not the batch's endpoint {batch['endpoint']}")
        if batch["status"] == "validating":
            if not lines:
                return self._fail(batch, "empty_file", "the input file has no request lines", "input_file_id")
            batch.update(status="in_progress", in_progress_at=int(time.time()))
            batch["request_counts"]["total"] = len(lines)
            self._save(batch)
        outputs = {kind: self._results_path(batch_id, kind) for kind in ("output", "errors")}
        done = finished_keys(outputs["output"]) | finished_keys(outputs["errors"])
        counts = batch["request_counts"]
        counts["completed"] = sum(1 for _ in _lines_of(outputs["output"]))
        counts["failed"] = sum(1 for _ in _lines_of(outputs["errors"]))
        writers = {kind: ResultWriter(path) for kind, path in outputs.items()}
        saved = time.monotonic()

        def finish(line: BatchLine, status: int | None, body: dict | None, error=None) -> None:
            nonlocal saved
            writers["output" if status == 200 else "errors"].write(result_record(line, status, body, error))
            counts["completed" if status == 200 else "failed"] += 1
            if time.monotonic() - saved > 1.0:  # the counts a client polls, at most once a second
                self._save(batch)
                saved = time.monotonic()

        self._current = batch
        try:
            pending = [line for line in lines if line.key not in done]
            for line in pending:
                if line.error is not None:
                    finish(line, None, None, line.error)
            requests = [line for line in pending if line.error is None]
            self._running = asyncio.ensure_future(send_lines(
                app, requests, self.served_model_name, self.concurrency, lambda line, status, body: finish(line, status, body)))
            try:
                finished, _ = await asyncio.wait({self._running}, timeout=max(0.0, batch["expires_at"] - time.time()))
            except asyncio.CancelledError:  # the server is stopping: the batch goes on at its next start
                self._running.cancel()
                await asyncio.gather(self._running, return_exceptions=True)
                raise
            if not finished:  # its 24 hours are over
                self._running.cancel()
                await asyncio.gather(self._running, return_exceptions=True)
                return self._finish(batch, "expired", writers)
            if self._running.cancelled():  # cancel_batch
                return self._finish(batch, "cancelled", writers)
            self._running.result()  # a failure fails the batch (_run)
            self._finish(batch, "completed", writers)
        finally:
            self._running = self._current = None
            for writer in writers.values():
                writer.close()
            if batch["status"] in ("in_progress", "cancelling"):
                self._save(batch)  # the counts so far, for the next start

    def _finish(self, batch: dict, status: str, writers: dict | None = None) -> None:
        """Give the batch its final status and its results' file ids, saved first, then move the results into those
        files: a server stopped in between finds the batch done and completes the moves when it starts
        (``_adopt_results``), so no result is run again."""
        now = int(time.time())
        if writers is not None:
            for writer in writers.values():
                writer.close()
            writers.clear()
        for kind, field in (("output", "output_file_id"), ("errors", "error_file_id")):
            path = self._results_path(batch["id"], kind)
            if path.exists() and path.stat().st_size and batch[field] is None:
                batch[field] = _new_id("file")
        if status == "completed":
            batch["finalizing_at"] = now
        batch.update(status=status, **{f"{status}_at": now})
        self._save(batch)
        self._adopt_results(batch)

    def _fail(self, batch: dict, code: str, message: str, param: str | None) -> None:
        batch["errors"] = {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": None}]}
        self._finish(batch, "failed")

    def _adopt_results(self, batch: dict) -> None:
        for kind, field in (("output", "output_file_id"), ("errors", "error_file_id")):
            path = self._results_path(batch["id"], kind)
            if batch[field] is not None and path.exists() and not self._file_path(batch[field], ".json").exists():
                self._store_file(path, path.name, "batch_output", file_id=batch[field])
            path.unlink(missing_ok=True)

    def _results_path(self, batch_id: str, kind: str) -> Path:
        return self.folder / "batches" / f"{batch_id}.{kind}.jsonl"


def _lines_of(path: Path):
    if path.exists():
        yield from (text for text in path.read_text().splitlines() if text.strip())


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def add_batch_routes(app, store: BatchStore, authorized: list) -> None:
    """The Files and Batch API routes over ``store``."""

    @app.post("/v1/files", dependencies=authorized)
    async def upload(file: UploadFile = File(...), purpose: str = Form(...)) -> dict:
        return store.add_file(await file.read(), file.filename or "upload.jsonl", purpose)

    @app.get("/v1/files", dependencies=authorized)
    async def list_files(purpose: str | None = None) -> dict:
        return {"object": "list", "data": store.files(purpose), "has_more": False}

    @app.get("/v1/files/{file_id}", dependencies=authorized)
    async def retrieve_file(file_id: str) -> dict:
        return store.file(file_id)

    @app.get("/v1/files/{file_id}/content", dependencies=authorized)
    async def file_content(file_id: str):
        return FileResponse(store.file_content(file_id), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=authorized)
    async def delete_file(file_id: str) -> dict:
        return store.delete_file(file_id)

    @app.post("/v1/batches", dependencies=authorized)
    async def create_batch(body: CreateBatch) -> dict:
        return store.create_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)

    @app.get("/v1/batches/{batch_id}", dependencies=authorized)
    async def retrieve_batch(batch_id: str) -> dict:
        return store.batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=authorized)
    async def cancel_batch(batch_id: str) -> dict:
        return store.cancel_batch(batch_id)

    @app.get("/v1/batches", dependencies=authorized)
    async def list_batches(limit: int = 20, after: str | None = None) -> dict:
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be 1 … 100, got {limit}", param="limit")
        cards = store.batches()
        if after is not None:
            ids = [card["id"] for card in cards]
            cards = cards[ids.index(after) + 1:] if after in ids else []
        page = cards[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(cards) > limit}


def add_disabled_batch_routes(app) -> None:
    """Without ``--batch-dir`` the Files and Batch APIs answer 404, saying how to turn them on."""
    message = "this server keeps no batches: start it with --batch-dir DIR to use /v1/files and /v1/batches"

    for path in ("/v1/files", "/v1/files/{rest:path}", "/v1/batches", "/v1/batches/{rest:path}"):
        @app.api_route(path, methods=["GET", "POST", "DELETE"], include_in_schema=False)
        async def disabled() -> None:
            raise APIError(404, message, code="batches_disabled")
