"""A real multi-process PyTorch job instrumented with trainhealth: a tiny GPT trained with DDP.

Every rank runs this file (``torchrun`` starts them); each creates its own
:class:`trainhealth.Monitor` and reports its sections, loss, grad norm, learning rate, tokens,
checkpoints and restores. CPU only (backend gloo), so it runs anywhere; the model is a
2-layer byte-level GPT (vocab 256) learning a short built-in text, which it quickly can.

Run it (three terminals, or ``&``)::

    trainhealth serve                                   # starts or reuses the embedded Redis
    export TRAINHEALTH_REDIS_URL=$(trainhealth redis url)   # optional on the same machine (found anyway)
    torchrun --standalone --nproc_per_node 4 examples/torchrun_gpt.py --run-id gpt-demo --steps 400 \\
        --slow-rank 2 --slow-ms 40 --spike-step 150 --crash-step 260 --ckpt-every 50 --ckpt-dir /tmp/gpt-ckpt
    trainhealth dashboard                               # open http://127.0.0.1:8501/?run=gpt-demo

For the crash to be followed by a relaunch, add ``--max-restarts 1`` to torchrun (before
the script name): torchrun restarts all ranks, which resume from the newest checkpoint in
``--ckpt-dir``, and the service reports a ``restart`` and the recomputed steps. The crash
happens only in the first launch (``TORCHELASTIC_RESTART_COUNT == 0``).

(``--run-id``, not ``--run``: torchrun's parser reads ``--run`` as its own ``--run-path`` and
stops. ``--run`` works when the file is started another way.)

Faults you can inject, and what trainhealth should say:

- ``--slow-rank R --slow-ms MS``: rank R sleeps MS ms inside its forward section on every
  step, like a slower GPU or a throttled host → ``straggler`` on rank R and its host.
- ``--spike-step S``: the learning rate is multiplied by 50 for ``--spike-steps`` steps
  from step S, a real optimisation blow-up → ``loss_spike`` at about step S.
- ``--crash-step S``: every rank exits abruptly (``os._exit``) right after step S, as when a
  node fails → with ``--max-restarts``, ``restart`` with ``resume_step`` = checkpoint + 1.
- ``--leak-rank R``: rank R keeps ``--leak-kib`` KiB of tensors more after every step (a cache that only grows, up
  to ``--leak-max-mib``) → ``memory_growth`` on rank R (host memory on CPU). The run's detector settings judge the
  trend on 30 s instead of 10 min (``trainhealth.tuning``), and the ranks send a heartbeat (with a memory sample)
  every second.
- ``--slow-comm-node N``: the ranks of node N (``--ranks-per-node`` ranks each: torchrun's nodes, or nodes simulated
  on one machine, named ``<host>-node<N>``) spend ``--slow-comm-ms`` more in the gradient all-reduce for steps
  ``[--slow-comm-from, --slow-comm-to)``, as behind a slow link. The all-reduce is then done after backward
  (DDP's overlap is switched off with ``no_sync``) in two stages, as a hierarchical all-reduce: within each node,
  timed as the ``allreduce`` section, then across nodes, untimed (every rank waits there for node N) →
  ``network_slow`` on node N, no straggler; the job's steps are slower too (a throughput drop).
- ``--plateau-from S``: from step S the parameters stop being updated (as when every layer is frozen by mistake),
  with the learning rate held at its peak after warm-up (a constant schedule) → ``plateau`` (settings: a stretch of
  half the steps after S, judged against a 5 % gain: the frozen model's loss still moves with each batch).
- ``--min-step-ms MS``: every step lasts at least MS ms (the rank waits out the rest in its optimizer section, on
  every rank alike), as a real model's step would: a fault judged over time (``--leak-rank``) then has the same
  seconds to show on a fast machine as on a slow one.

Sections are the work a rank does on its own, never waiting for another rank: ``data`` and
``forward`` before the gradient all-reduce, ``optimizer`` after it. Backward is deliberately
not a section: DDP all-reduces gradient buckets while backward runs, so every rank's backward
includes waiting for the slowest rank, and timing it would make all ranks look equally busy
(the straggler detector compares the sum of a rank's sections).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# Run from a source checkout without installing: make the repository importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainhealth import Monitor, defaults
from trainhealth.collectors.integrations.torch import grad_norm_value

log = logging.getLogger("torchrun_gpt")

TEXT = (
    b"In synchronous data-parallel training every rank waits at the all-reduce for the slowest "
    b"one, so a single slow host sets the pace of the whole job. Throughput counts every token "
    b"processed; goodput counts only the tokens of steps the model keeps. A crash throws away "
    b"the steps since the last checkpoint, and they must be computed again after the restart. "
    b"A loss spike wastes the steps until the loss recovers, or the run must be rolled back. "
)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level GPT. No buffers (the causal mask comes from ``is_causal``), so DDP's forward
    starts no collective of its own and a rank's forward time is its own compute."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def get_batch(data: torch.Tensor, step: int, rank: int, batch_size: int, seq_len: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the text for (step, rank): deterministic, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([data[s: s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1: s + 1 + seq_len] for s in starts.tolist()])
    return x, y


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay to 10 % (held at the peak with ``--plateau-from``: a constant schedule, so
    the flat loss is not the schedule's end); ×50 during the injected spike."""
    if step < args.warmup:
        lr = args.lr * (step + 1) / args.warmup
    elif args.plateau_from >= 0:
        lr = args.lr
    else:
        frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
    if args.spike_step >= 0 and args.spike_step <= step < args.spike_step + args.spike_steps:
        lr *= 50.0
    return lr




def detector_settings(args: argparse.Namespace) -> dict[str, dict[str, float]] | None:
    """The run's own detector settings (``trainhealth.tuning``) for the faults injected; None without any."""
    out: dict[str, dict[str, float]] = {}
    if args.leak_rank >= 0:
        from trainhealth.collectors.memory import MemorySampler

        host = MemorySampler(0).sample()["host_total"] or 64 * 2**30
        out["memory_growth"] = {"window_s": 120.0, "min_span_s": 30.0, "min_samples": 20, "bucket_s": 2.0,
                                "min_growth_frac": min(1.0, max(1e-4, 48 * 2**20 / host))}  # opens at 48 MiB
    if args.plateau_from >= 0:
        stretch = max(20, (args.steps - args.plateau_from) // 2)
        # A frozen model's loss still moves with each batch (a few %): judged against a 5 % gain, not 1 %.
        out["plateau"] = {"min_steps": stretch, "min_points": min(100, max(9, stretch // 2)),
                          "run_fraction": min(1.0, stretch / max(1, args.steps)), "min_gain": 0.05}
    return out or None


def newest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest ``ckpt-<step>.pt`` in ``ckpt_dir``, or None."""
    found = [(int(m.group(1)), p) for p in ckpt_dir.glob("ckpt-*.pt") if (m := re.fullmatch(r"ckpt-(\d+)\.pt", p.name))]
    return max(found) if found else None


def init_process_group() -> None:
    """Gloo process group over torchrun's store, with keys per launch attempt.

    torchrun (torch 2.13) keeps one key-value store across ``--max-restarts`` relaunches and
    the default group's keys carry no attempt number, so relaunched ranks can read the dead
    ranks' gloo addresses and fail with "connection refused". A per-attempt prefix avoids it.
    """
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank,
                            world_size=world)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # torchrun's own parser takes "--run" for an abbreviation of its --run-path and stops: hence --run-id.
    p.add_argument("--run-id", "--run", dest="run", default="torchrun-gpt", help="trainhealth run id (all ranks)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="max global grad norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-rank", type=int, default=-1, help="rank that sleeps in its forward section")
    p.add_argument("--slow-ms", type=float, default=0.0, help="milliseconds it sleeps per step")
    p.add_argument("--spike-step", type=int, default=-1, help="first step of a x50 learning-rate burst")
    p.add_argument("--spike-steps", type=int, default=3, help="steps the burst lasts")
    p.add_argument("--crash-step", type=int, default=-1, help="all ranks exit abruptly after this step (first launch)")
    p.add_argument("--leak-rank", type=int, default=-1, help="rank whose host memory grows every step")
    p.add_argument("--leak-kib", type=int, default=256, help="KiB it keeps per step")
    p.add_argument("--leak-max-mib", type=int, default=384, help="bound of the leak (MiB per process)")
    p.add_argument("--slow-comm-node", type=int, default=-1, help="node whose all-reduce is slow")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks per node for --slow-comm-node (default: torchrun's LOCAL_WORLD_SIZE; fewer simulates "
                        "nodes on one machine)")
    p.add_argument("--slow-comm-ms", type=float, default=30.0, help="milliseconds the slow node adds per step")
    p.add_argument("--slow-comm-from", type=int, default=0, help="first step of the slow all-reduce")
    p.add_argument("--slow-comm-to", type=int, default=10**9, help="first step after it")
    p.add_argument("--min-step-ms", type=float, default=0.0,
                   help="every step lasts at least this long (milliseconds; 0: as fast as it runs)")
    p.add_argument("--plateau-from", type=int, default=-1, help="step from which the parameters stop being updated")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="checkpoints (and resume) directory")
    p.add_argument("--ckpt-every", type=int, default=50, help="save after every N steps (0: never)")
    p.add_argument("--log-every", type=int, default=20, help="rank 0 prints every N steps")
    p.add_argument("--print-timing", action="store_true",
                   help="rank 0 prints a machine-readable 'RESULT loop_s=...' line at the end (for bench/)")
    p.add_argument("--no-monitor", action="store_true",
                   help="run without trainhealth (the baseline of bench/example_overhead.py)")
    return p.parse_args(argv)


class NullMonitor:
    """The Monitor's API doing nothing: the example without trainhealth, for the overhead benchmark."""

    def step(self, step: int) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    section = checkpoint_save = checkpoint_load = step

    def log_step(self, *args: object, **kwargs: object) -> None:
        pass

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> bool:
        return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # ranks share the CPU cores: one thread each avoids oversubscription
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank}: %(message)s")
    first_launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    # One Monitor per rank; rank and world size come from torchrun's RANK / WORLD_SIZE, Redis
    # from TRAINHEALTH_REDIS_URL (else the embedded server of `trainhealth serve`).
    per_node = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = rank // per_node
    simulated = per_node < int(os.environ.get("LOCAL_WORLD_SIZE", world))  # several "nodes" on this machine
    mon = NullMonitor() if args.no_monitor else Monitor(
        args.run, run_config={k: str(v) for k, v in vars(args).items()}, detector_settings=detector_settings(args),
        host=f"{socket.gethostname()}-node{node}" if simulated else None,
        heartbeat_interval=1.0 if args.leak_rank >= 0 else defaults.HEARTBEAT_INTERVAL_S)
    explicit_allreduce = args.slow_comm_node >= 0
    # Every rank creates every node's group (torch.distributed requires it), in the same order.
    node_groups = [dist.new_group(list(range(n * per_node, min((n + 1) * per_node, world))))
                   for n in range(-(-world // per_node))] if explicit_allreduce else []
    kept: list[torch.Tensor] = []  # --leak-rank: what a cache that never evicts keeps

    torch.manual_seed(args.seed)
    model = TinyGPT(256, args.seq_len, args.d_model, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = torch.tensor(list(TEXT), dtype=torch.long)

    start = 0
    found = newest_checkpoint(args.ckpt_dir) if args.ckpt_dir else None
    if found is not None:
        ckpt_step, path = found
        with mon.checkpoint_load(ckpt_step):  # every rank reads it: restore time is badput on all of them
            state = torch.load(path, map_location="cpu")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        start = ckpt_step + 1
        if rank == 0:
            log.info("resumed from %s (step %d)", path, ckpt_step)
    ddp = DDP(model)  # broadcasts rank 0's parameters: all ranks start identical

    tokens_per_rank = args.batch_size * args.seq_len
    t_log, tokens_since = time.perf_counter(), 0
    dist.barrier()
    t_loop = time.perf_counter()
    for step in range(start, args.steps):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        t_step = time.perf_counter()
        with mon.step(step):
            with mon.section("data"):
                x, y = get_batch(data, step, rank, args.batch_size, args.seq_len, args.seed)
            with ddp.no_sync() if explicit_allreduce else contextlib.nullcontext():
                with mon.section("forward"):
                    if rank == args.slow_rank:
                        time.sleep(args.slow_ms / 1000.0)  # a slower device: more own work before the all-reduce
                    loss = ddp(x, y)
                opt.zero_grad(set_to_none=True)
                if explicit_allreduce:
                    with mon.section("backward"):  # no all-reduce in it: the rank's own work
                        loss.backward()
                else:
                    # Not a section: DDP's all-reduce overlaps backward, so this includes waiting for the slowest rank.
                    loss.backward()
            if explicit_allreduce:
                # A hierarchical all-reduce, as NCCL does across nodes: first within the node (its own links), timed
                # as the collective; a slow link there makes only this node's ranks spend longer in it.
                with mon.section("allreduce"):
                    if node == args.slow_comm_node and args.slow_comm_from <= step < args.slow_comm_to:
                        time.sleep(args.slow_comm_ms / 1000.0)  # a slow link: this node's transfers take longer
                    for prm in model.parameters():
                        if prm.grad is not None:
                            dist.all_reduce(prm.grad, group=node_groups[node])
                # Then across nodes, untimed (as DDP's bucketed all-reduce inside backward): every rank waits here for
                # the slowest node. Each node's sum arrives once per rank of the node: divide by both.
                for prm in model.parameters():
                    if prm.grad is not None:
                        dist.all_reduce(prm.grad)
                        prm.grad.div_(world * per_node)
            with mon.section("optimizer"):
                # Gradients are all-reduced by now: the norm is global and the same on every rank.
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                if args.plateau_from < 0 or step < args.plateau_from:
                    opt.step()  # from --plateau-from on, nothing is updated: a frozen model
                if args.min_step_ms > 0:  # the rest of a step of --min-step-ms: own work, on every rank alike
                    time.sleep(max(0.0, t_step + args.min_step_ms / 1000.0 - time.perf_counter()))
            if rank == args.leak_rank and len(kept) * args.leak_kib < args.leak_max_mib * 1024:
                kept.append(torch.full((args.leak_kib * 256,), float(step)))  # float32: leak_kib KiB, written
        # .item() after the optimizer step: one sync at the end of the step (on a GPU it waits for the queue).
        mon.log_step(step, loss=loss.item(), grad_norm=grad_norm_value(grad_norm), lr=lr, tokens=tokens_per_rank,
                     samples=args.batch_size, consumed_samples=(step + 1) * args.batch_size * world)
        tokens_since += tokens_per_rank * world
        if rank == 0 and (step + 1) % args.log_every == 0:
            now = time.perf_counter()
            log.info("step %d loss %.3f grad_norm %.2f lr %.2e %.0f tokens/s (global batch %d tokens)", step,
                     loss.item(), grad_norm_value(grad_norm), lr, tokens_since / (now - t_log), tokens_per_rank * world)
            t_log, tokens_since = now, 0

        if first_launch and step == args.crash_step:
            mon.flush(2.0)  # what a real node failure would not do; keeps the demo's records complete
            log.warning("injected crash after step %d", step)
            os._exit(17)

        if args.ckpt_dir and args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0:
            with mon.checkpoint_save(step):  # blocks every rank until rank 0 has written it
                if rank == 0:
                    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                    path = args.ckpt_dir / f"ckpt-{step:08d}.pt"
                    tmp = path.with_suffix(".tmp")
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                    os.replace(tmp, path)  # atomic: a crash mid-save leaves the previous checkpoint newest
                dist.barrier()

    dist.barrier()
    loop_s = time.perf_counter() - t_loop
    mon.close()
    if rank == 0 and args.print_timing:
        sender = getattr(mon, "_sender", None)
        print(f"RESULT loop_s={loop_s:.6f} steps={args.steps - start} "
              f"sender_cpu_s={sender.cpu_s - (sender.cpu_startup_s or 0.0) if sender else 0.0:.6f} "
              f"records={sender.sent if sender else 0}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
