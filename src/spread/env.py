"""Every ``SPREAD_*`` environment variable, named once. ``docs/architecture.md`` has the table of who
sets and reads each."""

JOB_TOKEN = "SPREAD_JOB_TOKEN"  # the job's shared secret: rendezvous namespace, control-plane proofs
INIT_TIMEOUT = "SPREAD_INIT_TIMEOUT"  # seconds to join a job (default 120)
COLLECTIVE_TIMEOUT = "SPREAD_COLLECTIVE_TIMEOUT"  # seconds one collective may take (default 300)
RESTART_COUNT = "SPREAD_RESTART_COUNT"  # the attempt number under `spread run --max-restarts`
LAUNCHER = "SPREAD_LAUNCHER"  # "1" in the ranks `spread run` starts
STDOUT_TTY = "SPREAD_STDOUT_TTY"  # "1": `spread run` relays this rank's stdout to a terminal
EXIT_TIMEOUT = "SPREAD_EXIT_TIMEOUT"  # seconds the release at interpreter exit may take (default 10)
PS_TRANSPORT = "SPREAD_PS_TRANSPORT"  # the parameter servers' RPC layer: "zmq" (default) or "grpc"
PS_REPLACEMENT = "SPREAD_PS_REPLACEMENT"  # "N": the Nth restart of a lost server (--recover)
PS_RESTORE_TIMEOUT = "SPREAD_PS_RESTORE_TIMEOUT"  # seconds to wait for a server's restore (120)
DEBUG_COLLECTIVES = "SPREAD_DEBUG_COLLECTIVES"  # "1": log every collective
TUNE_MALLOC = "SPREAD_TUNE_MALLOC"  # "0": leave glibc's allocator as it is (cluster/allocator.py)
TRACE_DIR = "SPREAD_TRACE_DIR"  # `spread run --trace DIR`: every fit traces a window of steps into DIR
RECOVER = "SPREAD_RECOVER"  # "1": `spread run --recover`: survivors of a lost rank regroup and train on
JOIN = "SPREAD_JOIN"  # "1": this machine's ranks join a running --recover job (set by spread run)
REGROUP_TIMEOUT = "SPREAD_REGROUP_TIMEOUT"  # seconds survivors wait for each other at a regroup (default 30)
LAUNCHER_ID = "SPREAD_LAUNCHER_ID"  # `spread run --recover`, several machines: id of its machine report
HOST_ID = "SPREAD_HOST_ID"  # the machine's name as ranks compare it (default: the host name)
CHECKPOINT_CRASH_AT = "SPREAD_CHECKPOINT_CRASH_AT"  # chaos tests: die at a named point of a save
