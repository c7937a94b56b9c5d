"""A step with a known timeline for stnb.timesplit.StepTimer, in one process: a real torch model whose forward,
backward, data loading, optimizer and DDP buckets each take a known number of *simulated* seconds (the clock is
this module's: every mark reads it, the stand-in work advances it). tests/test_timesplit_values.py checks the
split against the timeline; tests/test_predict_values.py predicts from runs made of such steps."""

from types import SimpleNamespace

import torch

from stnb.timesplit import HostClock, StepTimer

FETCH, FORWARD, CLIP, OPT_STEP, REST = 0.05, 0.2, 0.02, 0.03, 0.01  # simulated seconds of the stand-in work
GRAD_STEP = 0.1  # backward: each of head, layer 1, layer 0, embeddings takes this long, in that order
TAIL = 0.15      # backward after its compute: the last bucket's all-reduce, exposed
BUCKET = 1000    # float32 elements per bucket


class SimClock(HostClock):
    """Simulated seconds: a mark reads ``now``, the stand-in work moves it on."""

    method = "simulated clock"
    pace = 1.0  # how many times longer than its stand-in seconds the work takes (a first step's is slower)

    def __init__(self):
        self.now = 0.0

    def mark(self, host=None):
        return self.now

    def advance(self, seconds):
        self.now += seconds * self.pace


class DeviceSimClock:
    """SimClock's readings as a device clock (not the host's, like CUDA events): what a GPU run's split sees."""

    method = "simulated device clock"
    pace = 1.0
    mark, advance, done, settle = SimClock.mark, SimClock.advance, HostClock.done, HostClock.settle
    seconds = HostClock.seconds

    def __init__(self):
        self.now = 0.0


class Takes(torch.autograd.Function):
    """Identity whose backward runs ``work`` (advancing the clock) before the gradients flow on."""

    @staticmethod
    def forward(ctx, x, work):
        ctx.work = work
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.work()
        return grad, None


class Net(torch.nn.Module):
    """embeddings -> 2 layers -> head; each block's backward takes GRAD_STEP simulated seconds, then its
    gradients accumulate (the order DDP's buckets fill); ``during`` runs hooks at a block's backward."""

    def __init__(self, clock):
        super().__init__()
        self.clock, self.during = clock, {}
        self.embeddings = torch.nn.Linear(3, 4)
        self.encoder = torch.nn.Module()
        self.encoder.layer = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.head = torch.nn.Linear(4, 1, bias=False)

    def _block(self, name, h):
        def work():
            self.clock.advance(GRAD_STEP)
            self.during.get(name, lambda: None)()
        return Takes.apply(h, work)

    def forward(self, x):
        self.clock.advance(FORWARD)
        h = self._block("embeddings", self.embeddings(x))
        for i, layer in enumerate(self.encoder.layer):
            h = self._block(f"layer {i}", layer(h))
        return self._block("other", self.head(h))


class Bucket:  # what DDP hands a communication hook, reduced to what ``timed`` reads
    def __init__(self, numel=BUCKET, dtype=torch.float32):
        self.tensor = torch.zeros(numel, dtype=dtype)

    def buffer(self):
        return self.tensor


def pending(state, bucket):
    """A communication hook whose all-reduce completes when the test says (``fut.set_result``)."""
    fut = torch.futures.Future()
    state.append((fut, bucket))
    return fut


def trainer_for(model, backward_tail=lambda: None):
    """What StepTimer.attach reads of a trainer: the module that trains, its wrapper, the accelerator's backward
    and the batch fetch (taking FETCH simulated seconds)."""
    def fetch(*args, **kw):
        model.clock.advance(FETCH)
        return [], None

    def backward(loss, **kw):
        loss.backward()
        backward_tail()

    return SimpleNamespace(model=model, model_wrapped=model, accelerator=SimpleNamespace(backward=backward),
                           get_batch_samples=fetch)


def attached(model, backward_tail=lambda: None):
    """A timer on the model's simulated clock, attached (no DDP hook) to a trainer of the model: (timer, trainer)."""
    timer = StepTimer(clock=model.clock, enabled=True)
    tr = trainer_for(model, backward_tail)
    timer.attach(tr, ("none", None))
    return timer, tr


def one_step(timer, tr, model, calls=2):
    """A training step: fetch the batches, ``calls`` forwards (like a cached loss: the first ones without
    gradients, the last one backpropagated), backward, clipping, optimizer.step, the rest."""
    tr.get_batch_samples()
    with torch.no_grad():
        for _ in range(calls - 1):
            model(torch.ones(2, 3))
    loss = model(torch.ones(2, 3)).sum()
    tr.accelerator.backward(loss)
    model.clock.advance(CLIP)
    timer.on_pre_optimizer_step()
    model.clock.advance(OPT_STEP)
    timer.on_optimizer_step()
    model.clock.advance(REST)
    timer.on_step_end(model.clock.now)


def ddp_timer(clock, hook_name="none"):
    """A timer attached as for DDP: bucket A handed over once layer 1's gradients are in (done once layer 0's
    are), bucket B, the last, once backward's compute ended; B's all-reduce takes TAIL after it."""
    model = Net(clock)
    state = []

    def tail():
        hook(state, Bucket())  # the last bucket: backward compute ends here
        clock.advance(TAIL)
        state[-1][0].set_result(state[-1][1].buffer())

    model.during = {"layer 1": lambda: hook(state, Bucket()),
                    "layer 0": lambda: state[-1][0].set_result(state[-1][1].buffer())}
    timer, tr = attached(model, tail)
    hook = timer.timed(pending)  # the closures above call it once a step runs
    timer.hook, timer.comm = hook_name, "DDP bucket hooks"  # what attach sets for a DDP-wrapped model
    return timer, tr, model


def ddp_rank_summary(steps, calls=2, hook_name="none", between=0.0, slow_first=0, pace=1.0):
    """One rank's ``time_split`` (StepTimer.summary) of ``steps`` simulated DDP steps, ``between`` seconds
    (logging, evaluation) before each step after the first; the first ``slow_first`` steps' work takes ``pace``
    times as long (a real run's warm-up: allocations, caches, the first collectives)."""
    clock = SimClock()
    timer, tr, model = ddp_timer(clock, hook_name)
    timer.on_step_begin(clock.now)
    for i in range(steps):
        clock.advance(between if i else 0.0)
        clock.pace = pace if i < slow_first else 1.0
        one_step(timer, tr, model, calls=calls)
    clock.pace = 1.0
    return timer.summary()
