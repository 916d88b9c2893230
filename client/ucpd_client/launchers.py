"""Where this process sits in the job, as its launcher said: rank, world size, local rank and
local size (the job's ranks on this node), read from the environment of torchrun, Slurm's
``srun``, Open MPI's ``mpirun``, MPICH/Intel MPI's Hydra (PMI), MVAPICH2 and Cray PALS.

A team of daemons completes a version on a node when the node's *local size* ranks sealed it,
so the local size must be right; torchrun is the only launcher that sets ``LOCAL_WORLD_SIZE``.

| launcher | rank | world size | local rank | local size |
|---|---|---|---|---|
| torchrun / torch.distributed.run | ``RANK`` | ``WORLD_SIZE`` | ``LOCAL_RANK`` | ``LOCAL_WORLD_SIZE`` |
| Open MPI (``mpirun``, ``srun --mpi=pmix`` with Open MPI) | ``OMPI_COMM_WORLD_RANK`` | ``OMPI_COMM_WORLD_SIZE`` | ``OMPI_COMM_WORLD_LOCAL_RANK`` | ``OMPI_COMM_WORLD_LOCAL_SIZE`` |
| MPICH / Intel MPI (Hydra, PMI-1/2) | ``PMI_RANK`` | ``PMI_SIZE`` | ``MPI_LOCALRANKID`` | ``MPI_LOCALNRANKS`` |
| MVAPICH2 | ``MV2_COMM_WORLD_RANK`` | ``MV2_COMM_WORLD_SIZE`` | ``MV2_COMM_WORLD_LOCAL_RANK`` | ``MV2_COMM_WORLD_LOCAL_SIZE`` |
| Cray PALS / PMI (``aprun``, ``mpiexec`` on HPE) | ``PALS_RANKID`` / ``PMI_RANK`` | ``PMI_SIZE`` | ``PALS_LOCAL_RANKID`` / ``PMI_LOCAL_RANK`` | ``PMI_LOCAL_SIZE`` |
| Slurm ``srun`` | ``SLURM_PROCID`` | ``SLURM_NTASKS`` (``SLURM_STEP_NUM_TASKS``) | ``SLURM_LOCALID`` | this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``, ``SLURM_NTASKS_PER_NODE``), picked by ``SLURM_NODEID`` |

Slurm writes tasks per node as a compressed list: ``4(x2),3`` is 4, 4, 3 tasks on nodes 0, 1
and 2 (``parse_slurm_counts``). ``SLURM_NTASKS_PER_NODE`` is only set by
``--ntasks-per-node`` and is then one number (or the same list form).

Launchers are tried in the order of the table, field by field. A launcher's local size is only
believed when its world size (where it sets one) equals the job's: an ``sbatch`` script running
one ``torchrun`` per node leaves Slurm variables about *other* tasks in the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Launcher:
    """The variables one launcher sets (None: it sets none for that field)."""

    name: str
    rank: tuple[str, ...]
    world_size: tuple[str, ...]
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]


LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)),
    Launcher("Open MPI", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
             ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    Launcher("MPICH/Hydra", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    Launcher("MVAPICH2", ("MV2_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_LOCAL_RANK",),
             ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    Launcher("Cray PMI", ("PALS_RANKID", "PMI_RANK"), ("PMI_SIZE",), ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
             ("PMI_LOCAL_SIZE",)),
    Launcher("Slurm", ("SLURM_PROCID",), ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_LOCALID",), ()),
)

# where a local size came from when no launcher said it (the Checkpointer then assumes the world)
NO_LOCAL_SIZE = ("no launcher variable says it (torchrun's LOCAL_WORLD_SIZE, Slurm's, Open MPI's, PMI's), "
                 "so the whole world size was assumed")

_SLURM_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_slurm_counts(text: str) -> list[int]:
    """Slurm's compressed per-node counts: ``"4(x2),3"`` -> ``[4, 4, 3]``; ``"8"`` -> ``[8]``.
    Raises ValueError on anything else."""
    out: list[int] = []
    for item in text.replace(" ", "").split(","):
        m = _SLURM_ITEM.match(item)
        if m is None:
            raise ValueError(f"not a Slurm per-node count list: {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[int, str] | None:
    for name in names:
        text = env.get(name, "").strip()
        if text.isdigit():
            return int(text), name
    return None


def _slurm_local_size(env: Mapping[str, str]) -> tuple[int, str] | None:
    """This node's tasks of the Slurm step (or job): the per-node list entry at SLURM_NODEID."""
    node = env.get("SLURM_NODEID", "").strip()
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        text = env.get(name, "").strip()
        if not text:
            continue
        try:
            counts = parse_slurm_counts(text)
        except ValueError:
            continue
        if len(counts) == 1:
            return counts[0], f"{name}={text}"
        if node.isdigit() and int(node) < len(counts):
            return counts[int(node)], f"{name}={text} at SLURM_NODEID={node}"
    return None


@dataclass(frozen=True)
class Place:
    """Where this process sits: each field with the variable it came from (``source``)."""

    rank: int | None
    world_size: int | None
    local_rank: int | None
    local_size: int | None
    source: Mapping[str, str]

    def describe(self, field: str) -> str:
        return self.source.get(field, "no launcher variable")


def detect(env: Mapping[str, str] | None = None, world_size: int | None = None) -> Place:
    """Rank, world size, local rank and local size from the launcher variables in ``env``
    (default ``os.environ``); None where no launcher says. ``world_size``: the job's, when known
    (torch.distributed's): a launcher that says another world size is not believed about the
    local size either."""
    env = os.environ if env is None else env
    values: dict[str, int] = {}
    source: dict[str, str] = {}
    for launcher in LAUNCHERS:
        own_world = _int(env, launcher.world_size)
        want = world_size if world_size is not None else values.get("world_size")
        foreign = own_world is not None and want is not None and own_world[0] != want
        for field in ("rank", "world_size", "local_rank", "local_size"):
            if field in values or foreign:
                continue
            found = _slurm_local_size(env) if launcher.name == "Slurm" and field == "local_size" else _int(
                env, getattr(launcher, field))
            if found is not None:
                values[field] = found[0]
                source[field] = f"{launcher.name} {found[1] if '=' in found[1] else f'{found[1]}={found[0]}'}"
    return Place(values.get("rank"), values.get("world_size"), values.get("local_rank"), values.get("local_size"), source)


def run_id(env: Mapping[str, str] | None = None) -> str | None:
    """One id per run of the job, the same on every rank, from the launcher (None: none says):
    Slurm's job, step and restart count (a requeued job or a new ``srun`` step is a new run),
    PMIx's namespace, Open MPI's job id."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}-{env.get('SLURM_RESTART_COUNT', '0')}"
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"):
        if env.get(name):
            return f"{name.lower()}-{env[name]}"
    return None
