"""The training loop: ``train(cfg)`` checks the run, joins the job, builds this rank's parts
(training/build.py) and runs a :class:`Trainer` over them.

Step k's figures are read after step k+1 is launched (training/step.py), so the host never leaves
the GPU idle between steps; a step's time is where its work ran (:class:`StepClock`), its phases
too (training/timers.py), gathered over the ranks at log intervals (training/monitor.py). Around
the steps: the validation loss and checkpoints every N steps (each paused out of the step
watchdog and the next step's timing), the non-finite guard's verdict when a step's figures are
read, the ranks' vote on stopping early (training/preemption.py: a signal or the wall-clock
limit; the step in hand is finished and saved), and after the last step the peak memory per rank
and a sample.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.checkpoint import Checkpointer, check_resume
from tessera.checkpoint.files import is_url
from tessera.checkpoint.store import step_dir
from tessera.config import Config, to_dict
from tessera.data import sample_tokenizer
from tessera.distributed.memory import memory_report
from tessera.inference.generate import Sampling, generate
from tessera.models import GPTModel
from tessera.models.flops import flops_per_token, peak_flops
from tessera.optim import DynamicLossScaler, LRScheduler
from tessera.training.build import Parts, build, build_topology
from tessera.training.cuda_graphs import release_all, step_stream
from tessera.training.data_feed import DataFeed
from tessera.training.evaluate import validation_loss
from tessera.training.energy import EnergyMeter
from tessera.training.launch import init_distributed, pick_device, restart_count, world_from_env
from tessera.training.memory_model import describe as describe_memory
from tessera.training.memory_model import predict_ranks
from tessera.training.metrics import CHECKPOINT_LOCK_NAME, JsonlLogger, NullLogger, lock_out_dir
from tessera.training.monitor import Monitor
from tessera.training.plan import make_plan
from tessera.training.preemption import StopRequest, Vote, job_started
from tessera.training.preflight import check_runnable
from tessera.training.rerun import LaunchedStep, NumericsGuard
from tessera.training.step import StepClock, StepResult, train_step
from tessera.training.timers import PhaseTimer, StepPhases
from tessera.training.watchdog import StepWatchdog


def due(done: int, every: int, steps: int) -> bool:
    """Whether work done every ``every`` steps (0: never) and after the last is due after step ``done``."""
    return every > 0 and (done % every == 0 or done == steps)


@dataclass
class InFlight:
    """A launched step whose figures are not read yet, with what its metrics line needs."""

    launched: LaunchedStep
    lr: float
    weight_decay: float
    loss_scale: float | None  # the scale the step ran with (fp16)
    result: StepResult
    processed: int  # tokens the model processed: global batch x seq_len
    phases: StepPhases | None = None  # its timers' spans, read with its figures
    vote: Vote | None = None  # the ranks' vote on stopping, read with its figures


class Trainer:
    """Runs ``parts`` for ``cfg.train.steps`` steps (from a checkpoint's step where the run resumes).
    ``logger`` writes the metrics (a NullLogger on ranks that do not log); ``world`` ranks share
    the FLOPs per GPU. ``stop``: asks for an early stop (signals, the wall-clock limit); ``clock``:
    the host clock steps and phases are timed by off CUDA (tests give a stand-in)."""

    def __init__(self, cfg: Config, parts: Parts, logger, *, logs: bool, world: int,
                 stop: StopRequest | None = None, clock=time.perf_counter):
        t, topo = cfg.train, parts.topo
        self.cfg, self.parts, self.logger, self.logs, self.world = cfg, parts, logger, logs, world
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = topo.device
        self.stop = stop or StopRequest(t.exit_after_minutes * 60)
        self.host_clock = clock
        self.timer = PhaseTimer(self.device, clock)
        # the log interval's gathers go over gloo (host numbers: never a wait for a GPU)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=t.timeout_s)) \
            if world > 1 and self.device.type == "cuda" else None
        self.monitor = Monitor(rank=self.rank, world=world, pp=topo.pp, pp_rank=topo.pp_rank, log_every=t.log_every,
                               steps=t.steps, straggler_every=t.straggler_every, straggler_margin=t.straggler_margin,
                               energy=EnergyMeter.for_device(self.device), group=group)
        self.scheduler = LRScheduler(cfg.optim, t.steps)
        self.scaler = DynamicLossScaler() if t.dtype == "fp16" else None
        self.data = DataFeed(cfg, topo)
        self.valid = DataFeed(cfg, topo, split=1) if t.eval_every else None
        self.guard = NumericsGuard(t, self.device, self.rank,
                                   fp16=self.scaler is not None, knows_loss=topo.is_last_stage,
                                   checkpoints=bool(cfg.checkpoint.dir))
        self.checkpointer = Checkpointer(cfg, topo, parts.chunks, parts.data_parallel, parts.optimizer, parts.rng,
                                         logger.print)
        self.flops_per_token = flops_per_token(cfg.model)
        cuda = self.device.type == "cuda"
        self.peak = peak_flops(torch.cuda.get_device_name(self.device)) if cuda else None
        self.clock: StepClock | None = None  # started by run(), after the resume
        self.history: list[dict] = []
        self.validated: dict[int, float] = {}  # step -> its validation loss, until its line is logged
        self.saved_at: int | None = None  # the step of this run's last checkpoint

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        """Train; the metrics logged on this rank (empty where it does not log)."""
        t = self.cfg.train
        start = self.resume()
        self.clock = StepClock(self.device, clock=self.host_clock)
        pending: InFlight | None = None
        stopped_at = None  # the step the ranks agreed to stop after, before train.steps
        if start < t.steps and self.stop.agree_now(self.device):  # (asked while the run was being built)
            stopped_at = start
        last = t.steps if stopped_at is None else start
        with self.checkpointer.finishing(), StepWatchdog(t.timeout_s) as watchdog:
            for step in range(start, last):
                watchdog.tick()  # a step that hangs ends the job with every thread's stack
                try:
                    launched = self.launch(step)
                except BaseException:
                    if pending is not None:  # the last good step's line, if its figures can be read
                        with contextlib.suppress(Exception):
                            self.log(pending, check=False)
                    raise
                if pending is not None:
                    self.log(pending)
                pending = launched
                if due(step + 1, t.eval_every, t.steps):
                    with watchdog.paused():
                        self.evaluate(step)
                    self.clock.restart(after=launched.result)  # (the next step's time is its own)
                if self.cfg.checkpoint.dir and (due(step + 1, self.cfg.checkpoint.save_every, t.steps)
                                                or step + 1 == t.steps):
                    self.log(pending)  # (read first: a non-finite step stops the run before it is saved)
                    pending = None
                    with watchdog.paused():  # (a large model's save may rightly take minutes)
                        self.save(step + 1)
                    self.clock.restart(after=launched.result)
                if self.stop.agreed and step + 1 < t.steps:  # every rank read the same votes: all stop here
                    stopped_at = step + 1
                    break
            watchdog.tick()
            if pending is not None:
                self.log(pending)
            if stopped_at is not None and self.cfg.checkpoint.dir and self.saved_at != stopped_at \
                    and stopped_at > start:
                with watchdog.paused():
                    self.save(stopped_at)
        self.checkpointer.wait()  # a background save's last write (not under the step watchdog)
        self.logger.print_last()
        if stopped_at is not None:
            self.say_stopped(start, stopped_at)
        self.finish(sample=stopped_at is None)
        return self.history

    def save(self, done: int) -> None:
        self.checkpointer.save(done, self.scheduler, self.data, self.scaler, self.guard)
        self.saved_at = done

    def say_stopped(self, start: int, done: int) -> None:
        """The line an early stop ends with: where it stopped, why, and what was kept."""
        steps = self.cfg.train.steps
        where = f"after step {done} of {steps}" if done > start else f"before step {start + 1} of {steps}"
        if not self.cfg.checkpoint.dir:
            kept = "checkpoint.dir is not set, so nothing was saved"
        elif done == start:
            kept = "no step was taken: nothing new to save"
        else:
            kept = f"saved {step_dir(self.cfg.checkpoint.dir, done)}; the same command resumes from it"
        self.logger.print(f"tessera: stopped {where} ({self.stop.reason()}): {kept}")

    def launch(self, step: int) -> InFlight:
        """Queue step ``step``'s work and the ranks' vote on stopping after it; both are read later
        (:meth:`log`)."""
        p, t = self.parts, self.cfg.train
        if t.inject_fault == "kill" and step + 1 == t.inject_fault_step and self.rank == self.world - 1 \
                and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # (train.inject_fault=kill: a machine lost, once)
        lr = self.scheduler.apply(p.optimizer, step)
        scale = self.scaler.scale if self.scaler is not None else None
        batches = self.data.batches
        first = batches.consumed_samples
        processed = batches.global_batch(first) * self.cfg.model.seq_len
        with self.timer.span("data"):
            micro_batches = self.data.next()
        launched = LaunchedStep(step, micro_batches, p.rng.get_states() if p.rng is not None else None,
                                (first, batches.consumed_samples))
        self.guard.launching(step)
        result = self.step(micro_batches, self.timer)
        return InFlight(launched, lr, self.scheduler.weight_decay(step), scale, result, processed,
                        self.timer.take(), self.stop.vote(self.device))

    def step(self, micro_batches: list[dict], timer: PhaseTimer | None = None) -> StepResult:
        p = self.parts
        return train_step(p.optimizer, micro_batches, p.topo, p.executor(len(micro_batches)), p.data_parallel,
                          clip_grad=self.cfg.optim.clip_grad, scaler=self.scaler, guard=self.guard, timer=timer)

    def rerun(self, launched: LaunchedStep) -> StepResult:
        """Step ``launched`` again on its batch and random streams (training/rerun.py: the weights
        are still the ones it ran on)."""
        if launched.rng_states is not None:
            self.parts.rng.set_states(launched.rng_states)
        self.guard.launching(launched.step, rerunning=True)
        return self.step(launched.micro_batches)

    def log(self, step: InFlight, check: bool = True) -> None:
        """Read ``step``'s figures (waits for its GPU work), its phase timers and its stop vote,
        and log its metrics; then the guard's verdict on a non-finite step (it may stop the run).
        Throughput and FLOPs count every token the model processed, as Megatron's do; ``tokens``
        is what the loss averaged over. ``check`` false: another error ends the run, so nothing
        that waits for the other ranks (the re-run, the monitor's gathers)."""
        result, done = step.result, step.launched.step
        tokens = result.tokens
        elapsed = self.clock.lap(result)
        if check:
            self.stop.read(step.vote)
        phases = step.phases.seconds() if step.phases is not None else {}
        metrics = {"step": done + 1, "loss": result.loss, "grad_norm": result.grad_norm, "lr": step.lr,
                   "weight_decay": step.weight_decay, "tokens_per_s": step.processed / elapsed, "tokens": tokens,
                   "step_time_s": elapsed, **self.speed(step.processed, elapsed), "skipped": result.skipped}
        if self.scaler is not None:
            metrics["loss_scale"] = step.loss_scale
        if done in self.validated:
            loss = self.validated.pop(done)
            metrics.update(valid_loss=loss, valid_ppl=math.exp(loss) if loss < 700 else float("inf"))
        metrics.update(self.monitor.step_done(done + 1, phases, step.processed, gather=check))
        self.logger.log(metrics)
        for line in self.monitor.take_lines():  # (timers and stragglers, after the step's own line)
            self.logger.print(line)
        if self.logs:
            self.history.append(metrics)
        if check:  # (not while another error ends the run: the re-run's collectives would wait for ranks that left)
            self.guard.check(step.launched, result, self.rerun, self.logger.print)

    def speed(self, tokens: int, elapsed: float) -> dict:
        """Model TFLOP/s per GPU (models/flops.py), MFU where the card's peak is known, and this
        rank's peak memory."""
        flops = self.flops_per_token * tokens / elapsed / self.world
        out = {"tflops_per_gpu": flops / 1e12}
        if self.peak:
            out["mfu"] = flops / self.peak
        if self.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def evaluate(self, step: int) -> None:
        """The validation loss after ``step``, logged with that step's line."""
        p = self.parts
        p.data_parallel.wait_param_gather()  # (zero 1/2: the updated parameters)
        loss = validation_loss(p.chunks, p.topo, self.valid, self.cfg.train.eval_batches, p.p2p)
        if loss is not None:
            self.validated[step] = loss

    # -- before and after -------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint the run starts from, if any (checked by preflight already); the
        step to go on from."""
        cfg = self.cfg
        resume = check_resume(cfg)
        if resume is None:
            return 0
        began = time.perf_counter()
        start, streams = self.checkpointer.load(resume["path"], self.scheduler, self.data, self.scaler,
                                                resume["weights_only"], self.guard)
        saved_at = " ".join(f"{k}={v}" for k, v in resume["layout"].items())
        took = f"{time.perf_counter() - began:.1f} s"
        if resume["weights_only"]:
            self.logger.print(f"tessera: starting from the weights of {resume['path']} (saved at {saved_at}; "
                              f"checkpoint.finetune: Adam, step, data and schedules afresh) in {took}")
            return start
        self.logger.print(f"tessera: resumed from {resume['path']} at step {start} in {took} (saved at {saved_at}; "
                          f"random streams {'restored' if streams else 'seeded anew: another layout or no dropout streams'}"
                          f"{'; the schedule of this run, checkpoint.new_schedule' if cfg.checkpoint.new_schedule else ''})")
        saved = resume["config"].get("data", {})
        changed = [f"data.{k}: {saved[k]!r} -> {getattr(cfg.data, k)!r}" for k in ("source", "paths")
                   if k in saved and saved[k] != getattr(cfg.data, k)]
        if changed:  # (allowed: a deliberate switch of data mid-run)
            self.logger.print(f"tessera: the data differs from the checkpoint's ({'; '.join(changed)}): training goes "
                              f"on with the new data from the checkpoint's position in it")
        if start == cfg.train.steps:
            self.logger.print(f"tessera: the checkpoint is at train.steps = {start}: nothing to train "
                              "(raise train.steps to train on)")
        return start

    def finish(self, sample: bool = True) -> None:
        """After the loop: every rank's peak memory (the metrics carry the logging rank's only;
        a pipeline's first stage holds the most), and the sample (not after an early stop)."""
        p, t = self.parts, self.cfg.train
        p.data_parallel.wait_param_gather()
        if self.device.type == "cuda" and self.world > 1:
            peaks = [None] * self.world
            dist.all_gather_object(peaks, round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2))
            self.logger.print(f"peak memory per rank (GiB): {peaks}")
        if t.sample_tokens and sample:
            tokenizer = sample_tokenizer(t.sample_tokenizer, self.cfg.data, self.cfg.model.vocab_size, t.sample_prompt)
            (ids,) = generate(list(p.model), [tokenizer.encode(t.sample_prompt)], t.sample_tokens, topo=p.topo,
                              p2p=p.p2p, sampling=Sampling(temperature=0.8, top_k=40, seed=t.seed))
            self.logger.print("sample: " + tokenizer.decode(ids))


def describe(cfg: Config, parts: Parts, logs: bool) -> str:
    """The run's first line: the model, the layout and the execution plan."""
    whole = 0
    if logs:
        with torch.device("meta"):  # the whole model's count (no memory: meta tensors)
            whole = sum(p.numel() for p in GPTModel(cfg.model).parameters())
    here = sum(p.numel() for p in parts.model.parameters())
    return (f"tessera: {cfg.model.family} with {whole:,} parameters, {here:,} on this rank, {parts.topo!r}, "
            f"zero={cfg.parallel.zero}, device {parts.topo.device}, {cfg.train.dtype}, {parts.plan.describe(cfg)}")


def train(cfg: Config, stop: StopRequest | None = None, clock=time.perf_counter) -> list[dict]:
    """Run ``cfg`` under the current launch (torchrun or a single process). Returns the metrics
    logged on this rank (empty on ranks that do not log). ``stop``: where early stops are asked
    for (the CLI's, whose handlers are on SIGTERM and SIGUSR1 from the process's start); without
    one, this call puts its own there. ``clock``: see :class:`Trainer`."""
    own = stop is None
    stop = stop or StopRequest(started=job_started())
    stop.limit_s = cfg.train.exit_after_minutes * 60
    main_thread = threading.current_thread() is threading.main_thread()
    with stop.install() if own and main_thread else contextlib.nullcontext():
        return _train(cfg, stop, clock)


def _train(cfg: Config, stop: StopRequest, clock) -> list[dict]:
    rank, local_rank, world = world_from_env()
    check_runnable(cfg, world)
    device = pick_device(cfg.train.device, local_rank)
    init_distributed(device, cfg.train.timeout_s)
    t = cfg.train
    topo = build_topology(cfg, device)
    logs = topo.is_last_stage and topo.tp_rank == 0 and topo.cp_rank == 0 and topo.dp_rank == 0
    with contextlib.ExitStack() as stack:
        # rank 0 holds checkpoint.dir (it renames checkpoints into place), the logging rank out_dir
        if cfg.checkpoint.dir and rank == 0 and not is_url(cfg.checkpoint.dir):  # (an object store has no flock)
            stack.enter_context(lock_out_dir(cfg.checkpoint.dir, "checkpoint.dir", CHECKPOINT_LOCK_NAME))
        logger = JsonlLogger(t.out_dir, t.log_every, config=to_dict(cfg), tensorboard=t.tensorboard) \
            if logs else NullLogger()  # (takes out_dir's lock)
        stack.callback(logger.close)
        parts = build(cfg, topo, make_plan(cfg, device, topo.tp))  # (the rank's own stage tp)
        logger.print(describe(cfg, parts, logs))
        logger.print(str(memory_report(parts.data_parallel, parts.optimizer)))
        logger.print(describe_memory(predict_ranks(cfg, parts.plan, device.type)))
        parts.model.train()
        # graphed layers are captured after data parallelism placed the parameters in their
        # buffers, on the stream the steps then run on
        with step_stream(device) if parts.plan.graphed else contextlib.nullcontext():
            graphs = parts.capture_graphs()
            try:
                return Trainer(cfg, parts, logger, logs=logs, world=world, stop=stop, clock=clock).run()
            finally:  # a graph holding NCCL work would hang destroy_process_group
                release_all(graphs)


__all__ = ["train", "Trainer", "describe"]
