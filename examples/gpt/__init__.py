"""A small GPT trainer of our own for ucpd's demo and tests: Megatron-style tensor parallelism
(column/row-parallel linears, fused QKV with grouped-query heads, a vocabulary-parallel
embedding with padding), pipeline parallelism, ZeRO-1 AdamW over data-parallel ranks, a
learning-rate schedule and a deterministic data stream — as torch.distributed gloo processes.

    from gpt import RunSpec, run_job, losses                 # with examples/ on sys.path
    ref = losses(run_job(RunSpec(tp=2, pp=2)))               # {step: loss}

``model`` holds the network and its placements, ``trainer`` the loop and the checkpoint state,
``launch`` the process launcher, ``daemons`` a team of ``ucpd serve`` processes.
"""

from .model import GPTConfig, GPTStage, placement_of
from .trainer import RunSpec, TrainConfig, Trainer
from .launch import Job, JobFailed, losses, run_job

__all__ = ["GPTConfig", "GPTStage", "Job", "JobFailed", "RunSpec", "TrainConfig", "Trainer", "losses", "placement_of", "run_job"]
