"""``autodeploy batch``'s job: a batch file (``batch_file.py``'s format) through ``build_app``'s routes in this
process, resumably.

    summary = run_batch_file(llm, "requests.jsonl", "results.jsonl", served_model_name="my-model")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from autodeploy.errors import ConfigError
from autodeploy.serve.app import ServerOptions, build_app
from autodeploy.serve.batch_file import (
    TABLE_SUFFIXES, BatchLine, ResultWriter, finished_keys, parse_batch_lines, result_record, send_lines,
    table_lines,
)
from autodeploy.serve.embeddings_api import TASK_OF_ROUTE, unserved_task


@dataclass
class BatchSummary:
    lines: int = 0
    already_done: int = 0
    succeeded: int = 0
    failed: int = 0  # error records and non-200 responses written this run
    output_tokens: int = 0
    seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)  # code → count, this run

    def line(self) -> str:
        rate = f", {self.output_tokens / self.seconds:.1f} output tok/s" if self.seconds > 0 and self.output_tokens else ""
        why = f" ({', '.join(f'{code} ×{count}' for code, count in sorted(self.failures.items()))})" if self.failures else ""
        return (f"{self.lines} lines: {self.already_done} already done, {self.succeeded} succeeded, {self.failed} failed{why}"
                f" in {self.seconds:.1f}s{rate}")


def read_batch_input(input_path: str | Path, output_path: str | Path, columns: dict[str, str] | None = None,
                     url: str | None = None, body: dict | None = None) -> tuple[list[BatchLine], set[str]]:
    """The input's lines and the keys of the results already in ``output_path``: every check of the two files, so the
    CLI makes it before a build that may take minutes. A ``.parquet`` or ``.arrow`` file or a folder is a table
    (``table_lines``: ``columns``, ``url``, ``body``); anything else JSONL batch lines."""
    input_path, output_path = Path(input_path), Path(output_path)
    if input_path.resolve() == output_path.resolve():
        raise ConfigError(f"--input and --output are the same file ({input_path}); results need a file of their own")
    if input_path.is_dir() or input_path.suffix in TABLE_SUFFIXES:
        lines = parse_batch_lines(table_lines(input_path, columns or {"prompt": "prompt"}, url, body))
    else:
        if columns or url or body:
            raise ConfigError(f"--columns, --url and --body apply to a Parquet, Arrow or datasets input; {input_path} "
                              f"is read as JSONL batch lines, which carry their own")
        try:
            with open(input_path, encoding="utf-8-sig", errors="replace") as handle:  # a BOM (Windows editors) is not JSON
                lines = parse_batch_lines(handle)
        except OSError as error:
            raise ConfigError(f"cannot read the batch input {input_path}: {error.strerror}") from None
    return lines, finished_keys(output_path)


def run_batch_file(llm, input_path: str | Path, output_path: str | Path, *, served_model_name: str,
                   concurrency: int | None = None, progress: bool = True, server_options: dict | None = None,
                   on_result: Callable[[dict], None] | None = None, columns: dict[str, str] | None = None,
                   url: str | None = None, body: dict | None = None) -> BatchSummary:
    """Run every line of ``input_path`` not yet answered in ``output_path`` through ``llm``'s server routes and append
    the results (module docstring). ``concurrency``: requests in flight at once (default: twice the engine's
    ``max_batch_size``). ``server_options``: more ``ServerOptions`` fields (a chat template, a tool-call format).
    A line's body without ``model`` is given ``served_model_name``. ``on_result`` sees each record as it is written.
    ``columns``, ``url``, ``body``: a table input's (``read_batch_input``)."""
    lines, done = read_batch_input(input_path, output_path, columns, url, body)
    concurrency = concurrency or 2 * llm.settings.max_batch_size
    if concurrency < 1:
        raise ConfigError(f"concurrency must be ≥ 1, got {concurrency}")
    summary = BatchSummary(lines=len(lines))
    pending = [line for line in lines if line.key not in done]
    summary.already_done = len(lines) - len(pending)
    began = time.perf_counter()
    writer = ResultWriter(Path(output_path))
    try:
        asyncio.run(_run(llm, pending, writer, summary, served_model_name, concurrency, progress, server_options or {}, on_result))
    finally:
        writer.close()
        summary.seconds = time.perf_counter() - began
    return summary


async def _run(llm, pending: list[BatchLine], writer: ResultWriter, summary: BatchSummary, served_model_name: str,
               concurrency: int, progress: bool, server_options: dict, on_result) -> None:
    from tqdm import tqdm

    # The server's queue holds every request this job has in flight, and never refuses one for waiting.
    options = ServerOptions(served_model_name=served_model_name, max_queued_requests=concurrency,
                            queue_timeout_s=1e9, **server_options)
    app = build_app(llm, options)
    bar = tqdm(total=len(pending), unit="line", disable=not progress, dynamic_ncols=True)
    began = time.perf_counter()

    def finish(line: BatchLine, status: int | None, body: dict | None, error: tuple[str, str] | None) -> None:
        record = result_record(line, status, body, error)
        writer.write(record)
        if status == 200:
            summary.succeeded += 1
            summary.output_tokens += int(((body or {}).get("usage") or {}).get("completion_tokens") or 0)
        else:
            summary.failed += 1
            code = error[0] if error else str(status)
            summary.failures[code] = summary.failures.get(code, 0) + 1
        if on_result is not None:
            on_result(record)
        bar.update(1)
        elapsed = time.perf_counter() - began
        if summary.output_tokens and elapsed > 0:
            bar.set_postfix_str(f"{summary.output_tokens / elapsed:.0f} tok/s", refresh=False)

    requests = []
    for line in pending:
        if line.error is None and TASK_OF_ROUTE[line.url] not in llm.tasks:
            line.error = ("unsupported_url", f"this deployment ({served_model_name}) serves no {line.url}: "
                          f"{unserved_task(llm.tasks, TASK_OF_ROUTE[line.url])}")
        if line.error is not None:
            finish(line, None, None, line.error)
        else:
            requests.append(line)
    try:
        async with app.router.lifespan_context(app):
            await send_lines(app, requests, served_model_name, concurrency,
                             lambda line, status, payload: finish(line, status, payload, None))
    finally:
        bar.close()


