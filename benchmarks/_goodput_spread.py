"""``goodput.py``'s spread mode: W1 under MultiWorkerMirrored with ``BackupAndRestore``, for
``spread run --nnodes 1:2 --max-restarts K``: a lost node fails the step, the launcher restarts the
ranks at the smaller size and they resume from the last backup; a node that comes back starts a new
round (the ranks back up on the launcher's SIGTERM, so that round loses no step).

    spread run ... _goodput_spread.py --steps 960 --batches 16 --save-every 20 --backup-dir D --out W.pt
        --started S
"""

from __future__ import annotations

import torch
from _goodput_workload import W1Data, mark_first_step, model_and_optimizer, save_weights, script_arguments

import spread
from spread.callbacks import BackupAndRestore, Callback


class MarkFirstStep(Callback):
    """Rank 0 marks the first step it trains (``Callback`` hooks run on every rank)."""

    def __init__(self, path: str, rank: int) -> None:
        super().__init__()
        self.path, self.rank, self.done = path, rank, False

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if self.rank == 0 and not self.done:
            mark_first_step(self.path)
            self.done = True


def main() -> None:
    parser = script_arguments(__doc__.splitlines()[0])
    args = parser.parse_args()
    if args.steps % args.batches:
        parser.error(f"--steps {args.steps} is not a whole number of epochs of --batches {args.batches}")
    torch.set_num_threads(1)
    data = W1Data(args.batches, quick=args.quick)
    # "native" (gloo over TCP), as between machines: "auto" would pick shared memory, the "nodes"
    # being processes of one machine here, and the other modes all-reduce over TCP.
    strategy = spread.MultiWorkerMirroredStrategy(communication="native")
    with strategy.scope():
        model, loss_fn, optimizer = model_and_optimizer(quick=args.quick)
    trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy)
    backup = BackupAndRestore(args.backup_dir, save_freq=args.save_every, delete_checkpoint=False)
    trainer.fit(
        (data.inputs, data.targets),
        epochs=args.steps // args.batches,
        global_batch_size=data.global_batch,
        shuffle=False,
        callbacks=[backup, MarkFirstStep(args.started, strategy.rank)],
        verbose=0,
    )
    if strategy.rank == 0:
        save_weights(model, args.out)
    strategy.close()


if __name__ == "__main__":
    main()
