"""Offline batch jobs in the OpenAI Batch API's file format: ``autodeploy batch MODEL --input F --output F``.

Each input line is one request, ``{"custom_id": …, "method": "POST", "url": "/v1/chat/completions", "body": {…}}``,
and each output line the result for one ``custom_id``, as OpenAI writes it::

    {"id": "batch_req_…", "custom_id": "q1", "response": {"status_code": 200, "request_id": "req_…", "body": {…}},
     "error": null}

The body of a response is exactly what the server's route returns for that request body: every line goes through
the routes of ``build_app`` in this process (``httpx.ASGITransport``: no socket), so validation, error bodies and
formats are the server's. A request the route refuses (a bad parameter, a prompt too long) is a result with its
status code and the route's error body. A line that is not a request at all (not JSON, no ``custom_id``, a second
line with a ``custom_id`` already seen, a ``url`` the server has no route for, ``"stream": true``) or one the model
cannot serve (``/v1/embeddings`` on a model that only generates, chat on an embedding model) is a result with
``response: null`` and ``error: {"code", "message"}``; one with no usable ``custom_id`` also carries ``"line"``, its
1-based line number. Nothing in the input stops the job.

**Resumable.** Results are appended as they finish, each line with one ``write`` to a file opened for appending, so
a job killed at any point leaves whole lines (at most a last partial one, which the next run cuts off). Run the same
command again and it skips every line whose result is in the output, keyed by ``custom_id`` (or ``"line"``), and
runs the rest: nothing lost, nothing twice.

**Throughput first.** The whole file is known, so the pending lines are submitted in the order of their prompts'
text (requests sharing a prefix arrive together and hit the prefix cache) and up to ``concurrency`` at once, so the
engine's batches stay full. A tqdm bar shows lines, output tokens/s and the ETA.

**Tables.** A Parquet file, an Arrow file or a ``datasets`` folder is read as one request a row (``table_lines``):
a column mapping names the prompt (or chat messages) column and, optionally, the ``custom_id`` column.

``autodeploy batch`` runs a file with ``batch_job.run_batch_file``; the server's Batch API (``batches_api.py``)
runs its batches with ``send_lines``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from autodeploy.errors import AutoDeployError, ConfigError

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


class EngineStopped(AutoDeployError):
    """A batch line's request was aborted by the engine stopping: the job stops with nothing written for it."""


@dataclass
class BatchLine:
    """One input line: a request to run, or (``error`` set) a line that becomes an error record as it is."""

    number: int  # 1-based
    custom_id: str | None = None
    url: str = ""
    body: dict | None = None
    error: tuple[str, str] | None = None  # (code, message)
    keyed_by_line: bool = False  # its result carries "line": no custom_id of its own to find it by

    @property
    def key(self) -> str:
        """What finds this line's result in an output file: its custom_id, or ``#N`` for line N."""
        return f"#{self.number}" if self.keyed_by_line else str(self.custom_id)


def parse_batch_lines(lines: Iterable[str]) -> list[BatchLine]:
    """The input file's lines, each a request or an error to record. Blank lines are skipped (not requests)."""
    parsed: list[BatchLine] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        parsed.append(_parse_line(number, text, seen))
    return parsed


def _parse_line(number: int, text: str, seen: set[str]) -> BatchLine:
    try:
        request = json.loads(text)
    except ValueError as error:
        return BatchLine(number, error=("invalid_json", f"line {number} is not JSON: {error}"), keyed_by_line=True)
    if not isinstance(request, dict):
        return BatchLine(number, error=("invalid_request", f"line {number} is a JSON {type(request).__name__}, not an object "
                                        f"with custom_id, method, url and body"), keyed_by_line=True)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, error=("missing_custom_id", f"line {number} has no custom_id (a non-empty string that names "
                                        f"its result)"), keyed_by_line=True)
    if custom_id in seen:
        return BatchLine(number, custom_id, error=("duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was used by "
                                               f"an earlier line; each line needs its own"), keyed_by_line=True)
    seen.add(custom_id)
    method, url, body = request.get("method", "POST"), request.get("url"), request.get("body")
    if method != "POST":
        return BatchLine(number, custom_id, error=("invalid_method", f"method must be POST, got {method!r}"))
    if url not in ROUTES:
        return BatchLine(number, custom_id, error=("invalid_url", f"url must be one of {', '.join(ROUTES)}, got {url!r}"))
    if not isinstance(body, dict):
        return BatchLine(number, custom_id, error=("invalid_body", f"body must be a JSON object, got {type(body).__name__}"))
    if body.get("stream"):
        return BatchLine(number, custom_id, error=("invalid_body", "a batch line cannot stream (\"stream\": true); drop it"))
    return BatchLine(number, custom_id, url, body)


TABLE_SUFFIXES = (".parquet", ".arrow")
_ROUTE_OF_FIELD = {"prompt": "/v1/completions", "messages": "/v1/chat/completions", "input": "/v1/embeddings"}


def table_lines(path: Path, columns: dict[str, str], url: str | None = None, body: dict | None = None) -> list[str]:
    """A Parquet file, an Arrow file (IPC file or stream) or a folder ``datasets.Dataset.save_to_disk`` wrote, as batch
    input lines: one request a row. ``columns`` maps request fields to the table's columns: ``prompt`` (completions),
    ``messages`` (chat: a list of ``{role, content}``) or ``input`` (embeddings: a text, or token ids), and optionally
    ``custom_id`` (default: ``row-N``, N from 0).
    ``url`` defaults to the route the prompt field implies; ``body`` holds the parameters every request shares
    (``max_tokens``, ``temperature``, …), a row's own fields taking precedence."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading Parquet, Arrow or datasets input needs pyarrow: pip install 'autodeploy[data]'") from None
    unknown = set(columns) - {*_ROUTE_OF_FIELD, "custom_id"}
    fields = [field for field in _ROUTE_OF_FIELD if field in columns]
    if unknown or len(fields) != 1:
        raise ConfigError(f"--columns maps one of prompt=COLUMN (completions), messages=COLUMN (chat) or input=COLUMN "
                          f"(embeddings), and optionally custom_id=COLUMN; got "
                          f"{', '.join(f'{k}={v}' for k, v in columns.items()) or 'nothing'}")
    url = url or _ROUTE_OF_FIELD[fields[0]]
    try:
        table = _read_table(path, pa, pq)
    except (OSError, pa.ArrowException) as error:
        raise ConfigError(f"cannot read {path} as Parquet, Arrow or a datasets folder: {error}") from None
    missing = [column for column in columns.values() if column not in table.column_names]
    if missing:
        raise ConfigError(f"{path} has no column {', '.join(map(repr, missing))}; its columns: {', '.join(table.column_names)}")
    data = {field: table.column(column).to_pylist() for field, column in columns.items()}
    lines = []
    for row in range(table.num_rows):
        custom_id = data["custom_id"][row] if "custom_id" in data else f"row-{row}"
        fields = {field: values[row] for field, values in data.items() if field != "custom_id"}
        lines.append(json.dumps({"custom_id": None if custom_id is None else str(custom_id), "method": "POST", "url": url,
                                 "body": {**(body or {}), **fields}}, ensure_ascii=False, default=str))
    return lines


def _read_table(path: Path, pa, pq):
    if path.is_dir():  # datasets' save_to_disk: data-00000-of-0000N.arrow, Arrow IPC streams
        shards = sorted(path.glob("data-*.arrow")) or sorted(path.glob("*.arrow"))
        if not shards:
            raise OSError(f"no data-*.arrow files in the folder {path}")
        return pa.concat_tables([_read_arrow(shard, pa) for shard in shards])
    if path.suffix == ".parquet":
        return pq.read_table(path)
    return _read_arrow(path, pa)


def _read_arrow(path: Path, pa):
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:  # not the file format: the stream format (what datasets writes)
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()


def finished_keys(output: Path) -> set[str]:
    """The keys (``BatchLine.key``) of the results already in ``output``. A last line without its newline (the write
    a kill cut short) is cut off the file, so that its request runs again and its result is written whole."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(output, "r+b") as handle:
            handle.truncate(end)
    keys = set()
    for number, text in enumerate(data[:end].decode("utf-8", errors="replace").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            keys.add(f"#{record['line']}" if "line" in record else str(record["custom_id"]))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{output} line {number} is not a result this command wrote; give another --output "
                              f"(or remove the file to start over)") from None
    return keys


def _prompt_text(line: BatchLine) -> str:
    """The text the line's request starts with, for ordering: lines sharing a prefix run together."""
    body = line.body or {}
    prompt = body.get("prompt", body.get("input", ""))
    if "messages" in body:
        prompt = body["messages"]
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


class ResultWriter:
    """Appends result lines, each with one write (whole lines survive a kill), and syncs them to disk every second."""

    def __init__(self, output: Path):
        output.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._synced = time.monotonic()

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, data)
        if written != len(data):  # a regular file takes a whole write unless the disk is full
            raise OSError(f"wrote {written} of {len(data)} bytes of a result line (disk full?)")
        if time.monotonic() - self._synced > 1.0:
            os.fsync(self._fd)
            self._synced = time.monotonic()

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


def result_record(line: BatchLine, status: int | None, body: dict | None, error: tuple[str, str] | None) -> dict:
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
              "response": None if status is None else {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}",
                                                        "body": body},
              "error": None if error is None else {"code": error[0], "message": error[1]}}
    if line.keyed_by_line:
        record["line"] = line.number
    return record


async def send_lines(app, requests: list[BatchLine], served_model_name: str, concurrency: int,
                     finish: Callable[[BatchLine, int, dict], None]) -> None:
    """POST each request line to ``app``'s route in process (its lifespan already running), ``concurrency`` at once, in
    the order of their prompts (shared prefixes together); ``finish(line, status, body)`` as each answers. When one
    fails, or this is cancelled, the requests in flight are cancelled (aborted in the engine) and none is finished."""
    import httpx

    queue = iter(sorted(requests, key=_prompt_text))

    async def worker(client: httpx.AsyncClient) -> None:
        for line in queue:  # each worker takes the next line as it finishes one: `concurrency` in flight
            while True:
                response = await client.post(line.url, json={"model": served_model_name, **line.body})
                try:
                    payload = response.json()
                except ValueError:
                    payload = {"error": {"message": response.text, "type": "server_error"}}
                code = (payload.get("error") or {}).get("code") if isinstance(payload, dict) else None
                if code == "aborted":  # the engine is stopping: no result, the line runs again next time
                    raise EngineStopped(f"the engine stopped while custom_id {line.custom_id!r} ran; run the job again to "
                                        f"finish it (the results written are kept)")
                if code != "queue_full":
                    break
                # The server's queue is full of online requests (admission.py): a batch line waits its turn rather than
                # failing for it.
                await asyncio.sleep(float(response.headers.get("retry-after", 1)))
            finish(line, response.status_code, payload)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        await _all_or_none([worker(client) for _ in range(min(concurrency, len(requests)))])


async def _all_or_none(coroutines: list) -> None:
    """Run ``coroutines`` as tasks until all end; when one fails, cancel the others and wait for them before raising
    its error, so none is still waiting for a response when the server shuts down (a request the shutdown aborts must
    not be written as a result: it runs again next time)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    if not tasks:
        return
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
