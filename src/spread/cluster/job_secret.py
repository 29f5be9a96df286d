"""The job token of a job on several machines, without copying a secret to each by hand.

Every rendezvous value and control-plane proof of a job is sealed with its token (HMAC), so processes
of other jobs, or of other users, can never join it. On one machine ``spread run`` draws a fresh token.
Across machines every node needs the same one, and none may travel over the network (the rendezvous
store is readable by anyone who can reach it). In order:

1. ``SPREAD_JOB_TOKEN`` in the environment: set once where the job is submitted, it reaches every
   machine through the scheduler (``srun`` exports the submitting environment; on Kubernetes, a
   Secret referenced by the job's pods).
2. Otherwise the token is derived from the user's secret file and the job id:
   ``HMAC-SHA256(secret, run id)``. The file (``SPREAD_SECRET_FILE``, or ``~/.config/spread/secret``)
   is made on first use, readable by its owner only; clusters share home directories, so every node
   reads the same file. Only the user (and root) can read it; nothing derived from it but the
   HMAC-sealed values ever reaches the network, and every job id gets its own token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from spread import env as spread_env

SECRET_FILE_ENV = "SPREAD_SECRET_FILE"


def secret_file() -> Path:
    chosen = os.environ.get(SECRET_FILE_ENV)
    return Path(chosen) if chosen else Path.home() / ".config" / "spread" / "secret"


def _read_or_make(path: Path) -> bytes:
    """The user's secret, made (32 random bytes, mode 600) if absent; refused if others can read it."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Written whole under a private name, then linked into place: a launcher starting at the same
        # moment sees either no file or the full secret, never an empty one (link fails if it exists).
        draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(draft, path)
            except FileExistsError:  # another node (shared home) or launcher made it first: use theirs
                pass
        finally:
            draft.unlink(missing_ok=True)
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"the job secret {path} must be a regular file of this user readable by nobody else "
            f"(it is {stat.filemode(info.st_mode)}, owner uid {info.st_uid}): chmod 600 {path}"
        )
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise ValueError(f"the job secret {path} is shorter than 32 characters: remove it to make a new one")
    return secret.encode()


def shared_job_token(run_id: str) -> str:
    """The token every node of job ``run_id`` computes alike (see the module's docstring)."""
    token = os.environ.get(spread_env.JOB_TOKEN, "")
    if token:
        return token
    path = secret_file()
    try:
        secret = _read_or_make(path)
    except OSError as exc:
        raise ValueError(
            f"a job on several machines needs one token on every machine: set {spread_env.JOB_TOKEN} where "
            f"the job is submitted (the scheduler passes it on), or give every machine the same "
            f"{SECRET_FILE_ENV} (default {path}; could not use it: {exc})"
        ) from exc
    return hmac.new(secret, f"spread job {run_id}".encode(), hashlib.sha256).hexdigest()[:32]
