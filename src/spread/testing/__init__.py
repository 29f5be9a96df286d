"""Helpers to test distributed code: run functions as ranks of a real job, with hard timeouts.

Public so that users can test their own distributed training code the way spread tests itself.
"""

from spread.testing.harness import RankResult, RanksFailed, launch_ranks, run_ranks
from spread.testing.processes import process_alive, reap_survivors
from spread.testing.ps_jobs import chief_of, ps_job_env, run_ps_job
from spread.testing.time_budget import budget, time_scale

__all__ = [
    "RankResult",
    "RanksFailed",
    "budget",
    "chief_of",
    "launch_ranks",
    "process_alive",
    "ps_job_env",
    "reap_survivors",
    "run_ps_job",
    "run_ranks",
    "time_scale",
]
