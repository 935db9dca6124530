"""Placement: which rank runs which global stage.

Stages are numbered globally. A model cut into ``n`` pieces has ``n`` model stages; a
placement may hold several replicas of that chain (Chimera runs two pipelines in opposite
directions), so it numbers *virtual* stages ``replica * n + model_stage``. Data flows from
virtual stage ``s`` to ``s + 1`` inside one replica. Every placement but Chimera's has one
replica, where virtual and model stages coincide.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """Maps each virtual stage to a rank. Build with the class methods."""

    kind: str
    num_ranks: int
    stage_to_rank: tuple[int, ...]
    num_model_stages: int

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"a placement needs at least one rank, got {self.num_ranks}")
        if self.num_model_stages < 1 or len(self.stage_to_rank) % self.num_model_stages:
            raise ValueError(
                f"{len(self.stage_to_rank)} virtual stages are not whole replicas of "
                f"{self.num_model_stages} model stages"
            )
        for stage, rank in enumerate(self.stage_to_rank):
            if not 0 <= rank < self.num_ranks:
                raise ValueError(
                    f"stage {stage} is placed on rank {rank}, outside 0..{self.num_ranks - 1}"
                )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def linear(cls, p: int) -> Placement:
        """Stage s on rank s."""
        return cls("linear", p, tuple(range(p)), p)

    @classmethod
    def looped(cls, p: int, v: int) -> Placement:
        """v stages per rank, stage s on rank s mod p (interleaved 1F1B, looped BFS)."""
        return cls("looped", p, tuple(s % p for s in range(p * v)), p * v)

    @classmethod
    def v_shape(cls, p: int) -> Placement:
        """Rank r holds stages r and 2p-1-r (ZB-V, DualPipeV)."""
        ranks = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
        return cls("v", p, ranks, 2 * p)

    @classmethod
    def bidirectional(cls, p: int) -> Placement:
        """Chimera: replica 0 puts model stage j on rank j, replica 1 on rank p-1-j."""
        down = tuple(range(p))
        up = tuple(p - 1 - j for j in range(p))
        return cls("bidirectional", p, down + up, p)

    @classmethod
    def custom(
        cls, stage_to_rank: tuple[int, ...] | list[int], num_ranks: int | None = None
    ) -> Placement:
        """Any map from stages to ranks, one replica (user schedule files)."""
        ranks = tuple(stage_to_rank)
        return cls(
            "custom", num_ranks if num_ranks is not None else max(ranks) + 1, ranks, len(ranks)
        )

    # ----------------------------------------------------------------- queries
    @property
    def num_stages(self) -> int:
        """Number of virtual stages (model stages times replicas)."""
        return len(self.stage_to_rank)

    @property
    def replicas(self) -> int:
        return self.num_stages // self.num_model_stages

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def model_stage(self, stage: int) -> int:
        return stage % self.num_model_stages

    def replica(self, stage: int) -> int:
        return stage // self.num_model_stages

    def replicas_of(self, model_stage: int) -> tuple[int, ...]:
        """The virtual stages that hold copies of one model stage."""
        return tuple(r * self.num_model_stages + model_stage for r in range(self.replicas))

    def prev_stage(self, stage: int) -> int | None:
        """The stage whose output feeds ``stage``, or None for a first stage."""
        return None if self.is_first(stage) else stage - 1

    def next_stage(self, stage: int) -> int | None:
        """The stage that consumes the output of ``stage``, or None for a last stage."""
        return None if self.is_last(stage) else stage + 1

    def is_first(self, stage: int) -> bool:
        return self.model_stage(stage) == 0

    def is_last(self, stage: int) -> bool:
        return self.model_stage(stage) == self.num_model_stages - 1
