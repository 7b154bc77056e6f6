"""The node path's shard map (docs/DISTRIBUTED.md, sections 1-2): which elements of a layer's flat buffer each of
the node's G ranks owns. Plain arithmetic, no torch: the engine's shard copies and collectives
(engine/parallel/collectives.py, engine/parallel/node_path.py) and the planner read the same map.

A layer's flat buffer of `numel` elements is padded to a multiple of world·granule elements (`padded_numel`) and
cut into chunks of `chunk` elements (a multiple of world·granule; the last chunk is shorter, but still such a
multiple). Rank r owns the r-th of the world equal pieces of every chunk: one contiguous range per chunk, the same
number of elements on every rank. With one chunk (a layer shorter than `chunk`) rank r owns [r·n/G, (r+1)·n/G),
DISTRIBUTED.md section 1's map. Chunks bound the FP32 buffers of the gradients' reduce-scatter (section 2); the
weights' gather uses the same map, so a rank's shard copy reads exactly the masters it updates. The granule keeps
every piece's start aligned (64 elements: 128 bytes in bf16, 256 in FP32) for the copy engines and NCCL. Padding
is not a parameter: a copy or an update skips it (`ShardMap.owned`).
"""

from __future__ import annotations

from dataclasses import dataclass

GRANULE = 64  # elements: every shard piece starts at a multiple (128 B in bf16, 256 B in FP32)
DEFAULT_CHUNK = 32 * 2**20  # elements per reduce-scatter chunk: 128 MiB of FP32 (DISTRIBUTED.md section 2)



def padded_numel(numel: int, world: int, granule: int = GRANULE) -> int:
    """`numel` rounded up to a multiple of world·granule: what a layer's flat buffer holds on the node path."""
    _check_positive(world=world, granule=granule)
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    unit = world * granule
    return -(-numel // unit) * unit


def default_chunk(world: int, granule: int = GRANULE) -> int:
    """DEFAULT_CHUNK rounded down to a multiple of world·granule (at least one such unit)."""
    unit = world * granule
    return max(unit, DEFAULT_CHUNK // unit * unit)


@dataclass(frozen=True)
class ShardMap:
    """Which elements of one layer's (padded) flat buffer each of `world` ranks owns; see the module's doc."""

    numel: int  # the layer's elements (its parameters)
    world: int
    chunk: int
    granule: int = GRANULE

    def __post_init__(self) -> None:
        _check_positive(world=self.world, chunk=self.chunk, granule=self.granule)
        if self.numel < 0:
            raise ValueError(f"numel={self.numel} must be >= 0")
        if self.chunk % (self.world * self.granule):
            raise ValueError(f"chunk={self.chunk} elements is not a multiple of world x granule = {self.world} x "
                             f"{self.granule}: every chunk must split into equal aligned pieces; use "
                             f"default_chunk({self.world}) or a multiple of {self.world * self.granule}")

    @classmethod
    def of(cls, numel: int, world: int, chunk: int | None = None, granule: int = GRANULE) -> ShardMap:
        """The map with `chunk` elements per chunk (default_chunk(world) when None)."""
        return cls(numel, world, default_chunk(world, granule) if chunk is None else chunk, granule)

    @property
    def padded(self) -> int:
        return padded_numel(self.numel, self.world, self.granule)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (padding included): the same on every rank."""
        return self.padded // self.world

    def chunks(self) -> list[tuple[int, int]]:
        """(start, length) of every chunk of the padded buffer, in order; every length a multiple of world."""
        return [(a, min(self.chunk, self.padded - a)) for a in range(0, self.padded, self.chunk)]

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """[start, end) of rank `rank`'s piece of every chunk, in the padded buffer's coordinates."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is outside a map of world={self.world}")
        out = []
        for a, length in self.chunks():
            piece = length // self.world
            out.append((a + rank * piece, a + (rank + 1) * piece))
        return out

    def owned(self, rank: int) -> list[tuple[int, int]]:
        """rank `rank`'s ranges clipped to the layer's parameters (no padding; empty ranges dropped): what its
        update reads and writes."""
        return [(a, min(b, self.numel)) for a, b in self.ranges(rank) if a < self.numel]


def shard_ranges(numel: int, world: int, chunk: int | None = None,
                 granule: int = GRANULE) -> list[list[tuple[int, int]]]:
    """Every rank's [start, end) ranges of a layer of `numel` elements (padded coordinates): the ownership map."""
    m = ShardMap.of(numel, world, chunk, granule)
    return [m.ranges(r) for r in range(world)]



def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")



def owned_elements(numel: int, world: int, rank: int, chunk: int | None = None, granule: int = GRANULE) -> int:
    """How many of a layer's `numel` parameters rank `rank` owns (its shard copy's elements, its update's)."""
    return sum(b - a for a, b in ShardMap.of(numel, world, chunk, granule).owned(rank))
