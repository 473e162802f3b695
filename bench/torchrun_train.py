"""The torchrun baseline: a training script written the way torchrun users resize today. torch
DDP over gloo (NCCL on GPUs), the same model, data order and optimiser as the elastic runtime; on
SIGTERM every rank finishes the step, rank 0 saves a checkpoint to disk, and every (re)started
worker reloads it. Rank 0 appends "step end_time world_size" to the timeline file after each step,
from which bench/resize.py reads the pauses and bench/overhead.py the step times.

    torchrun ... bench/torchrun_train.py --spec JSON --checkpoint PATH --timeline PATH
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from elastic.spec import JobSpec  # noqa: E402
from elastic.tasks.runtime import bind_task  # noqa: E402
from elastic.worker.data import SampleStream  # noqa: E402
from elastic.workloads import CATALOGUE  # noqa: E402

STOPPED_EXIT_CODE = 75


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="a job spec as JSON")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--timeline", type=Path, required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--code-dir", type=Path, help="the job's own code, for a spec that names code")
    parser.add_argument("--no-stop-flag", action="store_true", help="plain DDP: no per-step stop vote")
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) and gradients zeroed in place, not freed: one gradient "
        "memory for the run, as the elastic runtime's flat buffer",
    )
    parser.add_argument(
        "--one-bucket",
        action="store_true",
        help="every gradient in one DDP bucket (bucket_cap_mb past the model's size): the all-reduce "
        "waits for the whole backward, as the elastic runtime's does, instead of overlapping it",
    )
    args = parser.parse_args()
    stopping = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = JobSpec(**json.loads(args.spec))
    if spec.workload is not None:
        info = CATALOGUE[spec.workload]
        problem = bind_task(info.path, info.entrypoint, spec.hyperparameters, spec.seed, device)
    else:
        assert args.code_dir is not None and spec.entrypoint is not None, "a spec with code needs --code-dir"
        problem = bind_task(args.code_dir, spec.entrypoint, spec.hyperparameters, spec.seed, device)
    model = problem.model
    optimizer = problem.make_optimizer()
    step = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = DistributedDataParallel(
        model, gradient_as_bucket_view=args.bucket_view, **({"bucket_cap_mb": model_mb + 1} if args.one_bucket else {})
    )
    stream = SampleStream(problem.num_samples, spec.seed)
    flag = torch.zeros(1, device=device)
    timeline = open(args.timeline, "a") if rank == 0 else None
    while step < spec.total_steps():
        indices = stream.local_batch(step, problem.batch_size, world, rank)
        optimizer.zero_grad(set_to_none=not args.bucket_view)
        problem.loss(problem.batch(indices), model=ddp).backward()
        optimizer.step()
        step += 1
        if not args.no_stop_flag:
            flag.fill_(1.0 if stopping else 0.0)
            dist.all_reduce(flag)
        if timeline is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            timeline.write(f"{step} {time.time()} {world}\n")
            timeline.flush()
        if not args.no_stop_flag and flag.item() > 0:
            if rank == 0:
                temporary = args.checkpoint.with_suffix(".tmp")
                torch.save(
                    {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
                    temporary,
                )
                os.replace(temporary, args.checkpoint)
            dist.barrier()
            return STOPPED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
