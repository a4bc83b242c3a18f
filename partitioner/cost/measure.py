"""Measuring this machine's CPU as one rank computes on it: matmul FLOP/s, copy bandwidth,
physical memory, and gloo between two processes on 127.0.0.1 (`measure_cpu`: the fields
that `hardware.load_hardware("cpu")` builds its profile from and caches).

The links follow the alpha-beta model (Hockney 1994): a message of n bytes takes
alpha + n * beta, both fitted by least squares to a two-process gloo ping-pong
(`_measure_gloo`); when that fails (no fork, no loopback, a timeout) the old estimates are
kept and `sources` says so.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch

__all__ = ["RANK_THREADS", "measure_cpu", "rank_threads"]

# The intra-op threads a rank computes on: `partitioner run` sets OMP_NUM_THREADS=1 for its
# ranks (runtime/launch.py), as torchrun does whenever it starts more than one process.
RANK_THREADS = 1


@contextlib.contextmanager
def rank_threads() -> Iterator[None]:
    """torch on `RANK_THREADS` intra-op threads for the duration: what the compile measures
    (the cpu profile, node costs, stage calibration) is then what a rank will run.  Timed
    on all of the machine's threads, a matmul is several times faster than a rank computes
    it; and bound to one core, as a stage is calibrated, several threads take turns on it
    at a hundredfold cost."""
    threads = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_cpu() -> dict[str, Any]:
    """The fields of a `Hardware` profile of this CPU, measured now."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    flops = 10 * 2 * n**3 / (time.perf_counter() - start)
    big = torch.empty(8 << 20)  # 32 MiB
    dst = torch.empty_like(big)
    dst.copy_(big)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(big)
    bandwidth = 5 * 2 * big.numel() * 4 / (time.perf_counter() - start)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = _measure_gloo()
    send_post = recv_post = 0.0
    if link is None:
        # gloo over loopback TCP: typical latency and bandwidth on a small VM
        p2p_alpha, p2p_bw, ar_alpha, ar_bw = _DEFAULT_ALPHA_S, _DEFAULT_BANDWIDTH, 0.0, 0.0
        note = (f"gloo loopback latency/bandwidth: fallback estimate ({_DEFAULT_ALPHA_S * 1e6:g} us, "
                f"{_DEFAULT_BANDWIDTH / 1e9:g} GB/s): the two-process measurement failed")
    else:
        (p2p_alpha, p2p_beta), (ar_alpha, ar_beta) = link.late, link.allreduce
        ar_alpha, ar_bw = float(f"{max(ar_alpha, 1e-6):.3g}"), float(f"{1 / ar_beta:.3g}")
        note = (f"measured: gloo between 2 processes on 127.0.0.1, {_SIZES[0] >> 10} KiB..."
                f"{_SIZES[-1] >> 20} MiB, alpha + n * beta by least squares on relative error: "
                f"p2p as the runtime posts it (receive after send) {p2p_alpha * 1e6:.3g} us + n / "
                f"{1e-9 / p2p_beta:.3g} GB/s (classic ping-pong {link.eager[0] * 1e6:.3g} us + n / "
                f"{1e-9 / link.eager[1]:.3g} GB/s); 2-rank all-reduce {ar_alpha * 1e6:.3g} us + n / "
                f"{ar_bw / 1e9:.3g} GB/s")
        if link.loaded is not None:
            # the pipeline's messages are paid as they are under load (see _loaded_exchange)
            send_post, recv_post, wait = link.loaded
            p2p_alpha = max(wait - _LOADED_BYTES * p2p_beta, 0.0)
            send_post, recv_post = float(f"{send_post:.3g}"), float(f"{recv_post:.3g}")
            note += (f"; under a 2-rank 1F1B exchange with {_LOADED_BURST_S * 1e3:g} ms of compute between "
                     f"messages: posting a send {send_post * 1e6:.3g} us, a receive {recv_post * 1e6:.3g} us, "
                     f"the message once both are posted {wait * 1e6:.3g} us (means, stalls included): the "
                     f"pipeline link's alpha")
        # a fit whose latency clamped to 0 (below the timer's reach) keeps a 1 us floor
        p2p_alpha, p2p_bw = float(f"{max(p2p_alpha, 1e-6):.3g}"), float(f"{1 / p2p_beta:.3g}")
    return dict(
        name="cpu",
        description=f"this machine's CPU ({os.cpu_count()} cores), measured",
        peak_flops=float(f"{flops:.3g}"),
        peak_flops_fp32=float(f"{flops:.3g}"),
        memory_bandwidth=float(f"{bandwidth:.3g}"),
        memory_bytes=int(memory),
        intra_node_bandwidth=p2p_bw,
        intra_node_latency_s=p2p_alpha,
        allreduce_latency_s=ar_alpha,
        allreduce_bandwidth=ar_bw,
        overlaps_comm=False,
        p2p_send_post_s=send_post,
        p2p_recv_post_s=recv_post,
        efficiency=1.0,
        sources=("measured: 512x512 float32 matmul, 32 MiB copy, sysconf physical pages", note),
    )


# -- gloo links: two processes on 127.0.0.1 ------------------------------------------------

_DEFAULT_ALPHA_S = 50e-6
_DEFAULT_BANDWIDTH = 2e9
_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # bytes per message
_REPEATS = (40, 24, 10, 6, 4)  # timed samples per size and pattern, after one warm-up
_POST_LATE_S = 0.5e-3  # a late receiver posts this long after its peer posted the send
_TIMEOUT_S = 10.0  # the whole measurement; each wait has its own smaller timeout


_LOADED_BYTES = 4 << 10  # one message of the loaded exchange
_LOADED_BURST_S = 0.5e-3  # compute between its messages, about an example stage's
_LOADED_STEPS = (3, 150)  # warm-up and timed steps of 4 microbatches (~1.5 s)


@dataclass(frozen=True)
class _Links:
    """Least-squares (alpha s, beta s/byte) of three patterns between two gloo processes,
    and the means of a loaded exchange."""

    eager: tuple[float, float]  # classic ping-pong: the receive is posted before the send
    late: tuple[float, float]  # the runtime's pattern: the receive is posted after the send
    allreduce: tuple[float, float]  # 2-rank all-reduce of an n-byte float32 buffer
    loaded: tuple[float, float, float] | None = None  # send post, receive post, message (s)


def _measure_gloo(timeout_s: float = _TIMEOUT_S) -> _Links | None:
    """Alpha and beta of gloo between this process (rank 0) and a forked child (rank 1),
    or None when anything fails (no fork, no loopback, a timeout).

    The child is forked (not spawned: importing torch again takes seconds) before this
    process starts any gloo thread, and is killed at the deadline, so nothing can hang.
    Three patterns, each timed per size on rank 0 (`_typical`: a mean without the slowest
    twentieth, since a step pays the sum of its messages, tails included):

    - eager: a classic ping-pong, the receive posted before the send (one-way = round
      trip / 2);
    - late: as `DistributedPipeline` exchanges values: the sender posts its send at once,
      the receiver posts its receive only when its schedule reaches it, after the send
      was announced.  Gloo's TCP transport then rendezvouses (the receiver tells the
      sender it is ready, the sender's I/O thread writes the data), about one more round
      trip than the eager case, with the wake-ups of two waiting processes.  Timed from
      posting the receive to its completion;
    - allreduce: a 2-rank all-reduce.

    Each fit is t = alpha + n * beta by least squares on relative error, so the small
    messages fix alpha and the big ones beta.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = None
    try:
        child = ctx.Process(target=_gloo_peer, args=(theirs, timeout_s), daemon=True)
        child.start()
        theirs.close()
        deadline = time.monotonic() + timeout_s
        store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=timeout_s),
                                           wait_for_workers=False)
        mine.send(store.port)
        timings = _gloo_rank(store, 0, timeout_s)
        if not mine.poll(max(0.1, deadline - time.monotonic())) or mine.recv() != "ok":
            return None
        eager, late, allreduce = (_fit(_SIZES, timings[k]) for k in ("eager", "late", "allreduce"))
        if eager is None or late is None or allreduce is None:
            return None
        loaded = timings["loaded"]
        return _Links(eager, late, allreduce, (loaded[0], loaded[1], loaded[2]) if len(loaded) == 3 else None)
    except Exception:
        return None
    finally:
        mine.close()
        if child is not None:
            child.join(1.0)
            if child.is_alive():
                child.kill()
                child.join(1.0)


def _gloo_peer(conn: Any, timeout_s: float) -> None:
    """Rank 1, in the forked child: the other half of every pattern."""
    try:
        torch.set_num_threads(RANK_THREADS)
        if not conn.poll(timeout_s):
            return
        store = torch.distributed.TCPStore("127.0.0.1", conn.recv(), 2, False, timedelta(seconds=timeout_s))
        _gloo_rank(store, 1, timeout_s)
        conn.send("ok")
    except Exception:
        try:
            conn.send("failed")
        except Exception:
            pass


def _gloo_rank(store: Any, rank: int, timeout_s: float) -> dict[str, list[float]]:
    """Both ranks run this; rank 0's timings are the result: seconds per size for each
    pattern."""
    from runtime.affinity import bound_as_local_rank

    with bound_as_local_rank(rank, 2):  # on a core of its own, as the runtime's ranks are
        return _gloo_patterns(store, rank, timeout_s)


def _gloo_patterns(store: Any, rank: int, timeout_s: float) -> dict[str, list[float]]:
    pg_cls: Any = torch.distributed.ProcessGroupGloo  # (its type stubs lack send, recv...)
    opts = pg_cls._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [pg_cls.create_device(hostname="127.0.0.1")]
    pg = pg_cls(store, rank, 2, opts)
    wait = timedelta(seconds=timeout_s)
    peer = 1 - rank
    out: dict[str, list[float]] = {"eager": [], "late": [], "allreduce": []}
    for size, repeats in zip(_SIZES, _REPEATS):
        buf = torch.zeros(size, dtype=torch.uint8)
        samples = []
        for i in range(repeats + 1):  # the first round trip warms up the connection
            start = time.perf_counter()
            if rank == 0:
                pg.send([buf], peer, 0).wait(wait)
                pg.recv([buf], peer, 0).wait(wait)
            else:
                pg.recv([buf], peer, 0).wait(wait)
                pg.send([buf], peer, 0).wait(wait)
            if i:
                samples.append((time.perf_counter() - start) / 2)
        out["eager"].append(_typical(samples))
        samples = []
        for i in range(2 * (repeats + 1)):  # rounds alternate: rank 0 receives in the odd ones
            if i % 2 == rank:  # post the send at once and wait for it
                pg.send([buf], peer, 1).wait(wait)
            else:  # post the receive late, after the send was announced
                time.sleep(_POST_LATE_S)
                start = time.perf_counter()
                pg.recv([buf], peer, 1).wait(wait)
                if i > 1:
                    samples.append(time.perf_counter() - start)
        out["late"].append(_typical(samples))
        flat = torch.zeros(size // 4, dtype=torch.float32)
        samples = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            pg.allreduce([flat]).wait(wait)
            if i:
                samples.append(time.perf_counter() - start)
        out["allreduce"].append(_typical(samples))
    out["loaded"] = _loaded_exchange(pg, store, rank, wait)
    pg.barrier().wait(wait)
    return out


def _loaded_exchange(pg: Any, store: Any, rank: int, wait: timedelta) -> list[float]:
    """Rank 0: the mean seconds of posting a send, posting a receive, and a message from the
    moment both sides have posted it to its arrival, in a 2-stage 1F1B schedule lowered as
    the runtime lowers it, with `_LOADED_BURST_S` of a small MLP's forward and backward for
    every forward and backward (so both cores compute while the messages move); rank 1: [].

    [Note: messages on a busy CPU]
        The simulator charges each message the MEAN cost measured here, stalls included,
        not the typical (median) one: a step pays every stall on its critical path.  The
        exchange computes bursts of autograd over small ops between posts, as stages do,
        since posts cost more after those than after one big matmul.  The measurements
        behind this: docs/notes/messages-on-cpu.md ("As the simulator sees it").

    Events are wall-clock (time.time_ns, one clock for both processes of this machine);
    rank 1 hands its events to rank 0 through the store."""
    with rank_threads():
        return _exchange(pg, store, rank, wait)


def _exchange(pg: Any, store: Any, rank: int, wait: timedelta) -> list[float]:
    from runtime.schedule import StageGraph, lower, make_schedule

    peer = 1 - rank
    plan = lower(make_schedule("1f1b", 2, 4), StageGraph.chain(2))[rank]
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(12)))
    x = torch.randn(16, 64)

    def compute() -> None:  # what a stage runs: many small ops, autograd, allocations
        net(x).sum().backward()

    compute()
    start = time.perf_counter()
    for _ in range(20):
        compute()
    burst = max(1, round(_LOADED_BURST_S / ((time.perf_counter() - start) / 20)))
    payload = torch.zeros(_LOADED_BYTES, dtype=torch.uint8)
    warmup, timed = _LOADED_STEPS
    events: list[tuple[Any, ...]] = []  # (step, kind, stage, microbatch, peer, start, posted, done), times in ns
    for step in range(warmup + timed):
        pg.barrier().wait(wait)
        sends = []
        for act in plan:
            begin = time.time_ns()
            if act.kind in ("F", "B"):
                for _ in range(burst):
                    compute()
                continue
            tag = 2 * act.microbatch + act.kind.endswith("_B")
            if act.kind.startswith("SEND"):
                sends.append(pg.send([payload], peer, tag))
                posted = done = time.time_ns()
            else:
                work = pg.recv([torch.empty_like(payload)], peer, tag)
                posted = time.time_ns()
                work.wait(wait)
                done = time.time_ns()
            if step >= warmup:
                events.append((step, act.kind.value, act.stage, act.microbatch, act.peer, begin, posted, done))
        for work in sends:
            work.wait(wait)
    if rank == 1:
        store.set("loaded-exchange", json.dumps(events))
        return []
    both = [tuple(e) for e in json.loads(store.get("loaded-exchange"))] + events
    send_posted = {(step, kind[-1], stage, mb, peer): posted for step, kind, stage, mb, peer, _, posted, _ in both
                   if kind.startswith("SEND")}
    send_posts, receives, messages = [], [], []
    for step, kind, stage, mb, peer, begin, posted, done in both:
        if kind.startswith("SEND"):
            send_posts.append((posted - begin) / 1e9)
            continue
        receives.append((posted - begin) / 1e9)
        sent = send_posted[(step, kind[-1], peer, mb, stage)]  # 1RECV_F2<0 receives what 0SEND_F2>1 sent
        messages.append(max(0.0, (done - max(posted, sent)) / 1e9))
    return [statistics.fmean(send_posts), statistics.fmean(receives), statistics.fmean(messages)]


def _typical(samples: list[float]) -> float:
    """The mean without the slowest twentieth: a step pays the sum of its messages, so
    frequent slow ones (a busy machine's wake-ups) count, as they do in a step; a rare
    stall that no step meets twice does not."""
    ordered = sorted(samples)
    return statistics.fmean(ordered[:len(ordered) - len(ordered) // 20])


def _fit(sizes: tuple[int, ...], seconds: list[float]) -> tuple[float, float] | None:
    """(alpha, beta) minimising sum(((alpha + n beta) - t) / t)^2: weighted least squares
    with weights 1/t^2, the closed form of the 2x2 normal equations.  None when the fit
    is not physical (beta <= 0); a negative alpha (latency below the timer's reach) is
    clamped to zero and beta refitted through the origin."""
    w = [1.0 / (t * t) for t in seconds]
    sw = sum(w)
    sx = sum(wi * n for wi, n in zip(w, sizes))
    sy = sum(wi * t for wi, t in zip(w, seconds))
    sxx = sum(wi * n * n for wi, n in zip(w, sizes))
    sxy = sum(wi * n * t for wi, n, t in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    if det <= 0:
        return None
    beta = (sw * sxy - sx * sy) / det
    alpha = (sy - beta * sx) / sw
    if alpha < 0:
        alpha, beta = 0.0, sxy / sxx
    return (alpha, beta) if beta > 0 else None