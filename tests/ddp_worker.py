"""Worker of test_torch_gpu.test_ddp_on_two_gpus_gives_the_single_gpu_gradients, run under
``torchrun --nproc_per_node=2 -m tests.ddp_worker OUT``: each rank trains one step of the
cupyln-normed model on its half of the batch under DistributedDataParallel (NCCL); rank 0
saves the averaged gradients to OUT."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cupyln.torch as clt
from cupyln.bench_frameworks import gpt_block


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = gpt_block(clt.LayerNorm).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 64, 128, device="cuda", generator=g)  # the same batch on every rank
    target = x[..., :8].sum(-1)
    shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
    F.mse_loss(ddp(x[shard]), target[shard]).backward()
    if rank == 0:
        torch.save({k: p.grad.detach().cpu() for k, p in model.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
