"""One family of exceptions, each saying what went wrong and what to do about it.

Every error raised on purpose by spread derives from :class:`SpreadError`, so callers can catch the
family; the subclasses carry the fields (rank, operation, variable) that tests and tooling read.
"""

from __future__ import annotations


class SpreadError(RuntimeError):
    """Base class for errors raised by spread."""


class ClusterSpecError(SpreadError, ValueError):
    """The cluster description (env vars, TF_CONFIG, SLURM, CLI flags) is malformed.

    ``variable`` names the environment variable or flag, ``field`` the part of it that is wrong.
    """

    def __init__(self, variable: str, field: str, problem: str) -> None:
        self.variable = variable
        self.field = field
        self.problem = problem
        where = variable if not field else f"{variable}: field {field!r}"
        super().__init__(f"malformed cluster spec in {where}: {problem}")


class WorldSizeError(SpreadError, ValueError):
    """A strategy needs a different number of processes than the job has (``needed``, ``available``)."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        self.needed, self.available = needed, available
        super().__init__(message)


class RendezvousError(SpreadError):
    """Processes could not meet: unreachable store, missing ranks, mismatched world sizes."""


class JobTokenError(RendezvousError):
    """This process's job token does not match the job it tried to join."""


class CollectiveError(SpreadError):
    """A collective operation failed; names this rank, the operation and its sequence number."""

    def __init__(self, rank: int, op: str, seq: int, detail: str, *, peer: int | None = None) -> None:
        self.rank = rank
        self.op = op
        self.seq = seq
        self.peer = peer
        self.detail = detail
        who = f"rank {rank}: {op} #{seq}"
        if peer is not None:
            who += f" (peer rank {peer})"
        super().__init__(f"{who} failed: {detail}")


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the timeout (a peer is slow, hung or skipped it)."""


class PeerLostError(CollectiveError):
    """A peer process closed its connection mid-collective (it died or exited early)."""


class PeerFailedError(SpreadError):
    """This rank stops only because another rank failed (that rank's own error is the cause).

    Launchers report the other rank: ``spread run`` leaves this error out when it names the rank
    that failed first.
    """

    def __init__(self, rank: int, peer: int, detail: str) -> None:
        self.rank, self.peer = rank, peer
        super().__init__(f"rank {rank}: rank {peer} failed: {detail}")


class CheckpointCorruptError(SpreadError):
    """A checkpoint failed verification; ``path`` names the file or directory."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        super().__init__(f"checkpoint {path} is unusable: {problem}")


class NonFiniteLossError(SpreadError, FloatingPointError):
    """The loss became NaN or infinite and the policy is to stop."""


class TrainingOutOfMemoryError(SpreadError, MemoryError):
    """A training step ran out of memory; the message says what the process holds and what would
    hold less."""


class CheckpointMismatchError(SpreadError, ValueError):
    """A valid checkpoint does not fit what it is loaded into (model, optimizer, strategy, shards).

    ``problems`` lists every mismatched key or field, so one error tells the whole story.
    """

    def __init__(self, path: str, what: str, problems: list[str]) -> None:
        self.path = path
        self.what = what
        self.problems = list(problems)
        listing = "; ".join(problems[:20]) + (
            f"; ... {len(problems) - 20} more" if len(problems) > 20 else ""
        )
        super().__init__(
            f"checkpoint {path} does not match the {what} it is loaded into: {listing} "
            "(to start afresh instead, use another directory or remove that checkpoint)"
        )


class WireFormatError(SpreadError, ValueError):
    """A parameter-server frame is malformed (bad dtype code, size or shape); it was not allocated."""


class RemoteCallError(SpreadError):
    """A call to another task's server failed; names the peer (role, index, address) and the operation."""

    def __init__(self, peer: str, op: str, detail: str) -> None:
        self.peer = peer
        self.op = op
        self.detail = detail
        super().__init__(f"{peer}: {op} failed: {detail}")


class ParameterServerError(RemoteCallError):
    """A parameter server could not be reached or refused a call (it died, is overloaded, or differs).

    ``server``: the failing server's task index, where the client knows it (every call it makes to
    the servers of a job); the in-place restore waits for that server."""

    server: int | None = None


class PipelineStageError(SpreadError):
    """A pipeline stage died or stopped responding; ``dead_stages`` names it (with its ``dead_ranks``).

    Raised on every surviving stage, so each process exits with the same diagnosis.
    """

    def __init__(self, rank: int, stage: int, dead: list[tuple[int, int]], op: str, detail: str) -> None:
        self.rank = rank
        self.stage = stage
        self.dead_ranks = [r for r, _ in dead]
        self.dead_stages = sorted({s for _, s in dead})
        who = ", ".join(f"stage {s} (rank {r})" for r, s in dead) or "a peer stage (unidentified)"
        super().__init__(
            f"pipeline {who} died or stopped responding; stage {stage} (rank {rank}) gave up during "
            f"{op}: {detail}"
        )
