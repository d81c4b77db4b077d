"""Worker of the two-process training tests, run as
``torchrun --nproc_per_node=2 -m tests.ddp_worker OUT WRAP NORM``: each rank trains STEPS steps
of the small pre-LN transformer with cupyln.torch's norms (NORM: ``layer`` or ``rms``) on its
half of the batch, under DistributedDataParallel or FSDP2's ``fully_shard`` (WRAP: ``ddp`` or
``fsdp``); NCCL, one GPU a rank, where CUDA has a GPU for every rank, else gloo on the CPU
(there the norms take torch's own ops: a check of this harness only). Rank 0 saves to OUT the
losses averaged over the ranks, the gradients of the last step and the parameters after it (whole
tensors), and the device that each rank's norms ran on."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cupyln.torch as clt
from cupyln.bench_frameworks import gpt_block

STEPS = 3
NORMS = {"layer": (clt.LayerNorm, torch.nn.LayerNorm), "rms": (clt.RMSNorm, torch.nn.RMSNorm)}


def batch(device):
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(8, 64, 128, device=device, generator=g)
    return x, x[..., :8].sum(-1)


def train(model, x, target, steps: int = STEPS, reduce=None):
    """(losses, last gradients, parameters after): SGD steps on (x, target); ``reduce`` turns
    a rank's loss into the batch's."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        losses.append(float(reduce(loss.detach()) if reduce else loss.detach()))
        grads = {k: whole(p.grad) for k, p in model.named_parameters()}
        opt.step()
    return losses, grads, {k: whole(p.detach()) for k, p in model.named_parameters()}


def whole(t):
    """A parameter or gradient as one CPU tensor (FSDP2 holds shards: DTensors)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def main(out: str, wrap: str, norm: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    torch.manual_seed(0)
    model = gpt_block(NORMS[norm][0]).to(device)
    ran_on = []
    model.layers[0].ln1.register_forward_hook(lambda m, i, o: ran_on.append(str(o.device)))
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if on_gpu else None
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    x, target = batch(device)  # the same batch on every rank
    shard = slice(rank * 8 // world, (rank + 1) * 8 // world)

    def mean_over_ranks(t):
        dist.all_reduce(t)
        return t / world

    losses, grads, params = train(model, x[shard], target[shard], reduce=mean_over_ranks)
    seen = [None] * world
    dist.all_gather_object(seen, sorted(set(ran_on)))
    if rank == 0:
        strip = len("module.") if wrap == "ddp" else 0
        torch.save({"losses": losses, "grads": {k[strip:]: v for k, v in grads.items()},
                    "params": {k[strip:]: v for k, v in params.items()}, "devices": seen,
                    "on_gpu": on_gpu}, out)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def launch(out, wrap: str, norm: str, cuda_devices: str | None = None) -> dict:
    """Run this worker on two ranks under torchrun; returns what rank 0 saved.
    ``cuda_devices``: CUDA_VISIBLE_DEVICES for the ranks ("" for none: the CPU)."""
    import subprocess

    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.getcwd())
    if cuda_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_devices
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.ddp_worker", str(out), wrap, norm]  # fmt: skip
    for _ in range(2):
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        # gloo's threads can abort a CPU rank as the process exits (std::terminate on a thread
        # still joinable), after the work is done: that run is repeated once, no other failure
        if run.returncode == 0 or "terminate called without an active exception" not in run.stderr:
            break
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return torch.load(out)


def check_against_one_process(got: dict, norm: str, device) -> None:
    """The ranks' losses, last gradients and trained parameters against the same model with
    torch's own norms trained on the whole batch in this process."""
    torch.manual_seed(0)
    model = gpt_block(NORMS[norm][1]).to(device)
    losses, grads, params = train(model, *batch(device))
    assert set(got["grads"]) == set(grads) and set(got["params"]) == set(params)
    for a, b in zip(got["losses"], losses):
        assert abs(a - b) <= 1e-4 * abs(b) + 1e-6, (got["losses"], losses)
    for name in grads:
        assert torch.allclose(got["grads"][name], grads[name], rtol=1e-3, atol=1e-5), name
        assert torch.allclose(got["params"][name], params[name], rtol=1e-4, atol=1e-6), name


if __name__ == "__main__":
    main(*sys.argv[1:4])
