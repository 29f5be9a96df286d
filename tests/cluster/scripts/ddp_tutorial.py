"""A DDP training script in the style of the widely copied torchrun tutorials (written here).

Plain torch.distributed: init_process_group("gloo") from the env, DistributedSampler, DDP, a
snapshot saved every epoch and loaded on start (so a restarted job resumes), dist.barrier,
destroy_process_group. It knows nothing of spread. ``--fail-rank R --fail-epoch E`` makes rank R raise
in epoch E of the first attempt only (TORCHELASTIC_RESTART_COUNT == 0).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    dist.init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, fail):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.fail = fail
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        losses = [self._run_batch(source, targets) for source, targets in self.train_data]
        if self.fail == (self.global_rank, epoch) and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise RuntimeError(f"simulated crash on rank {self.global_rank} in epoch {epoch}")
        mean = torch.tensor(sum(losses) / len(losses))
        dist.all_reduce(mean)
        if self.global_rank == 0:
            print(f"Epoch {epoch} | loss {mean.item() / dist.get_world_size():.8f}")

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)
            dist.barrier()


def main(total_epochs, save_every, batch_size, snapshot_path, fail):
    ddp_setup()
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    train_data = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset)
    )
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, fail)
    trainer.train(total_epochs)
    if dist.get_rank() == 0:
        print("final weight sum", f"{model.weight.sum().item():.8f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-epoch", type=int, default=-1)
    args = parser.parse_args()
    main(
        args.total_epochs, args.save_every, args.batch_size, args.snapshot, (args.fail_rank, args.fail_epoch)
    )
