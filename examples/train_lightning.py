"""A PyTorch Lightning script on stella_mpi: Lightning's DDPStrategy with stella's communication
hook, so DDP's gradient buckets cross clusters through stella's route (dense inside a cluster).

    stellarun -np 4 --clusters 2 python examples/train_lightning.py --compression cacheaware

Lightning finds the MPI job itself (its MPIEnvironment); stella_mpi.ddp.init_process_group()
makes torch.distributed's group before the Trainer starts, and Lightning uses it. The strategy
is Lightning's DDPStrategy with the same arguments, save that it registers the hook on CPU too
(Lightning's own drops it there without a word: stella_mpi/ddp/lightning.py). The same byte
LM and data as examples/train_horovod.py. Needs ``pip install lightning`` (stella_mpi[lightning]).
"""
import argparse
import json
import os
import sys

import torch

import lightning as L

import stella_mpi as hvd                  # stella
from stella_mpi import ddp as stella_ddp  # stella
from stella_mpi.ddp.lightning import StellaDDPStrategy  # stella: Lightning's DDPStrategy, its hook on CPU too

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stdlib_text import ByteBatches, ByteMLP, load_corpus  # noqa: E402


class Batches(torch.utils.data.IterableDataset):
    """This rank's own stream of batches (as train_horovod.py draws them)."""

    def __init__(self, corpus, context, batch_size, seed, steps):
        self.data = ByteBatches(corpus, context, batch_size, seed)
        self.steps = steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.data.next()


class ByteLM(L.LightningModule):
    def __init__(self, hidden, lr, momentum, compression):
        super().__init__()
        self.net = ByteMLP(32, hidden=hidden)
        self.lr, self.momentum = lr, momentum
        self.hook_state = stella_ddp.StellaHookState(self, compression=compression)   # stella

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return stella_ddp.wrap_optimizer(opt, self.hook_state)   # stella: STELLA_NONFINITE=skip's no-update


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compression", default="auto", help="auto, none, fp16, cacheaware, topk, thc")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--json-out")
    args = p.parse_args()

    stella_ddp.init_process_group()   # stella: torch.distributed from the MPI job, before the Trainer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.compression == "auto":
        compression = None
    elif args.compression in ("none", "fp16", "bf16"):
        compression = getattr(hvd.Compression, args.compression)
    elif args.compression == "thc":
        compression = hvd.Compression.thc(bits=4)
    else:
        compression = getattr(hvd.Compression, args.compression)(density=args.density)
    model = ByteLM(args.hidden, args.lr, args.momentum, compression)
    corpus = load_corpus()
    data = torch.utils.data.DataLoader(Batches(corpus, 32, args.batch_size, 1 + hvd.rank(), args.steps),
                                       batch_size=None)
    strategy = StellaDDPStrategy(ddp_comm_state=model.hook_state, ddp_comm_hook=stella_ddp.stella_hook,   # stella
                                 bucket_cap_mb=64)   # one bucket per 64 MB: the sparse route selects within each
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=hvd.local_size(),
                        num_nodes=hvd.size() // hvd.local_size(), max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model, data)

    vx, vy = ByteBatches(corpus, 32, args.batch_size, seed=1).validation()
    with torch.no_grad():
        val = hvd.allreduce(torch.nn.functional.cross_entropy(model(vx), vy), name="val_loss").item()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="final_parameters")
    identical = all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))
    if hvd.rank() == 0:
        print("done: %d steps (Lightning, DDPStrategy with stella_hook: %s); validation loss %.4f; parameters "
              "identical on all %d ranks: %s" % (trainer.global_step, getattr(model.hook_state.compression, "name",
                                                                             model.hook_state.compression), val,
                                                  hvd.size(), identical), flush=True)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"steps": trainer.global_step, "validation_loss": val, "identical": identical,
                           "parameters": sum(q.numel() for q in model.parameters()),
                           "hook_steps": model.hook_state.step,
                           "wan_bytes_sent": hvd.stats()["total"]["wan_bytes_sent"]}, f)
    if not identical:
        raise SystemExit("parameters differ between ranks")


if __name__ == "__main__":
    main()
