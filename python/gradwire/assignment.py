"""Data assigned by the run: which pages of the run's corpus a node reads in a round.

A run that declares a :class:`DataAssignment` (its ``seed``, how many ``pages`` the corpus is cut into, and
``pages_per_node``) makes what an honest node should train on knowable: :func:`assigned_pages` maps (run seed,
node id, round) to the node's pages, and nodes, validators and tests all call it. :func:`random_pages` draws the
validators' control batch (pages nobody was told to read in particular).

The draw is fully specified, so a node written in another language reproduces it from SHA-256 alone:

1. A stream of 64-bit words. ``key`` is the concatenation of a domain string and the draw's integers, each as 8
   bytes little-endian: ``b"gradwire/assigned_pages/v1" + seed + node_id + round`` for :func:`assigned_pages`,
   ``b"gradwire/random_pages/v1" + seed + round + salt`` for :func:`random_pages`. Block ``i`` (``i`` = 0, 1, …)
   is ``SHA-256(key + i as 8 bytes little-endian)``; each block gives four words, its bytes 0–7, 8–15, 16–23,
   24–31 read little-endian. SHA-256 in counter mode is a well-studied generator (the construction of NIST
   SP 800-90A's Hash_DRBG), defined by one hash every language has, with no library-specific sampling.
2. A uniform integer below ``n``: take the next word ``x``; if ``x >= 2**64 - (2**64 % n)`` discard it and take
   another (rejection keeps it exactly uniform); else the integer is ``x % n``.
3. ``count`` distinct pages of ``0 … pages-1``: a Fisher–Yates shuffle of ``[0, 1, …, pages-1]`` stopped after
   ``count`` steps. Step ``j`` (``j`` = 0 … count-1) draws ``r`` uniform below ``pages - j``, swaps the entries at
   ``j`` and ``j + r``, and outputs the entry now at ``j``. The pages come out in that order (not sorted).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["AssignmentError", "DataAssignment", "assigned_pages", "random_pages"]

#: The domain strings that open the two draws' keys (module docstring, step 1).
ASSIGNED_DOMAIN = b"gradwire/assigned_pages/v1"
RANDOM_DOMAIN = b"gradwire/random_pages/v1"
#: Every integer of a key is written as 8 bytes little-endian: at most this.
U64_MAX = (1 << 64) - 1


class AssignmentError(ValueError):
    """A data assignment, or a draw from one, given values it cannot take (the message names them)."""


def _u64(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AssignmentError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not 0 <= value <= U64_MAX:
        raise AssignmentError(f"{name} must be in 0..2**64-1, got {value}")
    return value


@dataclass(frozen=True)
class DataAssignment:
    """How a run deals out its data: ``pages`` pages (0 … pages-1), ``pages_per_node`` of them to each node each
    round, drawn from ``seed`` (module docstring)."""

    seed: int
    pages: int
    pages_per_node: int

    def __post_init__(self) -> None:
        _u64("seed", self.seed)
        if _u64("pages", self.pages) < 1:
            raise AssignmentError(f"pages must be at least 1, got {self.pages}")
        if not 1 <= _u64("pages_per_node", self.pages_per_node) <= self.pages:
            raise AssignmentError(f"pages_per_node must be in 1..pages={self.pages}, got {self.pages_per_node}")


def _words(key: bytes) -> Iterator[int]:
    block = 0
    while True:
        digest = hashlib.sha256(key + block.to_bytes(8, "little")).digest()
        for i in range(0, 32, 8):
            yield int.from_bytes(digest[i : i + 8], "little")
        block += 1


def _below(words: Iterator[int], n: int) -> int:
    limit = (1 << 64) - ((1 << 64) % n)
    for x in words:
        if x < limit:
            return x % n
    raise AssertionError("unreachable: the word stream is endless")


def _draw(key: bytes, pages: int, count: int) -> list[int]:
    """``count`` distinct pages below ``pages`` by a partial Fisher–Yates shuffle; the swapped entries are kept in
    a dict, so a draw costs O(count) whatever the number of pages."""
    words = _words(key)
    moved: dict[int, int] = {}
    out = []
    for j in range(count):
        k = j + _below(words, pages - j)
        at_j, at_k = moved.get(j, j), moved.get(k, k)
        moved[j], moved[k] = at_k, at_j
        out.append(at_k)
    return out


def _key(domain: bytes, *values: int) -> bytes:
    return domain + b"".join(v.to_bytes(8, "little") for v in values)


def assigned_pages(assignment: DataAssignment, node_id: int, round: int) -> list[int]:
    """The ``pages_per_node`` distinct pages node ``node_id`` reads in round ``round`` (module docstring):
    the same on every machine, different across nodes and rounds."""
    key = _key(ASSIGNED_DOMAIN, assignment.seed, _u64("node_id", node_id), _u64("round", round))
    return _draw(key, assignment.pages, assignment.pages_per_node)


def random_pages(assignment: DataAssignment, round: int, count: int, salt: int) -> list[int]:
    """``count`` distinct pages for round ``round``'s control batch (a validator's, told apart by ``salt``),
    drawn independently of every node's assignment."""
    if not 1 <= _u64("count", count) <= assignment.pages:
        raise AssignmentError(f"count must be in 1..pages={assignment.pages}, got {count}")
    key = _key(RANDOM_DOMAIN, assignment.seed, _u64("round", round), _u64("salt", salt))
    return _draw(key, assignment.pages, count)
