"""The processes of a deployment over several ranks, one process each: spawned by ``autodeploy()`` on one
machine, or launched by ``torchrun`` (on one machine or several).

- **Spawned**: ``autodeploy(model, tensor_parallel=2)`` in a plain process. :func:`spawn_workers` starts
  ranks 1 … N−1 as Python processes that build the same deployment, and the caller's process becomes rank 0.
  Its ``LLM`` is the only front end: every engine step, every whole-prompt forward and every engine
  (re)build is first sent to the workers (:class:`Workers`, the engine's ``peers``), which run the same
  thing over their own slices, so the collectives pair up. A worker that dies or stops answering turns
  the next (or the running) step into a ``WorkerError`` naming it; ``LLM.shutdown()``, the ``LLM``'s garbage
  collection and interpreter exit stop them all. The process group is the process's one (torch.distributed
  has one default group a process, and the collective ops read it), so a process drives one spawned
  deployment at a time: :func:`check_no_live_deployment` refuses a second until the first is shut down;
  one-process deployments serve beside it.
- **torchrun**: ``autodeploy(model, tensor_parallel=N)`` in each of ``torchrun --nproc-per-node N``'s
  processes; :func:`init_distributed` joins them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK
  picks the GPU), and the processes call ``generate`` alike (the same script). Deployments laid out alike
  share the launcher's group; one laid out otherwise waits until those are shut down.

Either way every rank builds, verifies and serves the same deployment over its own slices, and the logits
after the last collective are the same bits on every rank, so every rank samples the same tokens.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
import torch.distributed as dist

from autodeploy.custom_ops import parallel_state
from autodeploy.custom_ops.parallel_state import Layout
from autodeploy.errors import ConfigError, InvalidRequestError, WorkerError, error_summary

logger = logging.getLogger(__name__)

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def world_size(settings) -> int:
    """The processes ``settings.distributed`` asks for: ``pipeline_parallel`` stages of
    ``max(tensor_parallel, expert_parallel)`` ranks."""
    return Layout.requested(settings.distributed).world_size


def _deployment(settings) -> str:
    """The model and its parallelism, as errors name a deployment."""
    return f"{settings.model} with {_parallelism(settings)}"


def _parallelism(settings) -> str:
    distributed = settings.distributed
    return (f"tensor_parallel={distributed.tensor_parallel}, expert_parallel={distributed.expert_parallel}, "
            f"pipeline_parallel={distributed.pipeline_parallel}")


def check_parallelism(settings, hf_config) -> None:
    """A ``ConfigError`` naming the constraint when the model cannot be cut the way ``settings.distributed``
    asks, before any process starts (the shard transforms check the graph again)."""
    distributed = settings.distributed
    tensor, experts_parallel, stages = (int(distributed[name]) for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel"))
    config = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if tensor > 1 and heads is not None:
        if heads % tensor:
            raise ConfigError(f"tensor_parallel={tensor} must divide the attention heads ({heads}); choose a divisor of {heads}")
        if kv_heads % tensor and tensor % kv_heads:
            raise ConfigError(f"tensor_parallel={tensor} and the key-value heads ({kv_heads}): one must divide the other "
                              f"(more ranks than KV heads replicate them); choose a tensor_parallel that does")
    experts = next((getattr(config, name) for name in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(getattr(config, name, None), int)), None)
    if experts_parallel > 1:
        if not experts:
            raise ConfigError(f"expert_parallel={experts_parallel} but {type(config).__name__} has no MoE experts; "
                              f"use tensor_parallel or pipeline_parallel for a dense model")
        if experts % experts_parallel:
            raise ConfigError(f"expert_parallel={experts_parallel} must divide the experts ({experts}); choose a divisor")
    layers = getattr(config, "num_hidden_layers", None)
    if stages > 1 and layers is not None and layers % stages:
        raise ConfigError(f"pipeline_parallel={stages} must divide the layers ({layers}); choose a divisor of {layers}")
    world = world_size(settings)
    if world > 1 and str(settings.device).startswith("cuda") and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local > torch.cuda.device_count():
            raise ConfigError(f"{_parallelism(settings)} runs {local} ranks on this machine but {torch.cuda.device_count()} "
                              f"GPUs are visible (one rank a GPU); lower the parallelism or make more GPUs visible")


def init_distributed(settings, store: dist.Store | None = None) -> None:
    """Join (or check) the process group that ``settings.distributed`` asks for and record this rank's place
    in it (``parallel_state``); on a GPU, point ``settings.device`` at this rank's (LOCAL_RANK). A
    ``ConfigError`` when the processes do not match. ``store``: rank 0's, when it spawned its workers."""
    world = world_size(settings)
    if world == 1:
        return
    if store is not None:
        cuda = str(settings.device).startswith("cuda")
        if cuda:
            settings.device = "cuda:0"
            torch.cuda.set_device(0)
        # The workers join through torchrun's variables (env://), whose keys torch keeps under "default_pg".
        dist.init_process_group(_backend(settings), store=dist.PrefixStore("default_pg", store), rank=0, world_size=world,
                                timeout=timedelta(seconds=float(settings.distributed.timeout_s)))
        atexit.register(_leave)
    elif not dist.is_initialized():
        missing = [name for name in _TORCHRUN if name not in os.environ]
        if missing:
            raise ConfigError(
                f"{_parallelism(settings)} runs {world} processes, one per rank, and RANK is set but not the other "
                f"launcher variables (missing {', '.join(missing)}): launch with `torchrun --nproc-per-node {world} "
                f"your_script.py`, or unset RANK and let autodeploy() start the ranks")
        started = int(os.environ["WORLD_SIZE"])
        if started != world:
            raise ConfigError(f"{_parallelism(settings)} needs {world} processes but torchrun started {started} "
                              f"(WORLD_SIZE); start {world}, or change the parallelism to multiply to {started}")
        cuda = str(settings.device).startswith("cuda")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            if local >= torch.cuda.device_count():
                raise ConfigError(f"rank {os.environ['RANK']} needs GPU {local}, but {torch.cuda.device_count()} "
                                  f"are visible; start at most that many processes a machine")
            settings.device = f"cuda:{local}"
            torch.cuda.set_device(local)
        dist.init_process_group(_backend(settings), timeout=timedelta(seconds=float(settings.distributed.timeout_s)))
        atexit.register(_leave)
    if dist.get_world_size() != world:
        raise ConfigError(f"{_parallelism(settings)} needs {world} ranks but the process group has "
                          f"{dist.get_world_size()}; they must match")
    distributed = settings.distributed
    parallel_state.configure(int(distributed.tensor_parallel), int(distributed.expert_parallel),
                             int(distributed.pipeline_parallel))


def _backend(settings) -> str:
    backend = settings.distributed.backend
    if backend == "auto":
        return "nccl" if str(settings.device).startswith("cuda") else "gloo"
    return backend


def _leave() -> None:
    # The group this module joined, left at interpreter exit (PyTorch warns about a group left open).
    if dist.is_initialized():
        dist.destroy_process_group()
    parallel_state.reset()


# ---- spawned workers ---------------------------------------------------------------------------------
_ADDRESS, _KEY = "AUTODEPLOY_WORKER_ADDRESS", "AUTODEPLOY_WORKER_KEY"
# A worker builds its rank as rank 0 did, with autodeploy(); named here as text and handed to worker_main,
# so this module, which autodeploy() imports, imports nothing above it.
_WORKER_PROGRAM = "from autodeploy.api import autodeploy; from autodeploy.distributed import worker_main; worker_main(autodeploy)"
_STOP_WAIT_S = 10.0  # how long a stopped worker may take to leave before it is killed


_live: Workers | None = None  # the spawned deployment whose process group this process holds
_launched: weakref.WeakSet = weakref.WeakSet()  # the LLMs over torchrun's ranks, built on parallel_state's layout


def hold(llm, workers: Workers | None) -> None:
    """Record ``llm``, a deployment over several ranks: a spawned one's workers stop, and its group is left,
    when it is garbage-collected; a torchrun one keeps the layout while it serves."""
    if workers is not None:
        weakref.finalize(llm, workers.stop)
    else:
        _launched.add(llm)


def check_no_live_deployment(settings) -> None:
    """A ``ConfigError``, before any process starts, when ``settings`` ask for several ranks and a deployment
    of this process holds them: a spawned one's workers wait for its commands, so new ranks' collectives would
    hang; under torchrun, a live deployment laid out otherwise would read the new layout and compute wrong."""
    if world_size(settings) == 1 or (_live is None and not _launched):
        return
    gc.collect()  # an LLM dropped inside a reference cycle leaves only when the cycle is collected
    if _live is not None:
        raise ConfigError(
            f"this process already drives a deployment of {_live.deployment} over several ranks, and a process holds "
            f"one at a time (its process group is the process's): call shutdown() on that deployment's LLM "
            f"(`llm.shutdown()`) before deploying another over several ranks, or deploy this one in another process "
            f"(one-process deployments work beside it)")
    wanted = Layout.requested(settings.distributed)
    other = next((llm for llm in _launched
                  if not llm.is_shut_down and Layout.requested(llm.settings.distributed) != wanted), None)
    if other is not None:
        raise ConfigError(
            f"these processes serve a deployment of {_deployment(other.settings)}, and the collective ops read the "
            f"process's layout, which {_parallelism(settings)} would change under it: call shutdown() on that "
            f"deployment's LLM (`llm.shutdown()`) first, or launch this one with torchrun of its own (deployments "
            f"laid out alike, and one-process ones, work beside it)")


def should_spawn(settings) -> bool:
    """Whether this plain process (no torchrun, no process group) must start the other ranks itself."""
    return world_size(settings) > 1 and not dist.is_initialized() and "RANK" not in os.environ


def spawn_workers(settings, model, config, set_arguments, overrides) -> tuple[Workers, dist.Store]:
    """Start ranks 1 … N−1 (each ``autodeploy(model, …)`` with this call's arguments, under torchrun's
    variables) and return them with the store rank 0 joins the process group through."""
    world = world_size(settings)
    timeout = timedelta(seconds=float(settings.distributed.timeout_s))
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    key = os.urandom(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    processes = []
    for rank in range(1, world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               _ADDRESS: f"{listener.address[0]}:{listener.address[1]}", _KEY: key.hex()}
        processes.append(subprocess.Popen(
            [sys.executable, "-c", _WORKER_PROGRAM],
            env=env, stdout=subprocess.DEVNULL))
    global _live
    workers = _live = Workers(processes, float(settings.distributed.timeout_s), _deployment(settings))
    try:
        workers.connect(listener, (model, config, list(set_arguments), overrides))
    except BaseException:
        workers.stop()
        raise
    finally:
        listener.close()
    logger.info("started %d worker processes (ranks 1 … %d)", world - 1, world - 1)
    return workers, store


class Workers:
    """Rank 0's handle on the worker processes it spawned: the ``peers`` of its engine (``runtime/engine.py``).

    Each call sends one command to every worker over its connection; the workers run them in order. A
    worker that exited, or a collective that failed or timed out, marks the deployment failed with a
    ``WorkerError`` naming the rank; the other workers are then stopped (they would wait in collectives)."""

    def __init__(self, processes: list[subprocess.Popen], timeout_s: float, deployment: str):
        self.processes = processes
        self.timeout_s = timeout_s
        self.deployment = deployment  # the model and its parallelism, as errors name it
        self.connections: list[Connection] = []
        self.messages: dict[int, str] = {}  # rank → the error a worker reported before it exited
        self._failed: WorkerError | None = None
        self._stopped = False
        atexit.register(self.stop)

    # ---- commands --------------------------------------------------------------------------------
    def step(self, commands: list[tuple]) -> None:
        self._send(("step", commands))

    def prompt_logits(self, token_ids: list[int]) -> None:
        self._send(("logits", token_ids))

    def build_engine(self) -> None:
        self._send(("engine", None))

    def free_engine(self) -> None:
        self._send(("free", None))

    def _send(self, message: tuple) -> None:
        if self._stopped:
            raise InvalidRequestError("this LLM was shut down (LLM.shutdown); deploy the model again to generate")
        if self._failed is None and self._dead():
            self._fail(self._dead())
        if self._failed is not None:
            raise self._failed
        try:
            for connection in self.connections:
                connection.send(message)
        except OSError as error:
            raise self.failure(error) from error

    # ---- start, failure, stop ------------------------------------------------------------------------
    def connect(self, listener: Listener, arguments: tuple) -> None:
        """Accept every worker's connection (in rank order) and send it the deployment's arguments."""
        accepted: dict[int, Connection] = {}

        def accept() -> None:
            with suppress(OSError):
                for _ in self.processes:
                    connection = listener.accept()
                    accepted[connection.recv()] = connection

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                raise self._fail(dead) if dead else self._give_up(
                    f"the worker processes did not start within distributed.timeout_s={self.timeout_s:g} s")
        self.connections = [accepted[rank] for rank in range(1, len(self.processes) + 1)]
        for connection in self.connections:
            connection.send(arguments)

    def wait_ready(self) -> None:
        """Wait until every worker has built its deployment (rank 0 has built its own)."""
        deadline = time.monotonic() + self.timeout_s
        for rank, connection in enumerate(self.connections, start=1):
            while not connection.poll(0.1):
                dead = self._dead()
                if dead or time.monotonic() > deadline:
                    raise self._fail(dead) if dead else self._give_up(
                        f"worker rank {rank} did not finish building within distributed.timeout_s={self.timeout_s:g} s")
            kind, text = connection.recv()
            if kind == "error":
                self.messages[rank] = text
                raise self._fail([(rank, self.processes[rank - 1].wait())])

    def failure(self, error: BaseException) -> BaseException:
        """The error a failed collective or send stands for: the worker that died (its exit may show a moment
        after the collective failed), or a collective that timed out; otherwise ``error`` itself."""
        if self._failed is not None:
            return self._failed
        if _communication_error(error):  # a peer's exit may take a moment to show
            deadline = time.monotonic() + 5.0
            while not self._dead() and time.monotonic() < deadline:
                time.sleep(0.05)
        dead = self._dead()
        if dead:
            return self._fail(dead)
        if "timed out" in str(error).lower() or "timeout" in str(error).lower():
            return self._give_up(f"a collective waited more than distributed.timeout_s={self.timeout_s:g} s for the other "
                                 f"ranks ({error_summary(error, 200)}): a worker is stuck")
        return error

    def _dead(self) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of each worker that has exited."""
        return [(rank, code) for rank, process in enumerate(self.processes, start=1)
                if (code := process.poll()) is not None]

    def _fail(self, dead: list[tuple[int, int]]) -> WorkerError:
        for rank, connection in enumerate(self.connections, start=1):  # what a worker said before it exited
            with suppress(OSError, EOFError):
                while rank not in self.messages and connection.poll():
                    kind, text = connection.recv()
                    if kind == "error":
                        self.messages[rank] = text
        said = "".join(f" ({self.messages[rank]})" for rank, _ in dead if rank in self.messages)
        exits = ", ".join(f"worker rank {rank} " + (f"was killed by signal {-code}" if code < 0 else f"exited with code {code}")
                          for rank, code in dead)
        return self._give_up(f"{exits}{said}")

    def _give_up(self, what: str) -> WorkerError:
        """Mark the deployment failed and stop the workers still running (they would wait in collectives)."""
        self._failed = WorkerError(f"{what}; the deployment cannot serve any more: shut it down (llm.shutdown()) "
                                   f"and deploy it again")
        self._terminate()
        return self._failed

    def stop(self) -> None:
        """Tell the workers to leave, wait for them (killing any that do not leave), and leave the group."""
        global _live
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        for connection in self.connections:
            with suppress(OSError):
                connection.send(("stop", None))
        deadline = time.monotonic() + _STOP_WAIT_S
        for process in self.processes:
            with suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        self._terminate()
        for connection in self.connections:
            connection.close()
        _leave()
        if _live is self:
            _live = None

    def _terminate(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _communication_error(error: BaseException) -> bool:
    """Whether ``error`` came from the process group or a worker connection (not from rank 0's own work)."""
    text = str(error).lower()
    return (isinstance(error, (dist.DistError, OSError, EOFError))
            or any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout")))


def worker_main(build: Callable[..., Any]) -> None:
    """A spawned worker: connect to rank 0, ``build`` the deployment it names (``autodeploy``'s arguments),
    then run its commands until it says stop or goes away."""
    host, port = os.environ.pop(_ADDRESS).rsplit(":", 1)
    connection = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop(_KEY)))
    connection.send(int(os.environ["RANK"]))
    model, config, set_arguments, overrides = connection.recv()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    try:
        llm = build(model, config=config, set_arguments=set_arguments, **overrides)
        connection.send(("ready", None))
        _serve(llm, connection)
    except BaseException as error:
        with suppress(OSError):
            connection.send(("error", f"{type(error).__name__}: {error_summary(error)}"))
        logger.exception("worker rank %s failed", os.environ["RANK"])
        raise SystemExit(1) from None
    finally:
        _leave()


def _serve(llm, connection: Connection) -> None:
    while True:
        try:
            kind, payload = connection.recv()
        except EOFError:  # rank 0 is gone
            return
        if kind == "stop":
            return
        if kind == "step":
            llm.engine.apply_commands(payload)
            llm.engine.step()
        elif kind == "logits":
            llm.engine.prompt_logits(payload)
        elif kind == "engine":
            llm.engine  # noqa: B018  (built with rank 0's, whose warm-up forward runs the same collectives)
        elif kind == "free":
            llm.free_kv_cache()
