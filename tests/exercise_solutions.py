"""Reference solutions of the course's "implement it yourself" exercises, and wrong attempts a student
might write: tests/test_exercises.py shows stnblab.exercises passes the first and fails each of the others
with a message naming the rank and the element. (They live here, not in the notebooks, so the notebooks do
not give the answers away.)"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(send: torch.Tensor, recv_into: torch.Tensor, right: int, left: int) -> None:
    """Send ``send`` to the rank on the right while receiving the left one's into ``recv_into``."""
    for req in (dist.isend(send.contiguous(), right), dist.irecv(recv_into, left)):
        req.wait()


# ------------------------------------------------------------------------------------ ring all-reduce --

def ring_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Notebook 03's exercise: N - 1 reduce-scatter steps, then N - 1 all-gather steps, each rank talking
    only to its neighbours. Each rank sends 2 (N - 1) chunks of len(t) / N values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = t.tensor_split(world)  # N views of t: lengths differ by at most one
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):  # reduce-scatter: afterwards chunk (rank + 1) % N holds the full sum
        send, recv = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
        buf = torch.empty_like(recv)
        _exchange(send, buf, right, left)
        recv += buf
    for s in range(world - 1):  # all-gather: pass the summed chunks once around the ring
        send, recv = chunks[(rank - s + 1) % world], chunks[(rank - s) % world]
        buf = torch.empty_like(recv)
        _exchange(send, buf, right, left)
        recv.copy_(buf)
    return t


def ring_without_all_gather(t):
    """The reduce-scatter half only: each rank holds one chunk of the sum, the others partial sums."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = t.tensor_split(world)
    for s in range(world - 1):
        send, recv = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
        buf = torch.empty_like(recv)
        _exchange(send, buf, (rank + 1) % world, (rank - 1) % world)
        recv += buf
    return t


def neighbour_swap(t):
    """Send the whole tensor to the right, add the left one's: the sum on 2 ranks, not on 3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    _exchange(t, buf, (rank + 1) % world, (rank - 1) % world)
    t += buf
    return t


def ring_average(t):
    """A correct ring, then divided by N: DDP's average, not the all-reduce's sum."""
    ring_all_reduce(t)
    t /= dist.get_world_size()
    return t


def equal_chunks(t):
    """Assumes the world size divides the length (t.view(N, -1)): raises on 7 elements."""
    rows = t.view(dist.get_world_size(), -1)
    return ring_all_reduce(rows.flatten())


def library_all_reduce(t):
    """Not an implementation: torch's own collective (refused by the checker)."""
    dist.all_reduce(t)
    return t


def returns_a_new_tensor(t):
    """A correct sum returned as a new tensor, ``t`` untouched: accepted (the checker reads the result)."""
    return ring_all_reduce(t.clone())


# ----------------------------------------------------------------------------------------- ZeRO-1 step --

def zero1_step(params, lr):
    """Notebook 09's exercise: average the gradients, step AdamW on this rank's slice of the flattened
    parameters (its state covers that slice only), all-gather the slices and write them back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat_grad = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat_grad)
    flat_grad /= world
    flat = torch.cat([p.detach().flatten() for p in params])
    sizes = [len(c) for c in flat.tensor_split(world)]
    mine = flat.tensor_split(world)[rank].clone().requires_grad_()
    mine.grad = flat_grad.tensor_split(world)[rank].clone()
    opt = torch.optim.AdamW([mine], lr=lr)
    opt.step()
    most = max(sizes)  # all_gather takes equal sizes: pad each slice to the longest, then cut the padding off
    pieces = [torch.empty(most) for _ in sizes]
    dist.all_gather(pieces, torch.cat([mine.detach(), torch.zeros(most - len(mine))]))
    whole = torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])
    with torch.no_grad():
        start = 0
        for p in params:
            p.copy_(whole[start:start + p.numel()].view_as(p))
            start += p.numel()
    return opt


def plain_adamw(params, lr):
    """One device's step: the local gradients, the whole state on every rank."""
    opt = torch.optim.AdamW(params, lr=lr)
    opt.step()
    return opt


def unsharded_adamw(params, lr):
    """Averaged gradients (DDP), then AdamW on everything: right values, state not sharded."""
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return plain_adamw(params, lr)


def zero1_without_all_gather(params, lr):
    """Steps this rank's slice and writes only it back: the other ranks' slices stay as they were."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat_grad = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat_grad)
    flat_grad /= world
    flat = torch.cat([p.detach().flatten() for p in params])
    lo = sum(len(c) for c in flat.tensor_split(world)[:rank])
    mine = flat.tensor_split(world)[rank].clone().requires_grad_()
    mine.grad = flat_grad.tensor_split(world)[rank].clone()
    opt = torch.optim.AdamW([mine], lr=lr)
    opt.step()
    flat[lo:lo + len(mine)] = mine.detach()
    with torch.no_grad():
        start = 0
        for p in params:
            p.copy_(flat[start:start + p.numel()].view_as(p))
            start += p.numel()
    return opt


def zero1_returns_nothing(params, lr):
    """A correct step that forgets to return its optimizer."""
    zero1_step(params, lr)


def receive_only(t):
    """Every rank waits for its left neighbour, and no rank ever sends: it never finishes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.irecv(buf, (rank - 1) % world).wait()
    return t + buf


def fails_on_rank_1(t):
    """Rank 1 raises before it sends anything; rank 0 is left waiting for it."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up")
    return ring_all_reduce(t)


# ---- 00: the element-wise maximum over the ranks

def rank_max(t):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def rank_sum(t):  # wrong: the default operation sums
    dist.all_reduce(t)
    return t


# ---- 01: samples per second from a run's step times

def samples_per_second(step_times, global_batch, warmup):
    measured = step_times[warmup:]
    return global_batch * len(measured) / sum(measured)


def samples_per_second_with_warmup(step_times, global_batch, warmup):  # wrong: the slow first steps counted
    return global_batch * len(step_times) / sum(step_times)


def mean_of_step_rates(step_times, global_batch, warmup):  # wrong: the mean of each step's rate
    rates = [global_batch / t for t in step_times[warmup:]]
    return sum(rates) / len(rates)


# ---- 04: bytes one rank holds at each ZeRO stage

def zero_bytes(n_params, world, stage):
    params, grads, adam = 4 * n_params, 4 * n_params, 8 * n_params
    if stage >= 1:
        adam /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        params /= world
    return params + grads + adam


def zero_bytes_stage2_shards_parameters(n_params, world, stage):  # wrong: stage 2 divides the parameters
    return zero_bytes(n_params, world, 3 if stage == 2 else stage)


def zero_bytes_one_adam_state(n_params, world, stage):  # wrong: AdamW keeps two states, not one
    return zero_bytes(n_params, world, stage) - (4 * n_params / (world if stage >= 1 else 1))


# ---- 05: parity's "overall"

def overall(trained, reference, initial):
    apart = sum(float((trained[n] - reference[n]).norm()) ** 2 for n in reference) ** 0.5
    moved = sum(float((reference[n] - initial[n]).norm()) ** 2 for n in reference) ** 0.5
    return apart / moved


def overall_worst_tensor(trained, reference, initial):  # wrong: the worst tensor's share, not all together
    return max(float((trained[n] - reference[n]).norm()) / float((reference[n] - initial[n]).norm())
               for n in reference)
