"""Parallel degrees of a run and the device meshes built from them.

Rank layout (row-major, cp innermost): rank = (r * dp_shard + s) * cp + c for replica r, shard s and
context-parallel rank c. The world mesh always has the three named dims ("dp_replicate", "dp_shard",
"cp"), size-1 ones included, so callers never branch on which dims exist, plus two flattened dims:
"dp" (dp_replicate x dp_shard: ranks that read different data) and "dp_shard_cp" (dp_shard x cp: the
ranks FSDP2 shards the dense parameters over; cp ranks see different tokens of the same sequences, so
they also hold different parameter shards, as in torchtitan).

Expert parallelism is carved out of the dp_shard x cp ranks (docs/architecture.md §5): the experts are split
over `ep` consecutive ranks of that group (`ep_rank` is the rank arithmetic) and FSDP-sharded over the
remaining dp_shard*cp/ep ones. Its mesh `ep_mesh` (dims "dp_replicate", "dp_shard_mod_ep", "ep": the
dp_shard x cp ranks in rank order, cut into groups of `ep` consecutive ones) is built with the world mesh,
only when ep > 1 (no mesh that nothing uses). (Design borrowed from torchtitan's ParallelDims; see
THIRD_PARTY_NOTICES.md.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llm_training.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")
EP_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "ep")


@dataclass
class ParallelDims:
    """Degrees of data (replicate x shard), context and expert parallelism over `world_size` ranks."""

    dp_replicate: int
    dp_shard: int  # -1: world_size / (dp_replicate x cp)
    cp: int
    ep: int
    world_size: int
    # Set by build_mesh(); None in a single process without a process group (nothing to shard over).
    world_mesh: "DeviceMesh | None" = field(default=None, init=False, repr=False, compare=False)
    # Set by build_mesh() when ep > 1: the expert-parallel mesh (EP_MESH_DIMS); None otherwise.
    ep_mesh: "DeviceMesh | None" = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = {
            "dp_replicate": "data_parallel_replicate_degree",
            "cp": "context_parallel_degree",
            "ep": "expert_parallel_degree",
        }
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        for attr, key in names.items():
            if getattr(self, attr) < 1:
                raise ConfigError(f"[parallelism] {key} must be >= 1, got {getattr(self, attr)}")
        others = self.dp_replicate * self.cp
        layout = (
            f"data_parallel_replicate_degree ({self.dp_replicate}) x data_parallel_shard_degree "
            f"({self.dp_shard}) x context_parallel_degree ({self.cp})"
        )
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ConfigError(
                    f"[parallelism] cannot fill data_parallel_shard_degree = -1: world size {self.world_size} is not "
                    f"divisible by data_parallel_replicate_degree x context_parallel_degree = {others}; launch a "
                    f"multiple of {others} processes or change those degrees"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ConfigError(f"[parallelism] data_parallel_shard_degree must be -1 or >= 1, got {self.dp_shard}")
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ConfigError(
                f"[parallelism] {layout} = {self.dp_replicate * self.dp_shard * self.cp} must equal the world size "
                f"{self.world_size} (processes launched); set data_parallel_shard_degree = -1 to use the rest, or "
                f"launch that many processes"
            )
        if (self.dp_shard * self.cp) % self.ep != 0:
            raise ConfigError(
                f"[parallelism] expert_parallel_degree = {self.ep} must divide data_parallel_shard_degree x "
                f"context_parallel_degree = {self.dp_shard} x {self.cp} = {self.dp_shard * self.cp} (experts are "
                f"split over those ranks); pick a divisor of {self.dp_shard * self.cp}"
            )

    @classmethod
    def from_config(cls, parallelism: Any, world_size: int) -> "ParallelDims":
        """From the [parallelism] section of a JobConfig."""
        return cls(
            dp_replicate=parallelism.data_parallel_replicate_degree,
            dp_shard=parallelism.data_parallel_shard_degree,
            cp=parallelism.context_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            world_size=world_size,
        )

    # ------------------------------------------------------------------ sizes and switches
    @property
    def dp_size(self) -> int:
        """Ranks that read different data (the data loader shards over these)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 shards parameters when the dp_shard x cp group has more than one rank."""
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # ------------------------------------------------------------------ rank arithmetic (no process group needed)
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, shard, cp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return rank // (self.dp_shard * self.cp), (rank // self.cp) % self.dp_shard, rank % self.cp

    def dp_rank(self, rank: int) -> int:
        """Data-parallel rank of a global rank (which data shard it reads); cp ranks of a group share it."""
        r, s, _ = self.coords(rank)
        return r * self.dp_shard + s

    def cp_rank(self, rank: int) -> int:
        return self.coords(rank)[2]

    def ep_rank(self, rank: int) -> int:
        """Position of a global rank inside its expert-parallel group."""
        r, s, c = self.coords(rank)
        return (s * self.cp + c) % self.ep

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """Create the world mesh (and, when ep > 1, the EP mesh); needs an initialized default process group.
        Called once per process, by `distributed.utils.setup_distributed`."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.world_mesh is not None:
            raise RuntimeError("ParallelDims.build_mesh called twice: the mesh is built once, at setup")
        mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.cp), mesh_dim_names=MESH_DIMS)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        self.world_mesh = mesh
        if self.ep_enabled:
            self.ep_mesh = init_device_mesh(
                device_type,
                (self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep),
                mesh_dim_names=EP_MESH_DIMS,
            )
        return mesh
