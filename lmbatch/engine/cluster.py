"""Workers on a Ray cluster: Ray places each data-parallel worker's tensor-parallel group on one node
(a placement group of one bundle per rank, STRICT_PACK: NCCL stays within a node) with a GPU per
rank where the run is on CUDA, and each rank connects back to this process over TCP with Python's
own `multiprocessing.connection` (authenticated), so the worker speaks the same messages as a local
one (`worker.serve`). Ray sets each rank's CUDA_VISIBLE_DEVICES.

The driver (this process) decides the device, dtype and default sizes as for local workers: run it
on a node like the workers'.
"""
from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

from lmbatch.engine.worker import Hello, serve
from lmbatch.errors import UserError

if TYPE_CHECKING:
    from lmbatch.engine.options import EngineSpec

START_S = 600.0         # a cluster that cannot place or start every rank in this long is an error


def connect(address: str) -> Any:
    """The `ray` module, connected to the cluster at `address` (host:port, or auto)."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray-address needs Ray: pip install 'ray>=2.9'") from None
    if not ray.is_initialized():
        host, _, port = address.rpartition(":")
        if host and port.isdigit():      # Ray's own connect retries for minutes: a closed port is one line now
            try:
                socket.create_connection((host, int(port)), timeout=10).close()
            except OSError as e:
                raise UserError(f"--ray-address {address}: no Ray cluster there ({e.strerror or e})") from None
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise UserError(f"--ray-address {address}: no Ray cluster there ({str(e).splitlines()[0]})") from None
    return ray


def cluster_gpus(address: str) -> int:
    """GPUs the cluster at `address` has in all."""
    return int(connect(address).cluster_resources().get("GPU", 0))


def _rank(k: int, r: int, spec: EngineSpec, where: tuple[str, int], key: bytes, port: int) -> None:
    """One rank, run by Ray: connect to the driver, say who it is, then serve as a local worker."""
    conn = Client(where, authkey=key)
    conn.send(Hello(k, r))
    serve(r, spec, conn, None, port, k)


class RayWorkers:
    def __init__(self, address: str, spec: EngineSpec, n: int):
        ray = self.ray = connect(address)
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove = remove_placement_group
        t, gpu = spec.ranks, 1 if spec.device == "cuda" else 0
        self.gpu = gpu
        key = os.urandom(32)
        self.listener = Listener((ray.util.get_node_ip_address(), 0), authkey=key)
        where = self.listener.address
        bundle = {"CPU": 1, "GPU": gpu} if gpu else {"CPU": 1}
        self.pgs = [placement_group([bundle] * t, strategy="STRICT_PACK") for _ in range(n)]
        remote = ray.remote(_rank)
        self.refs = []
        for k, pg in enumerate(self.pgs):
            port = random.randrange(20000, 60000)      # the group's rendezvous on its node's loopback
            for r in range(t):
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
                self.refs.append(remote.options(num_cpus=1, num_gpus=gpu, scheduling_strategy=strategy,
                                                max_retries=0).remote(k, r, spec, where, key, port))
        try:
            self.groups = self._accept(n, t)
        except BaseException:
            self.close(at_once=True)
            raise

    def _accept(self, n: int, t: int) -> list[list[Connection]]:
        """Every rank's connection, by worker and rank; a rank that fails before it connects raises."""
        got: dict[tuple[int, int], Connection] = {}
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(got) < n * t:
                    c = self.listener.accept()
                    hello = c.recv()
                    got[hello.worker, hello.rank] = c
            except (OSError, EOFError) as e:
                errors.append(e)
        threading.Thread(target=accept, daemon=True, name="lmbatch-ray-accept").start()
        deadline = time.monotonic() + START_S
        while len(got) < n * t:
            done, _ = self.ray.wait(self.refs, timeout=0.2)
            if done:        # a rank ended before connecting: its error
                try:
                    self.ray.get(done[0])
                except Exception as e:  # noqa: BLE001  Ray's wrapper of the rank's exception
                    last = str(e).strip().splitlines()[-1]
                    raise RuntimeError(f"a Ray worker failed as it started: {last}") from None
                raise RuntimeError("a Ray worker ended before it connected")
            if errors or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not start {n * t} worker processes in {START_S:.0f} s "
                                   f"(each needs {'a GPU and ' if self.gpu else ''}a CPU)")
        return [[got[k, r] for r in range(t)] for k in range(n)]

    def close(self, at_once: bool = False) -> None:
        """Let the ranks finish (they have been told to close), or cancel them; free their placement."""
        # only ranks still running are cancelled: a force-cancel of a task that has just ended is a race
        # inside Ray (2.60 aborts the driver on "Tried to complete task that was not pending")
        _, running = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0 if at_once else 10)
        for ref in running:
            self.ray.cancel(ref, force=True)
        for pg in self.pgs:
            self._remove(pg)
        self.listener.close()
        self.ray.shutdown()         # this process's connection to the cluster (the cluster stays)
